"""Bilevel tasks: concrete inner/outer losses."""

from radbo.tasks.feature_l2 import FeatureL2
from radbo.tasks.hyper_representation import HyperRepresentation
from radbo.tasks.vs_loss import VSLoss, balanced_class_weights, vs_cross_entropy

__all__ = [
    "FeatureL2",
    "HyperRepresentation",
    "VSLoss",
    "balanced_class_weights",
    "vs_cross_entropy",
]
