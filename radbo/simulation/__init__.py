"""The simulation engine and its backends."""

from radbo.simulation.batched import BatchedBackend
from radbo.simulation.engine import (
    RoundRecord,
    SequentialBackend,
    Simulation,
    full_index_set,
    update_problem,
)

__all__ = [
    "BatchedBackend",
    "RoundRecord",
    "SequentialBackend",
    "Simulation",
    "full_index_set",
    "update_problem",
]
