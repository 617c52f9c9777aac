"""Bilevel tasks: concrete inner/outer losses, each a registered ``[task]`` section."""

from radbo.tasks.base import TASKS, TaskConfig
from radbo.tasks.feature_l2 import FeatureL2
from radbo.tasks.few_shot import EpisodeSampler, FewShot, FewShotEvaluator
from radbo.tasks.hyper_representation import HyperRepresentation
from radbo.tasks.vs_loss import VSLoss, VSLossTask, balanced_class_weights, vs_cross_entropy

__all__ = [
    "TASKS",
    "EpisodeSampler",
    "FeatureL2",
    "FewShot",
    "FewShotEvaluator",
    "HyperRepresentation",
    "TaskConfig",
    "VSLoss",
    "VSLossTask",
    "balanced_class_weights",
    "vs_cross_entropy",
]
