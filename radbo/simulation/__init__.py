"""The simulation engine and its backends."""

from radbo.simulation.batched import BatchedBackend, register_batched
from radbo.simulation.engine import (
    Algorithm,
    Backend,
    ClientBudget,
    ClientResult,
    ClientRuntime,
    ClientTask,
    CostRecord,
    MaskAssigner,
    Phase,
    RoundRecord,
    SequentialBackend,
    Simulation,
    derive_seed,
    update_problem,
)

__all__ = [
    "Algorithm",
    "Backend",
    "BatchedBackend",
    "ClientBudget",
    "ClientResult",
    "ClientRuntime",
    "ClientTask",
    "CostRecord",
    "MaskAssigner",
    "Phase",
    "RoundRecord",
    "SequentialBackend",
    "Simulation",
    "derive_seed",
    "register_batched",
    "update_problem",
]
