"""The ``auto`` backend: per workload family, stacked or one by one, whichever is faster.

Stacking clients (:class:`~radbo.simulation.BatchedBackend`) saves per-operation overhead: on
one CPU thread it wins by 2.3-8.7x on the demo MLP and 1.4-3.5x on CNN7 at 10 and 50 clients
(``benchmarks/batched.py``), but is only at par (0.91-1.05x) with FedAvg on pfl-research's
CIFAR-10 CNN, whose operations are large enough that there is no overhead to save, and with
RABO on it (0.96-1.00x at 10 clients, 1.03x at 50; BENCHMARKS.md, "A trim threshold is a
cliff"). :class:`AutoBackend` chooses once per *workload family*: the client work's function,
:func:`~radbo.client.stack_key` (phase, submodel shapes, received tensors, draws) and the group
size rounded down to a power of two. Two ways to choose (``choose``):

* ``"size"`` (the default, and ``[runtime] backend = "auto"``): from the size of one client's
  operations, which does not depend on a clock. The first group of a client work (a family
  without its group size: one client's operations do not depend on it) counts one client's
  work once (FLOPs by :func:`radbo.flops.count_flops`, aten operations by a dispatch mode; the
  counted run's results are discarded) and stacks the family when its operations average at most
  ``max_flops_per_op`` FLOPs (default ``1e6`` on a CPU; on a GPU every family stacks, a choice
  not yet measured there against one by one). What stacking saves is the per-operation overhead
  (dispatch, autograd, a kernel launch: microseconds per operation on one CPU thread), which
  operations of about 10^6 FLOPs and more hide. On one CPU thread one client of the demo MLP
  averages 3-35 thousand FLOPs per operation and CNN7 on 16x16 digits 9-105 thousand, both
  1.1-5.6x faster a round stacked at 10 and 50 clients; pfl-research's CIFAR-10 CNN averages
  5.7-27 million, and stacked its rounds ran at 0.89x and 0.94x of one by one at 10 clients
  (``benchmarks/batched.py``, whose last column gives the counts; BENCHMARKS.md). The counts
  come from the work itself (its shapes, and the iterations of a solver that stops early), not
  from a clock: a seed makes the same choices, and so the same results, on every run on a
  machine (the same counts under PyTorch's default, AVX2 and AVX-512 kernels on the demo).
* ``"timing"``: from a timing. The first group of a family runs one client at a time (warming
  the kernels and the FLOP meter); the second runs the group stacked and then one by one, each
  timed around its arithmetic only (the FLOP meter is charged afterwards, outside the
  timings); the one-by-one results are the ones used, so that round equals the sequential
  backend bitwise. Later groups run the faster side. This follows the machine (and its load),
  at the price of choices, and so float32 results, that can differ between two runs of one
  seed.

The choices are recorded in :attr:`AutoBackend.plan` (with the counts in :attr:`sizes` or the
timings in :attr:`timings`) and in the engine's checkpoint state (:meth:`state_dict`), so a
resumed run makes the same choices as the uninterrupted one, and a plan can be given
(``AutoBackend(plan=...)``) to repeat another run's choices exactly.

**A stack that does not fit.** On a GPU every family stacks, and a large model's cohort can
need more device memory than one client's work. Where stacking a group raises
``torch.OutOfMemoryError``, the group runs in consecutive chunks of half that many clients,
halved again until a chunk fits (a chunk of one client runs alone, as one by one does; one
client that does not fit raises as it would on any backend). The largest chunk that fitted is
the family's limit from then on (:attr:`AutoBackend.limits`, in checkpoints too), so later
groups of the family are chunked without failing first, and a resumed run chunks as the
uninterrupted one did. Client work is pure given its draws (made before, from each task's
generator), so a failed attempt changes nothing: the chunked results are what
``BatchedBackend(max_group=limit)`` computes. Where the memory runs out depends on the
device, so a smaller GPU may chunk, and round float32, differently from a larger one.

**Results.** One by one is the sequential backend exactly; stacked equals it to the rounding of
the stacked kernels (:mod:`radbo.simulation.batched`): float64 runs agree to 1e-12 relative,
float32 runs in the last bits; counts, bytes, FLOPs and the ledger are always the sequential
backend's. A run that must equal the sequential backend (or the processes and Flower
backends, which equal it) bitwise picks ``backend = "sequential"``. On a GPU each timing waits
for the queued kernels (``torch.cuda.synchronize``); the GPU paths were written without a GPU
to run them on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from radbo._torch_private import TorchDispatchMode
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
from radbo.schema import is_count, short
from radbo.simulation.backends import BACKENDS
from radbo.simulation.batched import stack_groups

__all__ = ["AutoBackend", "Choose", "Side", "operation_size"]

LOG = logging.getLogger("radbo.simulation.auto")

#: How a family's groups run: stacked in one cohort, or one client at a time.
Side = Literal["stacked", "one_by_one"]
_SIDES: tuple[Side, ...] = ("stacked", "one_by_one")
#: How a family's side is chosen (module doc).
Choose = Literal["size", "timing"]
#: ``max_flops_per_op`` on a CPU: the size of operation above which stacking saves nothing
#: measurable (module doc; the last column of ``benchmarks/batched.py``).
CPU_MAX_FLOPS_PER_OP = 1e6


class _Operations(TorchDispatchMode):
    """Counts the aten operations dispatched under it. Written by hand: ``torch.profiler``
    counts them too, but records every event for a report; this keeps one integer."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def operation_size(run: Callable[[], Any]) -> tuple[int, int]:
    """``(flops, operations)`` of ``run()``: its FLOPs as the FLOP meter counts them
    (:func:`radbo.flops.count_flops`, every operation counted) and the aten operations it
    dispatches. Both come from the work itself, not from a clock. ``run`` must be pure:
    its results are discarded, and it may run twice (``count_flops``'s fallback)."""
    from radbo.flops import count_flops

    operations = _Operations()

    def counted() -> None:
        operations.count = 0
        with operations:
            run()

    flops = count_flops(counted, reuse=False, check=False)
    return flops, operations.count


