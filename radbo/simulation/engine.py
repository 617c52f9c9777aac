"""The simulation engine: the one loop over clients in radbo.

An algorithm is a list of :class:`Phase` objects (pure functions plus a name). For each round
the engine samples clients, asks the mask assigner for each client's submodel, and for every
phase (1) builds one :class:`ClientTask` per sampled client from the server state, (2) hands
the tasks to a :class:`Backend` that runs the client function on each (sequentially here;
batched and Flower backends plug in through the same interface) and (3) lets the phase's
server function fold the results into the new state. A client function sees only its task
(the tensors it receives, its data indices, its generator seed and its budget) and the
read-only :class:`ClientRuntime`; it keeps no hidden state, so any backend can run it.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from radbo.checkpoint import state_from_tensors, state_to_tensors
from radbo.client import (
    Algorithm,
    Backend,
    ClientBudget,
    ClientResult,
    ClientRuntime,
    ClientTask,
    MaskAssigner,
    Phase,
    run_measured,
)
from radbo.cost import (
    DeviceLike,
    FlopMeter,
    LedgerEntry,
    index_metadata_bytes,
    phase_energy,
    phase_times,
    totals,
)
from radbo.devices.fleet import WindowSchedule
from radbo.masks.coverage_report import CoverageTracker
from radbo.masks.index import coverage_counts
from radbo.problem import ClientData
from radbo.randomness import Stream, derive_seed, task_seed
from radbo.simulation.backends import BACKENDS
from radbo.simulation.divergence import (
    MAX_ROLLBACKS,
    BoxedProblem,
    DivergenceError,
    DivergenceGuard,
    project_outer,
    round_losses,
    state_rms,
)
from radbo.simulation.schedules import draw_local_steps
from radbo.typing import IndexSet, Params

State = TypeVar("State")


@BACKENDS.register("sequential")
class SequentialBackend:
    """Runs clients one after another in this process: radbo's reference backend."""

    @classmethod
    def from_runtime(cls, runtime: Any) -> SequentialBackend:
        return cls()

    def run(
        self,
        work: Callable[[ClientRuntime, ClientTask], ClientResult],
        runtime: ClientRuntime,
        meter: FlopMeter | None,
        tasks: Sequence[ClientTask],
    ) -> list[ClientResult]:
        return [run_measured(work, runtime, meter, task) for task in tasks]


def update_problem(
    update: Mapping[str, Any], index_set: IndexSet, shapes: Mapping[str, torch.Size]
) -> str | None:
    """Why a client's update must not be aggregated, or ``None`` when it is sound.

    Every tensor of an update is in submodel coordinates of a model tensor, named either
    ``name`` or ``"prefix:name"`` (:func:`radbo.masks.index.alias`: SimFBO's v, an estimator's
    state). It must be a floating tensor of the shape the client's index set selects from
    ``name`` and hold no NaN or Inf. A faulty or malicious client can break any of these;
    the engine then rejects the whole update and counts it (``RoundRecord.rejected``).

    >>> import torch
    >>> shapes = {"w": torch.Size([3])}
    >>> update_problem({"w": torch.ones(2)}, {"w": (torch.tensor([0, 2]),)}, shapes) is None
    True
    >>> update_problem({"v:w": torch.ones(3)}, {"w": (torch.tensor([0, 2]),)}, shapes)
    "'v:w' has shape (3,), expected (2,)"
    >>> update_problem({"w": torch.tensor([1.0, float("inf"), 0.0])}, {"w": (None,)}, shapes)
    "'w' holds NaN or Inf"
    """
    for key, tensor in update.items():
        name = key.rsplit(":", 1)[-1]
        if name not in shapes:
            return f"{key!r} is not a model tensor"
        if not isinstance(tensor, Tensor):
            return f"{key!r} is a {type(tensor).__name__}, not a tensor"
        index = index_set.get(name, (None,) * len(shapes[name]))
        expected = tuple(
            n if i is None else int(i.numel()) for i, n in zip(index, shapes[name], strict=True)
        )
        if tuple(tensor.shape) != expected:
            return f"{key!r} has shape {tuple(tensor.shape)}, expected {expected}"
        if tensor.is_floating_point() and not _finite(tensor):
            return f"{key!r} holds NaN or Inf"
    return None


