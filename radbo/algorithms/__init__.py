"""Federated bilevel algorithms: one file each, state + pure phase functions."""

from radbo.algorithms.rabo import RABO, RABOState

__all__ = ["RABO", "RABOState"]
