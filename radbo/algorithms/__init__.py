"""Federated bilevel algorithms: one file each, state + pure phase functions."""

from radbo.algorithms.fedmbo import FedMBO, FedMBOState
from radbo.algorithms.fedmsa import FedMSA, FedMSAState
from radbo.algorithms.rabo import RABO, RABOState
from radbo.algorithms.shrofbo import ShroFBO
from radbo.algorithms.simfbo import SimFBO, SimFBOState

__all__ = [
    "RABO",
    "FedMBO",
    "FedMBOState",
    "FedMSA",
    "FedMSAState",
    "RABOState",
    "ShroFBO",
    "SimFBO",
    "SimFBOState",
]
