"""The simulation engine and its backends."""

from radbo.simulation.backends import BACKENDS, BackendKind, gpu_refusal
from radbo.simulation.batched import BatchedBackend
from radbo.simulation.divergence import DivergenceError
from radbo.simulation.engine import (
    RoundRecord,
    SequentialBackend,
    Simulation,
    full_index_set,
    update_problem,
)
from radbo.simulation.processes import ClientWorkerError, ProcessBackend

__all__ = [
    "BACKENDS",
    "BackendKind",
    "BatchedBackend",
    "ClientWorkerError",
    "DivergenceError",
    "ProcessBackend",
    "RoundRecord",
    "SequentialBackend",
    "Simulation",
    "full_index_set",
    "gpu_refusal",
    "update_problem",
]