def _finite(tensor: Tensor) -> bool:
    """No NaN or Inf in ``tensor``: its sum is finite (a NaN or an Inf makes every sum NaN or
    infinite), or else, the sum having overflowed, every element is. One reduction and one
    read instead of an elementwise test, a reduction and a read, for every client's update."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _read_once(
    cache: dict[int, ClientData], clients: Sequence[ClientData], client: int
) -> ClientData:
    """``clients[client]``, read once and kept in ``cache`` (a round's phases share it)."""
    found = cache.get(client)
    if found is None:
        found = cache[client] = clients[client]
    return found


#: key prefix of the guard's earlier good state among the engine's checkpoint tensors
_PREVIOUS = "divergence_previous/"


def full_index_set(shapes: Mapping[str, torch.Size]) -> IndexSet:
    """Index set keeping every coordinate of every tensor."""
    return {n: (None,) * len(s) for n, s in shapes.items()}


@dataclass
class RoundRecord:
    """What happened in one round: sampled and unavailable clients, phase metrics, the cost
    ledger (one entry per client and phase), simulated round time and virtual clock, and the
    clients whose update was rejected in each phase (``{phase: [client, ...]}``; see
    :func:`update_problem`) and those that dropped out in each phase. ``failures`` gives the
    reasons a backend reported for the clients it marked lost or rejected
    (``{phase: {client: reason}}``; :attr:`ClientResult.lost` / ``rejected``), written to
    :meth:`as_dict` only when there are any. ``divergence`` is set when the divergence guard
    tripped in this round (:meth:`Simulation.iterate`)."""

    round: int
    clients: list[int]
    metrics: dict[str, float]
    ledger: list[LedgerEntry]
    communication_rounds: int
    wall_time_s: float
    round_time_s: float = 0.0
    clock_s: float = 0.0
    unavailable: list[int] = field(default_factory=list)
    evaluation: dict[str, float] | None = None
    rejected: dict[str, list[int]] = field(default_factory=dict)
    dropped: dict[str, list[int]] = field(default_factory=dict)
    late: dict[str, list[int]] = field(default_factory=dict)
    divergence: dict[str, Any] | None = None
    failures: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def cost(self) -> dict[str, float]:
        """Counters summed over the round's ledger."""
        return totals(self.ledger)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "round": self.round,
            "clients": self.clients,
            "unavailable": self.unavailable,
            "rejected": self.rejected,
            "dropped": self.dropped,
            "late": self.late,
            "communication_rounds": self.communication_rounds,
            "wall_time_s": self.wall_time_s,
            "sim_round_time_s": self.round_time_s,
            "sim_clock_s": self.clock_s,
            **self.metrics,
            **{f"cost_{k}": v for k, v in self.cost.items()},
        }
        if self.evaluation is not None:
            out.update({f"test_{k}": v for k, v in self.evaluation.items()})
        if self.divergence is not None:
            out["divergence"] = self.divergence
        if self.failures:  # only when a backend reported one: other results stay unchanged
            out["failures"] = self.failures
        return out


