"""Batched simulation: clients whose work has the same shapes run as one stacked computation.

:class:`BatchedBackend` implements the engine's :class:`~radbo.client.Backend` protocol for
every algorithm: a phase's client work is a :class:`~radbo.client.ClientWork`, written once
for a :class:`~radbo.client.Cohort` (see :mod:`radbo.client`). The backend draws every task's
randomness with the task's own generator (``work.prepare``), groups the tasks whose received
tensors, submodel shapes and draws have equal shapes (:func:`~radbo.client.stack_key`; local
step counts may differ -- a client past its last step is frozen), stacks each group along a new
leading dimension and runs ``work.run`` once per group: the problem's losses go through
``torch.vmap`` and every per-client quantity (inner products, step sizes, CG's stopping test,
norms for clipping) stays per client (:mod:`radbo.autodiff`). Work that is a plain function
rather than a :class:`~radbo.client.ClientWork` runs one client at a time.

**Ragged minibatches.** A client holding fewer examples than a minibatch draws a shorter one.
Where the runtime :attr:`~radbo.client.ClientRuntime.pads` (the task's losses are a mean
cross-entropy over examples, and no layer mixes examples: no BatchNorm, no dropout), the
minibatches an algorithm declares :attr:`~radbo.client.Prepared.ragged` do not split a group:
the cohort pads the shorter ones with :data:`~radbo.problem.PAD_INDEX`, whose target
cross-entropy ignores, so each client's loss is the mean over its own examples. Without it,
each minibatch length was a cohort of its own: the demo fleet of 100 clients ran 26 stacked
cohorts per phase (and a dozen single clients) where it now runs 3, one per submodel shape
(``benchmarks/padding.py``). Counts and FLOPs are those of the unpadded client.

FLOPs are what each client alone would execute: :func:`~radbo.client.run_measured` measures
a workload it has not seen by running the work for that one client under the FLOP counter.

**Equality with the sequential backend.** Counts, bytes, FLOPs and the ledger are exactly
those of the sequential path. Values agree to the rounding of the stacked kernels: a batched
matrix product or reduction may sum in another order than the unbatched one, so float32 states
differ in the last bits (``tests/simulation/test_batched.py`` bounds the difference from the
dtype and checks float64 runs to 1e-12 relative for every algorithm).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from radbo.client import (
    ClientResult,
    ClientRuntime,
    ClientTask,
    ClientWork,
    Cohort,
    Prepared,
    run_measured,
    stack_key,
)
from radbo.cost import FlopMeter
from radbo.simulation.backends import BACKENDS

__all__ = ["BatchedBackend", "stack_groups"]


def stack_groups(
    work: ClientWork, runtime: ClientRuntime, tasks: Sequence[ClientTask]
) -> tuple[list[Prepared], dict[Hashable, list[int]]]:
    """Every task's draws (``work.prepare``, from the task's own generator) and the positions
    of the tasks that can run as one stacked cohort, by :func:`~radbo.client.stack_key`, in
    the order the keys first appear; where the runtime :attr:`~radbo.client.ClientRuntime.pads`,
    minibatches of different lengths do not split a group (the cohort pads them)."""
    prepared = [work.prepare(runtime, task) for task in tasks]
    groups: dict[Hashable, list[int]] = {}
    for i, (task, draws) in enumerate(zip(tasks, prepared, strict=True)):
        groups.setdefault(stack_key(task, draws, runtime.pads), []).append(i)
    return prepared, groups


@BACKENDS.register("batched")
@dataclass
class BatchedBackend:
    """Runs groups of same-shape client workloads as one stacked computation.

    Args:
        min_group: groups smaller than this run one client at a time (default 2).
        max_group: largest stack; bigger groups are split in chunks (``None``: no limit).
    """

    min_group: int = 2
    max_group: int | None = None

    @classmethod
    def from_runtime(cls, runtime: Any) -> BatchedBackend:
        return cls()

    def __post_init__(self) -> None:
        if self.min_group < 1:
            raise ValueError(f"BatchedBackend.min_group must be >= 1, got {self.min_group}")
        if self.max_group is not None and self.max_group < 1:
            raise ValueError(f"BatchedBackend.max_group must be >= 1, got {self.max_group}")

    def run(
        self,
        work: Callable[[ClientRuntime, ClientTask], ClientResult],
        runtime: ClientRuntime,
        meter: FlopMeter | None,
        tasks: Sequence[ClientTask],
    ) -> list[ClientResult]:
        if not isinstance(work, ClientWork):
            return [run_measured(work, runtime, meter, task) for task in tasks]
        prepared, groups = stack_groups(work, runtime, tasks)
        results: list[ClientResult | None] = [None] * len(tasks)
        for members in groups.values():
            size = self.max_group or len(members)
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                for i, result in zip(
                    chunk, self._run(work, runtime, tasks, prepared, chunk), strict=True
                ):
                    results[i] = run_measured(work, runtime, meter, tasks[i], result)
        return [r for r in results if r is not None]

    def _run(
        self,
        work: ClientWork,
        runtime: ClientRuntime,
        tasks: Sequence[ClientTask],
        prepared: Sequence[Prepared],
        chunk: Sequence[int],
    ) -> list[ClientResult]:
        if len(chunk) < self.min_group:
            return [work.run(runtime, Cohort.single(tasks[i], prepared[i]))[0] for i in chunk]
        cohort = Cohort.stack([tasks[i] for i in chunk], [prepared[i] for i in chunk])
        return work.run(runtime, cohort)
