"""Federated bilevel algorithms: one file each, state + pure phase functions."""

from radbo.algorithms.rabo import RABO, RABOState
from radbo.algorithms.shrofbo import ShroFBO
from radbo.algorithms.simfbo import SimFBO, SimFBOState

__all__ = ["RABO", "RABOState", "ShroFBO", "SimFBO", "SimFBOState"]
