"""The ``auto`` backend: per workload family, stacked or one by one, whichever it measured faster.

Stacking clients (:class:`~radbo.simulation.BatchedBackend`) saves per-operation overhead: on
one CPU thread it wins by 2.3-8.7x on the demo MLP and 1.4-3.5x on CNN7 at 10 and 50 clients
(``benchmarks/batched.py``), but is only at par (0.91-1.05x) with FedAvg on pfl-research's
CIFAR-10 CNN, whose operations are large enough that there is no overhead to save, and with
RABO on it (0.96-1.00x at 10 clients, 1.03x at 50; BENCHMARKS.md, "A trim threshold is a
cliff").
Which side wins depends on the model, the group size and the machine, so :class:`AutoBackend`
measures it, once per *workload family*: the client work's function,
:func:`~radbo.client.stack_key` (phase, submodel shapes, received tensors, draws) and the group
size rounded down to a power of two.

* The first group of a family runs one client at a time (warming both the kernels and the FLOP
  meter, whose first count of a workload runs under the counter).
* The second runs the group stacked and then one by one, each timed around its arithmetic
  only (the FLOP meter is charged afterwards, outside the timings); the one-by-one results
  are the ones used, so that round equals the sequential backend bitwise. The faster side is
  recorded in :attr:`AutoBackend.plan`.
* Later groups of the family run the recorded side.

**Results.** One by one is the sequential backend exactly; stacked equals it to the rounding of
the stacked kernels (:mod:`radbo.simulation.batched`): float64 runs agree to 1e-12 relative,
float32 runs in the last bits. Which side a family runs depends on a timing, so two float32
runs of the same seed on different machines (or under different load) can differ in those
bits; counts, bytes, FLOPs and the ledger never do. The plan is part of the engine's checkpoint
state (:meth:`state_dict`), so a resumed run makes the same choices as the uninterrupted one,
and a plan can be given (``AutoBackend(plan=...)``) to repeat another run's choices exactly.
On a GPU each timing waits for the queued kernels (``torch.cuda.synchronize``); that path is
written but was not run (no GPU was lent when it was built). Runs that must be bitwise
reproducible anywhere pick ``"sequential"`` (the default) or ``"batched"`` by name, as
``torch.backends.cudnn.benchmark`` is off by default for the same reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from radbo.client import (
    ClientResult,
    ClientRuntime,
    ClientTask,
    ClientWork,
    Cohort,
    Prepared,
    run_measured,
)
from radbo.cost import FlopMeter
from radbo.simulation.backends import BACKENDS
from radbo.simulation.batched import stack_groups

__all__ = ["AutoBackend", "Side"]

LOG = logging.getLogger("radbo.simulation.auto")

#: How a family's groups run: stacked in one cohort, or one client at a time.
Side = Literal["stacked", "one_by_one"]
_SIDES: tuple[Side, ...] = ("stacked", "one_by_one")


def _bucket(size: int) -> int:
    """``size`` rounded down to a power of two: groups of 10 and 15 clients share a choice."""
    return 1 << (size.bit_length() - 1)


@BACKENDS.register("auto")
@dataclass
class AutoBackend:
    """Runs each workload family stacked or one by one, from a timing made once (module doc).

    Args:
        plan: family -> ``"stacked"`` or ``"one_by_one"``, chosen so far (or given, to repeat
            another run's choices; :meth:`state_dict` holds it).
        timings: family -> ``(stacked_s, one_by_one_s)`` as measured (seconds of arithmetic).
        min_group: groups smaller than this always run one client at a time (default 2).
        clock: the timer (``time.perf_counter``; a test passes its own).
    """

    plan: dict[str, Side] = field(default_factory=dict)
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)
    min_group: int = 2
    clock: Callable[[], float] = time.perf_counter
    _seen: set[str] = field(default_factory=set, init=False, repr=False)

    @classmethod
    def from_runtime(cls, runtime: Any) -> AutoBackend:
        return cls()

    def __post_init__(self) -> None:
        if self.min_group < 2:
            raise ValueError(f"AutoBackend.min_group must be >= 2, got {self.min_group}")
        self._check_plan(self.plan)

    @staticmethod
    def _check_plan(plan: Mapping[str, Any]) -> None:
        bad = [k for k, v in plan.items() if not isinstance(k, str) or v not in _SIDES]
        if bad:
            raise ValueError(
                f"an auto backend plan maps families to 'stacked' or 'one_by_one'; "
                f"not so for {bad[:3]}"
            )

    @staticmethod
    def family(work: ClientWork, key: Hashable, size: int) -> str:
        """The name of the family of a group of ``size`` tasks sharing ``key``."""
        run = work.run
        name = getattr(run, "__qualname__", None) or type(run).__qualname__
        return f"{name} {key!r} x{_bucket(size)}"

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
        for key, members in groups.items():
            group = [tasks[i] for i in members]
            draws = [prepared[i] for i in members]
            ran = self._group(work, runtime, key, group, draws)
            for i, result in zip(members, ran, strict=True):
                results[i] = run_measured(work, runtime, meter, tasks[i], result)
        return [r for r in results if r is not None]

    def _group(
        self,
        work: ClientWork,
        runtime: ClientRuntime,
        key: Hashable,
        tasks: Sequence[ClientTask],
        prepared: Sequence[Prepared],
    ) -> list[ClientResult]:
        """One group's results, on its family's side (measuring it the second time)."""
        if len(tasks) < self.min_group:
            return _one_by_one(work, runtime, tasks, prepared)
        family = self.family(work, key, len(tasks))
        side = self.plan.get(family)
        if side == "stacked":
            return work.run(runtime, Cohort.stack(tasks, prepared))
        if side == "one_by_one":
            return _one_by_one(work, runtime, tasks, prepared)
        if family not in self._seen:  # warm-up: kernels, caches, the meter's first count
            self._seen.add(family)
            return _one_by_one(work, runtime, tasks, prepared)
        start = self._now()
        work.run(runtime, Cohort.stack(tasks, prepared))
        middle = self._now()
        results = _one_by_one(work, runtime, tasks, prepared)
        end = self._now()
        stacked, single = middle - start, end - middle
        self.timings[family] = (stacked, single)
        self.plan[family] = "stacked" if stacked < single else "one_by_one"
        LOG.info(
            "auto backend: %s: stacked %.4f s, one by one %.4f s -> %s",
            family,
            stacked,
            single,
            self.plan[family],
        )
        return results

    def _now(self) -> float:
        """The clock, once the GPU (if one is in use) has finished what was queued: CUDA
        kernels run asynchronously, so a timing that does not wait measures their launches."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return self.clock()

    def state_dict(self) -> dict[str, Any]:
        """The choices made so far (JSON), for the engine's checkpoint."""
        return {
            "plan": dict(self.plan),
            "timings": {k: list(v) for k, v in self.timings.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (``ValueError`` when it is not one)."""
        plan = state.get("plan") if isinstance(state, Mapping) else None
        timings = state.get("timings", {}) if isinstance(state, Mapping) else None
        if not isinstance(plan, Mapping) or not isinstance(timings, Mapping):
            raise ValueError("an auto backend state holds a 'plan' and 'timings' mapping")
        self._check_plan(plan)
        try:
            times = {str(k): (float(v[0]), float(v[1])) for k, v in timings.items()}
        except (TypeError, ValueError, IndexError) as exc:
            message = f"an auto backend state's timings are pairs of seconds: {exc}"
            raise ValueError(message) from None
        self.plan = dict(plan)
        self.timings = times


def _one_by_one(
    work: ClientWork,
    runtime: ClientRuntime,
    tasks: Sequence[ClientTask],
    prepared: Sequence[Prepared],
) -> list[ClientResult]:
    """Each client alone, on its own draws: what calling ``work`` on the task computes (the
    draws come from the task's own generator, so they are the sequential backend's)."""
    return [work.run(runtime, Cohort.single(t, p))[0] for t, p in zip(tasks, prepared, strict=True)]