def _bucket(size: int) -> int:
    """``size`` rounded down to a power of two: groups of 10 and 15 clients share a choice."""
    return 1 << (size.bit_length() - 1)


@BACKENDS.register("auto")
@dataclass
class AutoBackend:
    """Runs each workload family stacked or one by one, as it chose once (module doc).

    Args:
        choose: ``"size"`` (default): from the FLOPs per operation of one client's work;
            ``"timing"``: from one timing of both sides.
        max_flops_per_op: with ``"size"``, families whose operations average at most this
            many FLOPs are stacked (``None``: ``1e6`` on a CPU, every family on a GPU).
        plan: family -> ``"stacked"`` or ``"one_by_one"``, chosen so far (or given, to repeat
            another run's choices; :meth:`state_dict` holds it).
        timings: family -> ``(stacked_s, one_by_one_s)`` as measured (``"timing"``; seconds
            of arithmetic).
        sizes: work -> ``(flops, operations)`` of one client's work as counted
            (``"size"``; :func:`operation_size`), once per work whatever the group size
            (:meth:`work_kind`: the family's name without its group size).
        limits: family -> the most clients stacked at once, set where a larger stack ran out
            of device memory (module doc; ``torch.OutOfMemoryError``).
        min_group: groups smaller than this always run one client at a time (default 2).
        clock: the timer (``time.perf_counter``; a test passes its own).
    """

    choose: Choose = "size"
    max_flops_per_op: float | None = None
    plan: dict[str, Side] = field(default_factory=dict)
    timings: dict[str, tuple[float, float]] = field(default_factory=dict)
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    min_group: int = 2
    clock: Callable[[], float] = time.perf_counter
    _seen: set[str] = field(default_factory=set, init=False, repr=False)

    @classmethod
    def from_runtime(cls, runtime: Any) -> AutoBackend:
        return cls(choose=runtime.auto_choice)

    def __post_init__(self) -> None:
        if self.min_group < 2:
            raise ValueError(f"AutoBackend.min_group must be >= 2, got {self.min_group}")
        if self.choose not in ("size", "timing"):
            raise ValueError(f"AutoBackend.choose is 'size' or 'timing', got {self.choose!r}")
        limit = self.max_flops_per_op
        if limit is not None and not limit >= 0:
            raise ValueError(f"AutoBackend.max_flops_per_op must be >= 0, got {limit}")
        self._check_plan(self.plan)
        self.limits = _checked_limits(self.limits)

    @staticmethod
    def _check_plan(plan: Mapping[str, Any]) -> None:
        bad = [k for k, v in plan.items() if not isinstance(k, str) or v not in _SIDES]
        if bad:
            raise ValueError(
                f"an auto backend plan maps families to 'stacked' or 'one_by_one'; "
                f"not so for {bad[:3]}"
            )

    @staticmethod
    def work_kind(work: ClientWork, key: Hashable) -> str:
        """The name of the work of a group of tasks sharing ``key``, whatever its size: the
        key of :attr:`sizes` (one client's operations do not depend on the group size)."""
        run = work.run
        name = getattr(run, "__qualname__", None) or type(run).__qualname__
        return f"{name} {key!r}"

    @classmethod
    def family(cls, work: ClientWork, key: Hashable, size: int) -> str:
        """The name of the family of a group of ``size`` tasks sharing ``key``: the key of
        :attr:`plan` and :attr:`timings` (a timing depends on the group size)."""
        return f"{cls.work_kind(work, key)} x{_bucket(size)}"

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
        if side is None and self.choose == "size":
            kind = self.work_kind(work, key)
            side = self.plan[family] = self._by_size(kind, work, runtime, tasks[0], prepared[0])
        if side == "stacked":
            return self._stacked(work, runtime, family, tasks, prepared)
        if side == "one_by_one":
            return _one_by_one(work, runtime, tasks, prepared)
        if family not in self._seen:  # warm-up: kernels, caches, the meter's first count
            self._seen.add(family)
            return _one_by_one(work, runtime, tasks, prepared)
        start = self._now()
        self._stacked(work, runtime, family, tasks, prepared)
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

    def _stacked(
        self,
        work: ClientWork,
        runtime: ClientRuntime,
        family: str,
        tasks: Sequence[ClientTask],
        prepared: Sequence[Prepared],
    ) -> list[ClientResult]:
        """The group stacked, in consecutive chunks of at most the family's limit, the limit
        halved where a chunk runs out of device memory (module doc)."""
        results: list[ClientResult] = []
        while len(results) < len(tasks):
            start = len(results)
            end = start + self.limits.get(family, len(tasks))
            group, draws = tasks[start:end], prepared[start:end]
            if len(group) < self.min_group:
                results += _one_by_one(work, runtime, group, draws)
                continue
            ran = _fitting(work, runtime, group, draws)
            if ran is None:  # the attempt's tensors are freed once _fitting has returned
                self.limits[family] = len(group) // 2
                LOG.warning(
                    "auto backend: %s: %d clients stacked ran out of device memory; stacking "
                    "at most %d from now on",
                    family,
                    len(group),
                    self.limits[family],
                )
                continue
            results += ran
        return results

    def _by_size(
        self,
        kind: str,
        work: ClientWork,
        runtime: ClientRuntime,
        task: ClientTask,
        prepared: Prepared,
    ) -> Side:
        """The side of the work ``kind`` from the size of one client's operations (module
        doc): ``task``'s, counted the first time the work is met, whatever the group size, and
        taken from :attr:`sizes` after (groups of other sizes, a resumed run)."""
        limit = self.max_flops_per_op
        if limit is None:
            if runtime.features.device.type != "cpu":
                LOG.info("auto backend: %s: on %s -> stacked", kind, runtime.features.device)
                return "stacked"
            limit = CPU_MAX_FLOPS_PER_OP
        if kind not in self.sizes:
            self.sizes[kind] = operation_size(
                lambda: work.run(runtime, Cohort.single(task, prepared))
            )
        flops, operations = self.sizes[kind]
        side: Side = "stacked" if flops <= limit * max(operations, 1) else "one_by_one"
        LOG.info(
            "auto backend: %s: %d FLOPs in %d operations per client -> %s",
            kind,
            flops,
            operations,
            side,
        )
        return side

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
            "sizes": {k: list(v) for k, v in self.sizes.items()},
            "limits": dict(self.limits),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (``ValueError`` when it is not one). A state
        saved before :attr:`sizes` was kept per work (its keys are families, with the group
        size) loads too: its plan is followed, and a work met in a new group size is counted
        again, as that version did; a state saved before :attr:`limits` existed has none."""
        state = state if isinstance(state, Mapping) else {}  # no plan: refused below
        plan = state.get("plan")
        timings = state.get("timings", {})
        sizes = state.get("sizes", {})
        limits = state.get("limits", {})
        if (
            not isinstance(plan, Mapping)
            or not isinstance(timings, Mapping)
            or not isinstance(sizes, Mapping)
            or not isinstance(limits, Mapping)
        ):
            raise ValueError(
                "an auto backend state holds a 'plan', 'timings', 'sizes' and 'limits' mapping"
            )
        self._check_plan(plan)
        try:
            times = {str(k): (float(v[0]), float(v[1])) for k, v in timings.items()}
        except (TypeError, ValueError, IndexError) as exc:
            message = f"an auto backend state's timings are pairs of seconds: {exc}"
            raise ValueError(message) from None
        counts: dict[str, tuple[int, int]] = {}
        for k, v in sizes.items():
            if not (isinstance(v, list | tuple) and len(v) == 2 and all(map(is_count, v))):
                raise ValueError(f"an auto backend state's sizes are pairs of counts: {short(v)}")
            counts[str(k)] = (v[0], v[1])
        largest = _checked_limits(limits)
        self.plan = dict(plan)
        self.timings = times
        self.sizes = counts
        self.limits = largest


def _checked_limits(limits: Mapping[Any, Any]) -> dict[str, int]:
    """``limits`` as a dict, each a count of at least 1 (``ValueError`` otherwise)."""
    bad = [v for v in limits.values() if not (is_count(v) and v >= 1)]
    if bad:
        raise ValueError(f"an auto backend's limits are counts of at least 1: {short(bad[0])}")
    return {str(k): int(v) for k, v in limits.items()}


def _fitting(
    work: ClientWork,
    runtime: ClientRuntime,
    tasks: Sequence[ClientTask],
    prepared: Sequence[Prepared],
) -> list[ClientResult] | None:
    """The tasks' results as one stacked cohort, or ``None`` where it ran out of device memory
    (``torch.OutOfMemoryError``: CUDA's and other accelerators'; a CPU allocation that fails
    raises another error). The attempt's tensors are released when this returns, with the
    exception's frames."""
    try:
        return work.run(runtime, Cohort.stack(tasks, prepared))
    except torch.OutOfMemoryError:
        return None


def _one_by_one(
    work: ClientWork,
    runtime: ClientRuntime,
    tasks: Sequence[ClientTask],
    prepared: Sequence[Prepared],
) -> list[ClientResult]:
    """Each client alone, on its own draws: what calling ``work`` on the task computes (the
    draws come from the task's own generator, so they are the sequential backend's)."""
    return [work.run(runtime, Cohort.single(t, p))[0] for t, p in zip(tasks, prepared, strict=True)]
