"""Bilevel tasks: concrete inner/outer losses."""

from radbo.tasks.feature_l2 import FeatureL2
from radbo.tasks.hyper_representation import HyperRepresentation

__all__ = ["FeatureL2", "HyperRepresentation"]
