"""The simulation engine and its backends."""

from radbo.simulation.backends import BACKENDS, BackendKind, gpu_refusal
from radbo.simulation.batched import BatchedBackend
from radbo.simulation.divergence import DivergenceError
from radbo.simulation.engine import SequentialBackend, Simulation, full_index_set
from radbo.simulation.participation import Participation, Turnout
from radbo.simulation.processes import ClientWorkerError, ProcessBackend
from radbo.simulation.record import RoundObserver, RoundRecord
from radbo.simulation.screening import update_problem

__all__ = [
    "BACKENDS",
    "BackendKind",
    "BatchedBackend",
    "ClientWorkerError",
    "DivergenceError",
    "Participation",
    "ProcessBackend",
    "RoundObserver",
    "RoundRecord",
    "SequentialBackend",
    "Simulation",
    "Turnout",
    "full_index_set",
    "gpu_refusal",
    "update_problem",
]
