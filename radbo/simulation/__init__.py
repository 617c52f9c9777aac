"""The simulation engine and its backends."""

from radbo.simulation.auto import AutoBackend
from radbo.simulation.backends import BACKENDS, BackendKind, gpu_refusal
from radbo.simulation.batched import BatchedBackend
from radbo.simulation.divergence import DivergenceError
from radbo.simulation.engine import SequentialBackend, Simulation, full_index_set
from radbo.simulation.participation import Participation, Turnout
from radbo.simulation.persist import RUN_CHECKPOINT, EngineState, forget_end_of_run_evaluation
from radbo.simulation.processes import ClientWorkerError, ProcessBackend
from radbo.simulation.record import RoundObserver, RoundRecord, RoundRow
from radbo.simulation.screening import update_problem

__all__ = [
    "AutoBackend",
    "BACKENDS",
    "RUN_CHECKPOINT",
    "BackendKind",
    "BatchedBackend",
    "ClientWorkerError",
    "DivergenceError",
    "EngineState",
    "Participation",
    "ProcessBackend",
    "RoundObserver",
    "RoundRecord",
    "RoundRow",
    "SequentialBackend",
    "Simulation",
    "Turnout",
    "forget_end_of_run_evaluation",
    "full_index_set",
    "gpu_refusal",
    "update_problem",
]