@dataclass
class Simulation(Generic[State]):
    """Drives an algorithm over a simulated fleet.

    Attributes:
        algorithm: the algorithm (state + phases).
        runtime: read-only client context.
        clients: one :class:`ClientData` per client.
        budgets: one :class:`ClientBudget` per client.
        shapes: full-model shape of every tensor (x, y and buffers).
        masks: the mask assigner, or ``None`` for full models everywhere.
        backend: runs the client functions (default: sequential).
        seed: run seed; every random choice derives from it.
        clients_per_round: how many available clients are sampled (without replacement) per
            round (default: all available).
        weights: per-client aggregation weights (default uniform).
        evaluate: ``model_state -> metrics`` called every ``eval_every`` rounds and at the end.
        profiles: one device profile per client; gives availability draws, the tier of each
            ledger entry and simulated time (``None``: always available, no clock).
        flop_meter: measures FLOPs per distinct workload (``None``: FLOPs are not counted).
        coverage: variable blocks whose coverage the engine reports every round from the
            clients' index sets, e.g. ``{"x": outer names, "y": inner names}``: per block
            ``coverage_{b}_min`` (C* over trained coordinates), ``untrained_fraction_{b}``,
            ``never_trained_fraction_{b}`` (so far) and ``coverage_{b}_histogram``.
        local_steps: optional schedule ``(round, client, generator) -> tau`` overriding each
            budget's local steps every round (e.g. ``UniformLocalSteps``).
        dropout: optional per-client probability of dropping out of a round it was sampled
            for (see :meth:`dropouts`); ``None``: nobody drops out.
        overcommit: FedScale's over-commitment ``oc >= 0``: sample ``ceil(K (1 + oc))`` of the
            available clients for a round that needs K (``clients_per_round``, or all
            available), and in each phase aggregate the first K results to arrive on the
            virtual clock; the later ones are discarded (``RoundRecord.late``).
        phase_deadline_s: results arriving later than this many simulated seconds after a
            phase starts are discarded, and the phase lasts at most that long (``None``: no
            deadline). Needs ``profiles`` (there is no clock without them).
    """

    algorithm: Algorithm[State]
    runtime: ClientRuntime
    clients: Sequence[ClientData]
    budgets: Sequence[ClientBudget]
    shapes: Mapping[str, torch.Size]
    masks: MaskAssigner | None = None
    backend: Backend = field(default_factory=SequentialBackend)
    seed: int = 0
    clients_per_round: int | None = None
    weights: Sequence[float] | None = None
    evaluate: Callable[[Params], dict[str, float]] | None = None
    eval_every: int = 1
    profiles: Sequence[DeviceLike] | None = None
    flop_meter: FlopMeter | None = field(default_factory=FlopMeter)
    local_steps: Callable[[int, int, torch.Generator], int] | None = None
    coverage: Mapping[str, Sequence[str]] = field(default_factory=dict)
    dropout: Sequence[float] | None = None
    overcommit: float = 0.0
    phase_deadline_s: float | None = None
    _trackers: dict[str, CoverageTracker] = field(default_factory=dict, init=False, repr=False)
    # every client's availability in one tensor, gathered from `profiles` (the sequence it was
    # gathered from, the tensor) on the first availability draw
    _availability: tuple[Sequence[DeviceLike], Tensor] | None = field(
        default=None, init=False, repr=False
    )
    # the clients' availability windows (the `profiles` sequence they were gathered from, the
    # schedule or None when no profile has windows), on the first availability draw
    _windows: tuple[Sequence[DeviceLike], WindowSchedule | None] | None = field(
        default=None, init=False, repr=False
    )
    # the divergence guard (from the algorithm's settings, on the first iterate or load) and
    # the algorithm as configured, before any damping
    _guard: DivergenceGuard | None = field(default=None, init=False, repr=False)
    _undamped: Any = field(default=None, init=False, repr=False)
    # the good state before the last good one (a training loss that trips the guard was
    # measured at the last good state, so a rollback goes back to this one), and the same as
    # restored from a checkpoint until iterate has a state to shape it like
    _previous: Any = field(default=None, init=False, repr=False)
    _current: Any = field(default=None, init=False, repr=False)  # the state last yielded
    _previous_saved: tuple[dict[str, Tensor], dict[str, Any]] | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        n = len(self.clients)
        if n == 0:
            raise ValueError("a simulation needs at least one client")
        if len(self.budgets) != n:
            raise ValueError(f"got {n} clients but {len(self.budgets)} budgets")
        if self.weights is not None and len(self.weights) != n:
            raise ValueError(f"got {n} clients but {len(self.weights)} weights")
        if self.profiles is not None and len(self.profiles) != n:
            raise ValueError(f"got {n} clients but {len(self.profiles)} device profiles")
        k = self.clients_per_round
        if k is not None and not 1 <= k <= n:
            raise ValueError(f"clients_per_round must be in [1, {n}], got {k}")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        if not self.overcommit >= 0:
            raise ValueError(f"overcommit must be >= 0, got {self.overcommit}")
        if self.phase_deadline_s is not None and not self.phase_deadline_s > 0:
            raise ValueError(f"phase_deadline_s must be > 0 or None, got {self.phase_deadline_s}")
        if self.dropout is not None:
            if len(self.dropout) != n:
                raise ValueError(f"got {n} clients but {len(self.dropout)} dropout probabilities")
            bad = [q for q in self.dropout if not 0.0 <= q <= 1.0]
            if bad:
                raise ValueError(f"dropout probabilities must be in [0, 1], got {bad[0]}")

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The engine's cross-round state, ``(tensors, JSON data)``, for checkpoints.

        The coverage trackers (never-trained masks, history), the FLOP meter's cache and the
        divergence guard's running values (its rollbacks give the damped step sizes); all
        other randomness and schedules derive from ``(seed, round)``, so this and the
        algorithm state are all a resumed run needs to continue exactly.
        """
        tensors: dict[str, Tensor] = {}
        coverage: dict[str, Any] = {}
        for block, tracker in self._trackers.items():
            masks, meta = tracker.state_dict()
            tensors.update({f"coverage/{block}/{n}": t for n, t in masks.items()})
            coverage[block] = meta
        meter = None if self.flop_meter is None else self.flop_meter.state_dict()
        data: dict[str, Any] = {"coverage": coverage, "flop_meter": meter}
        guard = self._divergence_guard()
        if guard is not None:
            data["divergence"] = guard.state_dict()
            if self._previous is not None:
                previous, scalars = state_to_tensors(self._previous)
                tensors.update({f"{_PREVIOUS}{k}": t for k, t in previous.items()})
                data["divergence_previous"] = scalars
        return tensors, data

    def load_state_dict(
        self,
        tensors: Mapping[str, Tensor],
        meta: Mapping[str, Any],
        template: Any = None,
        *,
        rows: Sequence[Mapping[str, Any]] | None = None,
        ledger: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """Restore :meth:`state_dict` output (from a run of the same config).

        Everything is checked against this run before anything changes, so a state that does
        not fit raises and leaves the engine as it was (``ValueError``, or
        :class:`~radbo.checkpoint.CheckpointError` from the state before the last good one):
        the coverage blocks and tensor names this run tracks, each never-trained mask a bool
        tensor of its model tensor's shape (present once a round had clients) whose count of
        never-trained entries is the one the coverage history ends with, and the history's
        sizes this run's; no tensor other than those and the divergence guard's state before
        the last good one, shaped like ``template`` (the run's initial state) when given; a
        FLOP meter state exactly when this run has a meter, a divergence guard state only when
        its guard is on (one written before the guard existed has none: the guard starts
        afresh), each of which loads. With ``rows`` and ``ledger`` (the round records and
        ledger rows the state comes with), every round's ``cost_*`` figures must be the sums
        (:func:`radbo.cost.totals`) of its ledger rows.
        """
        trackers: dict[str, CoverageTracker] = {}
        coverage = meta.get("coverage") or {}
        if not isinstance(coverage, Mapping):
            raise ValueError(f"the engine's coverage state is {type(coverage).__name__}")
        known: set[str] = set()
        for block, data in coverage.items():
            if block not in self.coverage:
                raise ValueError(
                    f"coverage of block {block!r} is tracked, which this run does not track"
                )
            names = list(self.coverage[block])
            prefix = f"coverage/{block}/"
            masks = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
            expected = names if data.get("history") else []  # masks exist after a round
            if sorted(masks) != sorted(expected):
                raise ValueError(
                    f"the never-trained masks of block {block!r} are of {sorted(masks)}, this "
                    f"run tracks {sorted(names)}"
                )
            for name, t in masks.items():
                shape = tuple(self.shapes[name])
                if t.dtype != torch.bool or tuple(t.shape) != shape:
                    raise ValueError(
                        f"tensor '{prefix}{name}' is {t.dtype} {tuple(t.shape)}, this run's "
                        f"mask of {name!r} is torch.bool {shape}"
                    )
            history = data.get("history") or []
            numel = sum(math.prod(self.shapes[n]) for n in names)
            if any(entry["numel"] != numel for entry in history):
                raise ValueError(
                    f"the coverage history of block {block!r} counts other than this run's "
                    f"{numel} entries"
                )
            if history:
                never = sum(int((~masks[n]).sum()) for n in names)
                if history[-1]["never_trained_fraction"] != (never / numel if numel else 0.0):
                    raise ValueError(
                        f"the never-trained masks of block {block!r} hold {never} of {numel} "
                        "entries never trained, not the fraction its coverage history ends with"
                    )
            tracker = CoverageTracker(names)
            tracker.load_state_dict(masks, data)
            trackers[block] = tracker
            known.update(f"{prefix}{n}" for n in masks)
        if trackers and set(trackers) != set(self.coverage):
            missing = sorted(set(self.coverage) - set(trackers))
            raise ValueError(f"the coverage of block(s) {missing} is not in the engine state")
        meter_saved = meta.get("flop_meter")
        if (self.flop_meter is None) != (meter_saved is None):
            held = "no" if meter_saved is None else "a"
            raise ValueError(
                f"the engine state has {held} FLOP meter state; this run's FLOP meter is "
                + ("off" if self.flop_meter is None else "on")
            )
        if self.flop_meter is not None and meter_saved is not None:
            copy.copy(self.flop_meter).load_state_dict(meter_saved)  # raises before it counts
        undamped = self.algorithm if self._undamped is None else self._undamped
        guard = DivergenceGuard.of(undamped)
        algorithm = undamped
        if guard is None and meta.get("divergence") is not None:
            raise ValueError("the engine state has a divergence guard state; this run's is off")
        if guard is not None and meta.get("divergence") is not None:
            # (a state written before the guard existed has none: it starts afresh, as then)
            guard.load_state_dict(meta["divergence"])
            if guard.rollbacks:
                damped = getattr(undamped, "damped", None)
                if damped is None:
                    raise ValueError(
                        f"the divergence guard rolled back {guard.rollbacks} times, but "
                        f"{type(undamped).__name__} has no step sizes to damp"
                    )
                algorithm = damped(guard.lr_scale)
        previous_saved = None
        if guard is not None and meta.get("divergence_previous") is not None:
            previous = {
                k[len(_PREVIOUS) :]: t for k, t in tensors.items() if k.startswith(_PREVIOUS)
            }
            scalars = meta["divergence_previous"]
            if not isinstance(scalars, Mapping):
                raise ValueError("the divergence guard's previous state has no scalars")
            if template is not None:  # the state it must fit (iterate rebuilds it from this)
                state_from_tensors(template, previous, scalars)
            previous_saved = (previous, dict(scalars))
            known.update(f"{_PREVIOUS}{k}" for k in previous)
        unknown = sorted(set(tensors) - known)
        if unknown:
            raise ValueError(f"the engine state holds tensors this run does not: {unknown[:5]}")
        if rows is not None and ledger is not None:  # a round's costs are its ledger rows'
            charged: dict[Any, list[LedgerEntry]] = {}
            for entry in ledger:
                charged.setdefault(entry["round"], []).append(LedgerEntry(**entry))
            for row in rows:
                spent = totals(charged.get(row["round"], []))
                # (rows written before a total existed lack its key)
                recorded = {k[5:]: v for k, v in row.items() if k.startswith("cost_")}
                differ = sorted(
                    f"cost_{k}"
                    for k, v in recorded.items()
                    if spent.get(k) != v or type(spent.get(k)) is not type(v)
                )
                if differ:
                    raise ValueError(
                        f"round {row['round']}'s {', '.join(differ[:3])} are not the sums of "
                        "its ledger rows"
                    )
        # everything fits: restore it
        self._trackers.clear()
        self._trackers.update(trackers)
        if self.flop_meter is not None and meter_saved is not None:
            self.flop_meter.load_state_dict(meter_saved)
        self._guard = guard
        if algorithm is not undamped:
            self._undamped = undamped
        self.algorithm = algorithm
        self._previous = None
        self._previous_saved = previous_saved

    def _divergence_guard(self) -> DivergenceGuard | None:
        """The divergence guard of this run (``None`` when off), made from the algorithm's
        ``divergence*`` settings the first time it is needed."""
        if self._guard is None:
            self._guard = DivergenceGuard.of(self.algorithm)
        return self._guard

    def _damp(self, guard: DivergenceGuard) -> None:
        """Run the configured algorithm with its step sizes x ``guard.lr_scale``."""
        if guard.rollbacks == 0:
            return
        if self._undamped is None:
            self._undamped = self.algorithm
        damped = getattr(self._undamped, "damped", None)
        if damped is None:
            raise DivergenceError(
                f"divergence: {type(self._undamped).__name__} has no step sizes to damp; "
                'set [algorithm] divergence = "stop" or "off"'
            )
        self.algorithm = damped(guard.lr_scale)

    def _generator(self, *words: int) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, *words))

    def available_clients(self, round: int, clock_s: float = 0.0) -> list[int]:
        """Clients available in ``round``, which starts at ``clock_s`` on the virtual clock:
        one Bernoulli(availability) draw per client (client c is available when the c-th of
        ``n`` float64 uniforms is below its availability), compared for all clients at once,
        and of those only the clients whose availability windows (a profile's ``windows``,
        :class:`~radbo.devices.fleet.WindowSchedule`) cover ``clock_s``. The draws are the
        same with and without windows."""
        n = len(self.clients)
        if self.profiles is None:
            return list(range(n))
        draws = torch.rand(
            n, generator=self._generator(round, Stream.AVAILABILITY), dtype=torch.float64
        )
        available = draws < self._availabilities()
        schedule = self._window_schedule()
        if schedule is not None:
            available &= schedule.open(clock_s)
        return torch.nonzero(available).flatten().tolist()

    def _window_schedule(self) -> WindowSchedule | None:
        """The clients' availability windows (``None``: no profile has any), gathered once per
        ``profiles`` sequence."""
        assert self.profiles is not None
        cached = self._windows
        if cached is None or cached[0] is not self.profiles:
            cached = self._windows = (self.profiles, WindowSchedule.of(self.profiles))
        return cached[1]

    def next_window_opening(self, clock_s: float) -> float:
        """The earliest virtual time ``>= clock_s`` at which some client's availability window
        is open: ``clock_s`` itself without profiles or windows, or when one is open."""
        if self.profiles is None:
            return clock_s
        schedule = self._window_schedule()
        return clock_s if schedule is None else schedule.next_opening(clock_s)

    def _availabilities(self) -> Tensor:
        """Every client's availability (float64), gathered once per ``profiles`` sequence."""
        assert self.profiles is not None
        cached = self._availability
        if cached is None or cached[0] is not self.profiles:
            values = [float(p.availability) for p in self.profiles]
            cached = self._availability = (self.profiles, torch.tensor(values, dtype=torch.float64))
        return cached[1]

    def _unavailable(self, available: Sequence[int]) -> list[int]:
        """The clients not in ``available``, sorted."""
        n = len(self.clients)
        if len(available) == n:
            return []
        missing = torch.ones(n, dtype=torch.bool)
        missing[torch.tensor(list(available), dtype=torch.int64)] = False
        return torch.nonzero(missing).flatten().tolist()

    def dropouts(self, round: int, sampled: Sequence[int], num_phases: int) -> dict[int, int]:
        """Which sampled clients drop out of ``round``, and in which phase: ``{client: phase}``.

        Client c drops with probability ``dropout[c]`` (one draw per client and round), in a
        phase drawn uniformly from the round's phases. It receives that phase's broadcast and
        computes, but its upload never arrives: the server aggregates without it, it takes no
        part in the round's later phases, and the ledger charges its download and compute
        (``bytes_up = 0``).
        """
        if self.dropout is None or num_phases == 0:
            return {}
        gen = self._generator(round, Stream.DROPOUT)
        n = len(self.clients)
        drop = torch.rand(n, generator=gen, dtype=torch.float64)
        when = torch.rand(n, generator=gen, dtype=torch.float64)
        return {
            c: min(int(float(when[c]) * num_phases), num_phases - 1)
            for c in sampled
            if float(drop[c]) < self.dropout[c]
        }

    def needed_clients(self, num_available: int) -> int:
        """K: the results a round needs, ``clients_per_round`` or all available clients."""
        k = self.clients_per_round
        return num_available if k is None else min(k, num_available)

    def sample_clients(
        self, round: int, available: Sequence[int] | None = None, clock_s: float = 0.0
    ) -> list[int]:
        """Clients taking part in ``round`` (sorted): the available ones (drawn here for a round
        starting at ``clock_s`` unless given), then drawn without replacement down to
        ``ceil(K (1 + overcommit))``."""
        if available is None:
            available = self.available_clients(round, clock_s)
        available = list(available)
        k = math.ceil(self.needed_clients(len(available)) * (1.0 + self.overcommit))
        if k >= len(available):
            return available
        pick = torch.randperm(len(available), generator=self._generator(round, Stream.SAMPLE))[:k]
        return sorted(available[i] for i in pick.tolist())

    def _entry(self, round: int, phase: str, result: ClientResult, extra_down: int) -> LedgerEntry:
        c = result.cost
        profile = None if self.profiles is None else self.profiles[result.client]
        bytes_down = c.bytes_down + extra_down
        compute_s, comm_s = phase_times(c.flops, bytes_down, c.bytes_up, profile)
        compute_j, radio_j = phase_energy(c.flops, bytes_down, c.bytes_up, profile)
        tier = "" if profile is None else (profile.tier or profile.name)
        return LedgerEntry(
            round=round,
            phase=phase,
            client=result.client,
            tier=tier,
            flops=c.flops,
            n_grad=c.n_grad,
            n_hvp=c.n_hvp,
            samples=c.samples,
            bytes_down=bytes_down,
            bytes_up=c.bytes_up,
            compute_s=compute_s,
            comm_s=comm_s,
            energy_compute_j=compute_j,
            energy_radio_j=radio_j,
        )

    def _coverage(self, index_sets: Sequence[IndexSet], weights: Sequence[float]) -> dict[str, Any]:
        """Per-block coverage of this round's index sets (RABO Definition 3); clients of
        weight 0 hold nothing (:func:`radbo.masks.index.coverage_counts`)."""
        out: dict[str, Any] = {}
        for block, names in self.coverage.items():
            counts = coverage_counts(index_sets, {n: self.shapes[n] for n in names}, weights)
            tracker = self._trackers.setdefault(block, CoverageTracker(names))
            cov = tracker.update(counts)
            out[f"coverage_{block}_min"] = float(cov.min_coverage)
            out[f"untrained_fraction_{block}"] = cov.untrained_fraction
            out[f"never_trained_fraction_{block}"] = cov.never_trained_fraction
            out[f"coverage_{block}_histogram"] = cov.histogram
        return out

    def step(self, state: State, round: int, clock_s: float = 0.0) -> tuple[State, RoundRecord]:
        """Run one round from ``state``; returns the new state and the round's record.

        A round where no client is available leaves the state unchanged (and is recorded);
        when that is because no client's availability window covers ``clock_s``, the round
        lasts until the next window opens (:meth:`next_window_opening`), so the clock moves on.
        Clients drawn by :meth:`dropouts` leave the round in their phase (``record.dropped``),
        and so do clients whose result the backend marks ``lost``. In each phase, a client
        update that the backend marks ``rejected`` or that fails :func:`update_problem`
        (NaN/Inf, wrong shape, unknown tensor) is left out of the server's aggregation -- as
        if the client had not taken part in that phase -- and listed in ``record.rejected``;
        its cost stays in the ledger. A backend's reasons go to ``record.failures``. If every
        update of a phase is left out, the server function still runs, with no results. After
        the phases, x is projected onto the task's box when the task has one
        (:class:`~radbo.simulation.divergence.BoxedProblem`, e.g. ``feature_l2``).
        """
        start = time.perf_counter()
        available = self.available_clients(round, clock_s)
        sampled = self.sample_clients(round, available)
        unavailable = self._unavailable(available)
        phases = self.algorithm.phases()
        if not sampled:
            # every availability window closed: the server waits for the next one to open
            opening = self.next_window_opening(clock_s)
            record = RoundRecord(
                round=round,
                clients=[],
                metrics={},
                ledger=[],
                communication_rounds=0,
                wall_time_s=time.perf_counter() - start,
                round_time_s=opening - clock_s,
                clock_s=opening,
                unavailable=unavailable,
            )
            return state, record
        budgets = self.round_budgets(round, sampled)
        index_sets = self.round_index_sets(state, round, sampled, budgets)
        metadata = [index_metadata_bytes(idx) for idx in index_sets]
        weights = [1.0 if self.weights is None else float(self.weights[c]) for c in sampled]
        metrics: dict[str, Any] = self._coverage(index_sets, weights)
        ledger: list[LedgerEntry] = []
        rejected: dict[str, list[int]] = {}
        dropped: dict[str, list[int]] = {}
        briefed: set[int] = set()  # clients that already received their index metadata
        late: dict[str, list[int]] = {}
        failures: dict[str, dict[int, str]] = {}
        durations: list[float] = []
        needed = self.needed_clients(len(available))
        drops = self.dropouts(round, sampled, len(phases))
        position = {c: i for i, c in enumerate(sampled)}
        still_in = list(sampled)  # clients that have not dropped out of the round
        communication_rounds = 0
        client_data: dict[int, ClientData] = {}  # each participant's data, read once per round
        for p, phase in enumerate(phases):
            chosen = self._participants(phase, p, state, still_in, round)
            if not chosen:
                continue
            communication_rounds += 1
            at = [position[c] for c in chosen]
            tasks = [
                ClientTask(
                    client=sampled[i],
                    round=round,
                    phase=phase.name,
                    params=phase.broadcast(state, index_sets[i], slot),
                    index_set=index_sets[i],
                    data=_read_once(client_data, self.clients, sampled[i]),
                    seed=task_seed(self.seed, round, p, sampled[i]),
                    budget=budgets[i],
                    slot=slot,
                )
                for slot, i in enumerate(at)
            ]
            results = [
                replace(r, slot=slot)
                for slot, r in enumerate(
                    self.backend.run(phase.client, self.runtime, self.flop_meter, tasks)
                )
            ]
            # a client drawn to drop out in this phase, or whose reply the backend lost
            lost = [drops.get(r.client) == p or r.lost is not None for r in results]
            # the work was done and the bytes were sent, sound or not: all of it is charged;
            # a client that drops out computed but its upload never arrived. Index metadata
            # travels with a client's first phase of the round.
            ledger += [
                self._entry(
                    round,
                    phase.name,
                    replace(r, cost=replace(r.cost, bytes_up=0)) if gone else r,
                    0 if r.client in briefed else metadata[i],
                )
                for i, r, gone in zip(at, results, lost, strict=True)
            ]
            briefed.update(r.client for r in results)
            target = len(chosen) if phase.select is not None else min(needed, len(chosen))
            slow, duration = self._arrivals(ledger[-len(results) :], lost, target)
            durations.append(duration)
            keep, gone_clients, bad_clients = self._screen(
                results, [index_sets[i] for i in at], lost, slow
            )
            if gone_clients:
                dropped[phase.name] = gone_clients
            if bad_clients:
                rejected[phase.name] = bad_clients
            reasons = {r.client: r.lost or r.rejected for r in results if r.lost or r.rejected}
            if reasons:
                failures[phase.name] = {c: str(why) for c, why in reasons.items()}
            late_clients = [r.client for r, s_ in zip(results, slow, strict=True) if s_]
            if late_clients:
                late[phase.name] = late_clients
            state, phase_metrics = phase.server(
                state,
                [results[j] for j in keep],
                [index_sets[at[j]] for j in keep],
                [weights[at[j]] for j in keep],
            )
            metrics.update(phase_metrics)
            still_in = [c for c in still_in if c not in gone_clients and c not in late_clients]
        state = self._within_box(state)
        metrics["rejected_updates"] = sum(len(c) for c in rejected.values())
        metrics["dropped_clients"] = sum(len(c) for c in dropped.values())
        metrics["late_clients"] = sum(len(c) for c in late.values())
        duration = sum(durations)
        record = RoundRecord(
            round=round,
            clients=sampled,
            metrics=metrics,
            ledger=ledger,
            communication_rounds=communication_rounds,
            wall_time_s=time.perf_counter() - start,
            round_time_s=duration,
            clock_s=clock_s + duration,
            unavailable=unavailable,
            rejected=rejected,
            dropped=dropped,
            late=late,
            failures=failures,
        )
        return state, record

    def _within_box(self, state: State) -> State:
        """``state`` with x projected onto the task's box for the algorithm's current (maybe
        damped) ``inner_lr``; unchanged when the task has no box."""
        problem = self.runtime.problem
        if not isinstance(problem, BoxedProblem):
            return state
        bounds = problem.outer_bounds(getattr(self.algorithm, "inner_lr", None))
        return project_outer(state, bounds)

    def round_budgets(self, round: int, clients: Sequence[int]) -> list[ClientBudget]:
        """The budgets of ``clients`` in ``round``: their own, with the local-steps schedule
        (if any) drawn from the simulation's generators, as :meth:`step` uses them."""
        budgets = [self.budgets[c] for c in clients]
        schedule = self.local_steps
        if schedule is None:
            return budgets
        return [
            replace(b, local_steps=draw_local_steps(schedule, self.seed, round, c))
            for c, b in zip(clients, budgets, strict=True)
        ]

    def round_index_sets(
        self,
        state: State,
        round: int,
        clients: Sequence[int],
        budgets: Sequence[ClientBudget],
    ) -> list[IndexSet]:
        """The index sets of ``clients`` in ``round`` from ``state``, as :meth:`step` assigns
        them: the mask assigner is prepared with exactly these clients (full models without
        masks). ``radbo export`` calls it for round 0."""
        if self.masks is None:
            return [full_index_set(self.shapes) for _ in clients]
        self.masks.prepare(self.algorithm.model_state(state), round, list(clients), list(budgets))
        return [
            self.masks.assign(b, c, round, self._generator(round, Stream.MASK, c))
            for c, b in zip(clients, budgets, strict=True)
        ]

    def _participants(
        self, phase: Phase[State], p: int, state: State, still_in: list[int], round: int
    ) -> list[int]:
        """The clients of phase ``p``, in slot order: every remaining client, or
        ``phase.select``'s choice among them (checked)."""
        if phase.select is None:
            return list(still_in)
        gen = self._generator(round, Stream.SELECT, p)
        chosen = [int(c) for c in phase.select(state, list(still_in), gen)]
        if set(chosen) - set(still_in) or len(set(chosen)) != len(chosen):
            raise ValueError(
                f"phase {phase.name!r} selected clients {chosen}; each must be one of the "
                f"round's remaining clients {still_in}, at most once"
            )
        return chosen

    def _arrivals(
        self, entries: Sequence[LedgerEntry], lost: list[bool], target: int
    ) -> tuple[list[bool], float]:
        """Which results of a phase arrive too late, and how long the phase lasts.

        The server takes the first ``target`` results to arrive (ties by client id) and none
        after ``phase_deadline_s``; dropped-out clients never arrive. Without late results
        the phase lasts as long as its slowest client (dropped ones included: the server only
        learns of a drop when it times out), otherwise until the last accepted arrival, or
        the deadline when the deadline cut it short.
        """
        times = [e.time_s for e in entries]
        deadline = self.phase_deadline_s
        order = sorted(
            (i for i in range(len(entries)) if not lost[i]),
            key=lambda i: (times[i], entries[i].client),
        )
        accepted = [i for i in order if deadline is None or times[i] <= deadline][:target]
        slow = [not lost[i] and i not in accepted for i in range(len(entries))]
        if not any(slow):
            return slow, max(times, default=0.0)
        if len(accepted) == target:  # the K-th result arrived: the server stops waiting
            return slow, max(times[i] for i in accepted)
        assert deadline is not None  # without one, only surplus results can be late
        return slow, float(deadline)

    def _screen(
        self,
        results: Sequence[ClientResult],
        index_sets: Sequence[IndexSet],
        lost: list[bool],
        slow: list[bool],
    ) -> tuple[list[int], list[int], list[int]]:
        """Split a phase's results into (positions to aggregate, clients that dropped out,
        clients whose update the backend rejected or that fails :func:`update_problem`); late
        results are left out."""
        keep, gone, bad = [], [], []
        for j, (r, idx, dropped) in enumerate(zip(results, index_sets, lost, strict=True)):
            if dropped:
                gone.append(r.client)
            elif slow[j]:
                continue
            elif r.rejected is not None or update_problem(r.update, idx, self.shapes) is not None:
                bad.append(r.client)
            else:
                keep.append(j)
        return keep, gone, bad

    def iterate(
        self, state: State, rounds: int, start_round: int = 0, clock_s: float = 0.0
    ) -> Iterator[tuple[State, RoundRecord]]:
        """Yield ``(state, record)`` after each round; evaluates every ``eval_every`` rounds
        and after the last one. ``clock_s`` is the virtual clock at the start; a starting
        ``state`` outside the task's box (:meth:`step`) is projected onto it first.

        Each round passes the divergence guard of the algorithm's ``[algorithm] divergence``
        settings (:mod:`radbo.simulation.divergence`): on ``"rollback"`` a diverged round
        yields the last good state instead (evaluated again when the round is evaluated; the
        diverged evaluation goes to ``record.divergence``) and the following rounds run with
        damped step sizes."""
        state = self._within_box(state)
        guard = self._divergence_guard()
        if guard is not None and guard.largest_norm is None:  # not resumed: the start is good
            guard.start(state_rms(state, self.algorithm.model_state(state)), start_round)
        if self._previous_saved is not None:  # resumed: shaped like the state it precedes
            self._previous = state_from_tensors(state, *self._previous_saved)
            self._previous_saved = None
        elif state is not self._current:  # not where this simulation stopped: unknown
            self._previous = None
        for q in range(start_round, start_round + rounds):
            new, record = self.step(state, q, clock_s)
            clock_s = record.clock_s
            last = q == start_round + rounds - 1
            if self.evaluate is not None and ((q + 1) % self.eval_every == 0 or last):
                record.evaluation = self.evaluate(self.algorithm.model_state(new))
            if guard is not None:
                new, self._previous = self._guard_round(guard, self._previous, state, new, record)
            state = self._current = new
            yield state, record

    def _guard_round(
        self,
        guard: DivergenceGuard,
        previous: State | None,
        before: State,
        after: State,
        record: RoundRecord,
    ) -> tuple[State, State | None]:
        """The state a round leaves under the divergence guard, and the good state before
        it (``None`` when not known): ``after`` when the round is sound (or the policy only
        warns); else the last good state ``before``, or, when a training loss tripped the
        guard, the one before it (``previous``): a round's training losses are measured at
        the state it starts from, so they show ``before`` bad."""
        losses = round_losses(record.metrics, record.evaluation)
        norm = state_rms(after, self.algorithm.model_state(after))
        q = record.round
        reason = guard.check(losses, norm)
        if reason is None:
            guard.accept(losses, norm, q + 1)
            return after, before
        if guard.policy == "stop":
            raise DivergenceError(
                f"divergence in round {q}: {reason}; stopped ([algorithm] divergence = "
                f'"stop"; "rollback" rolls back and damps the step sizes)'
            )
        if guard.policy == "warn":
            record.divergence = {"round": q, "reason": reason, "action": "warn"}
            if not guard.diverging:
                warnings.warn(
                    f"divergence in round {q}: {reason}; continuing ([algorithm] divergence "
                    '= "warn")',
                    RuntimeWarning,
                    stacklevel=3,
                )
            guard.diverging = True
            return after, before
        if guard.rollbacks >= MAX_ROLLBACKS:
            raise DivergenceError(
                f"divergence in round {q}: {reason}; still diverging after {MAX_ROLLBACKS} "
                f"rollbacks (step sizes x {guard.lr_scale:.3g}); lower the step sizes"
            )
        guard.rollbacks += 1
        guard.diverging = True
        self._damp(guard)
        target, earlier = before, previous
        if guard.tripped_training_loss and previous is not None and guard.good_rounds > 0:
            target, earlier = previous, None
            guard.good_rounds -= 1
        record.divergence = {
            "round": q,
            "reason": reason,
            "action": "rollback",
            "rolled_back_to": guard.good_rounds,
            "lr_scale": guard.lr_scale,
        }
        if record.evaluation is not None and self.evaluate is not None:
            record.divergence["evaluation"] = record.evaluation
            record.evaluation = self.evaluate(self.algorithm.model_state(target))
        return target, earlier
