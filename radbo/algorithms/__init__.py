"""Federated bilevel algorithms: one file each, state + pure phase functions.

Each module registers its ``[algorithm]`` config section in :data:`ALGORITHMS` when imported;
importing this package registers the built-in ones.
"""

from radbo.algorithms.aggitd import AggITD, AggITDConfig, AggITDState
from radbo.algorithms.base import ALGORITHMS, AlgorithmConfig, Wiring
from radbo.algorithms.fedavg import FedAvg, FedAvgConfig, FedAvgState
from radbo.algorithms.fedmbo import FedMBO, FedMBOConfig, FedMBOState
from radbo.algorithms.fedmsa import FedMSA, FedMSAConfig, FedMSAState
from radbo.algorithms.fednest import (
    FedNest,
    FedNestConfig,
    FedNestState,
    LFedNest,
    LFedNestConfig,
)
from radbo.algorithms.fedsvrbgd_fo import FedSVRBGD, FedSVRBGDConfig, FedSVRBGDState
from radbo.algorithms.maml import MAML, MAMLConfig
from radbo.algorithms.protonet import ProtoNet, ProtoNetConfig
from radbo.algorithms.rabo import RABO, RAFBO, RABOConfig, RABOState, RAFBOConfig
from radbo.algorithms.shrofbo import ShroFBO, ShroFBOConfig
from radbo.algorithms.simfbo import SimFBO, SimFBOConfig, SimFBOState

__all__ = [
    "ALGORITHMS",
    "AggITD",
    "AggITDConfig",
    "AggITDState",
    "RABO",
    "AlgorithmConfig",
    "FedAvg",
    "FedAvgConfig",
    "FedAvgState",
    "FedMBO",
    "FedMBOConfig",
    "FedMBOState",
    "FedMSA",
    "FedMSAConfig",
    "FedMSAState",
    "FedNest",
    "FedNestConfig",
    "FedNestState",
    "FedSVRBGD",
    "FedSVRBGDConfig",
    "FedSVRBGDState",
    "LFedNest",
    "LFedNestConfig",
    "MAML",
    "MAMLConfig",
    "ProtoNet",
    "ProtoNetConfig",
    "RABOConfig",
    "RABOState",
    "RAFBO",
    "RAFBOConfig",
    "ShroFBO",
    "ShroFBOConfig",
    "SimFBO",
    "SimFBOConfig",
    "SimFBOState",
    "Wiring",
]
