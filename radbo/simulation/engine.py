"""The simulation engine: the one loop over clients in radbo.

An algorithm is a list of :class:`Phase` objects (pure functions plus a name). For each round
the engine asks its participation policy (:class:`~radbo.simulation.participation.
Participation`) who takes part, asks the mask assigner for each client's submodel, and for
every phase (1) builds one :class:`ClientTask` per participant from the server state, (2)
hands the tasks to a :class:`Backend` that runs the client function on each (sequentially
here; batched and Flower backends plug in through the same interface), (3) prices the results
into the ledger and screens them (:mod:`radbo.simulation.screening`: lost, late, unsound) and
(4) lets the phase's server function fold the rest into the new state. A client function sees
only its task (the tensors it receives, its data indices, its generator seed and its budget)
and the read-only :class:`ClientRuntime`; it keeps no hidden state, so any backend can run it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from radbo.aggregation import aggregation_threads
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
from radbo.cost import DeviceLike, FlopMeter, LedgerEntry, index_metadata_bytes
from radbo.problem import ClientData
from radbo.randomness import Stream, derive_seeds, task_seeds
from radbo.simulation.backends import BACKENDS, ParallelBackend, StatefulBackend
from radbo.simulation.collection import paused_collection
from radbo.simulation.coverage import CoverageBlocks
from radbo.simulation.divergence import BoxedProblem, project_outer
from radbo.simulation.ledger import check_round_costs, ledger_entry
from radbo.simulation.participation import Participation, Turnout
from radbo.simulation.record import RoundObserver, RoundRecord
from radbo.simulation.rollback import DivergenceWatch
from radbo.simulation.schedules import draw_local_steps
from radbo.simulation.screening import Screened, screen, update_problem
from radbo.typing import IndexSet, Params

__all__ = [
    "RoundObserver",
    "RoundRecord",
    "SequentialBackend",
    "Simulation",
    "full_index_set",
    "update_problem",
]

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


def full_index_set(shapes: Mapping[str, torch.Size]) -> IndexSet:
    """Index set keeping every coordinate of every tensor."""
    return {n: (None,) * len(s) for n, s in shapes.items()}


@dataclass
class RoundPlan:
    """What a round's sampled clients work with, in sampled order.

    Attributes:
        clients: the sampled clients (sorted).
        budgets: their budgets this round (:meth:`Simulation.round_budgets`).
        index_sets: their submodels (:meth:`Simulation.round_index_sets`).
        weights: their aggregation weights.
        metadata: the bytes of their index metadata, sent with a client's first phase.
    """

    clients: list[int]
    budgets: list[ClientBudget]
    index_sets: list[IndexSet]
    weights: list[float]
    metadata: list[int]
    # each client's position in `clients`, and its data, read once per round
    position: dict[int, int] = field(init=False, repr=False)
    data: dict[int, ClientData] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.position = {c: i for i, c in enumerate(self.clients)}

    def data_of(self, clients: Sequence[ClientData], client: int) -> ClientData:
        """``clients[client]``, read once per round (a round's phases share it)."""
        found = self.data.get(client)
        if found is None:
            found = self.data[client] = clients[client]
        return found


@dataclass
class RoundTally:
    """A round's record in the making: the metrics, ledger and per-phase outcomes so far."""

    metrics: dict[str, Any]
    ledger: list[LedgerEntry] = field(default_factory=list)
    rejected: dict[str, list[int]] = field(default_factory=dict)
    dropped: dict[str, list[int]] = field(default_factory=dict)
    late: dict[str, list[int]] = field(default_factory=dict)
    failures: dict[str, dict[int, str]] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)
    communication_rounds: int = 0
    briefed: set[int] = field(default_factory=set)  # clients sent their index metadata

    def add_phase(
        self, phase: str, results: Sequence[ClientResult], screened: Screened, duration: float
    ) -> None:
        """Note a phase: its duration, who dropped out, was rejected or late, and the
        reasons a backend gave for the results it marked lost or rejected."""
        self.communication_rounds += 1
        self.durations.append(duration)
        if screened.dropped:
            self.dropped[phase] = screened.dropped
        if screened.rejected:
            self.rejected[phase] = screened.rejected
        reasons = {r.client: r.lost or r.rejected for r in results if r.lost or r.rejected}
        if reasons:
            self.failures[phase] = {c: str(why) for c, why in reasons.items()}
        if screened.late:
            self.late[phase] = screened.late

    def record(self, round: int, turnout: Turnout, clock_s: float, start: float) -> RoundRecord:
        """The round's record, for a round that started at ``clock_s`` (virtual) and at
        ``start`` (:func:`time.perf_counter`)."""
        self.metrics["rejected_updates"] = sum(len(c) for c in self.rejected.values())
        self.metrics["dropped_clients"] = sum(len(c) for c in self.dropped.values())
        self.metrics["late_clients"] = sum(len(c) for c in self.late.values())
        duration = sum(self.durations)
        return RoundRecord(
            round=round,
            clients=turnout.sampled,
            metrics=self.metrics,
            ledger=self.ledger,
            communication_rounds=self.communication_rounds,
            wall_time_s=time.perf_counter() - start,
            round_time_s=duration,
            clock_s=clock_s + duration,
            unavailable=turnout.unavailable,
            rejected=self.rejected,
            dropped=self.dropped,
            late=self.late,
            failures=self.failures,
        )


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
        backend: runs the client functions (default: sequential; a config's runs take
            ``[runtime] backend``, ``"auto"`` by default).
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
        pause_gc: run each :meth:`step` with Python's cyclic garbage collector paused
            (:func:`~radbo.simulation.collection.paused_collection`; default ``True``): at
            1,000 clients per round its full collections took about a tenth of a round. The
            results are the same either way.

    Who takes part in a round -- ``profiles``' availability, ``clients_per_round``,
    ``overcommit``, ``dropout``, ``phase_deadline_s`` -- is decided by :attr:`participation`;
    the coverage report, the divergence guard (:class:`~radbo.simulation.rollback.
    DivergenceWatch`) and the ledger's pricing (:func:`~radbo.simulation.ledger.ledger_entry`)
    are parts of their own; :meth:`step` runs the phases.
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
    pause_gc: bool = True
    _coverage_blocks: CoverageBlocks = field(init=False, repr=False)
    # the participation policy and the settings it was made from (see `participation`)
    _participation: tuple[tuple[Any, ...], Participation] | None = field(
        default=None, init=False, repr=False
    )
    # the divergence guard, made from the algorithm's settings on the first iterate or save
    _watch: DivergenceWatch | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.clients)
        if n == 0:
            raise ValueError("a simulation needs at least one client")
        if len(self.budgets) != n:
            raise ValueError(f"got {n} clients but {len(self.budgets)} budgets")
        if self.weights is not None and len(self.weights) != n:
            raise ValueError(f"got {n} clients but {len(self.weights)} weights")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        self.participation  # noqa: B018 (checks the participation settings)
        self._coverage_blocks = CoverageBlocks(self.coverage, self.shapes)

    @property
    def participation(self) -> Participation:
        """Who takes part in a round: the :class:`~radbo.simulation.participation.
        Participation` of ``seed``, ``profiles``, ``clients_per_round``, ``dropout``,
        ``overcommit`` and ``phase_deadline_s``. Made again (and checked) when one of them is
        replaced -- tools and tests set them between rounds -- and kept otherwise, with its
        caches of the profiles."""
        settings = (
            self.seed,
            self.profiles,
            self.clients_per_round,
            self.dropout,
            self.overcommit,
            self.phase_deadline_s,
        )
        made = self._participation
        if made is None or any(a is not b for a, b in zip(made[0], settings, strict=True)):
            seed, profiles, k, dropout, overcommit, deadline = settings
            policy = Participation(
                len(self.clients), seed, profiles, k, dropout, overcommit, deadline
            )
            made = self._participation = (settings, policy)
        return made[1]

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The engine's cross-round state, ``(tensors, JSON data)``, for checkpoints.

        The coverage trackers (never-trained masks, history), the FLOP meter's cache and the
        divergence guard's running values (its rollbacks give the damped step sizes); all
        other randomness and schedules derive from ``(seed, round)``, so this and the
        algorithm state are all a resumed run needs to continue exactly.
        """
        tensors, coverage = self._coverage_blocks.state_dict()
        meter = None if self.flop_meter is None else self.flop_meter.state_dict()
        data: dict[str, Any] = {"coverage": coverage, "flop_meter": meter}
        if isinstance(self.backend, StatefulBackend):  # its own choices (auto's plan)
            data["backend"] = self.backend.state_dict()
        watch = self._divergence_watch()
        if watch is not None:
            guarded, guard_data = watch.state_dict()
            tensors.update(guarded)
            data.update(guard_data)
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
        the coverage trackers (:meth:`CoverageBlocks.restored
        <radbo.simulation.coverage.CoverageBlocks.restored>`); no tensor other than theirs
        and the divergence guard's state before the last good one, shaped like ``template``
        (the run's initial state) when given; a FLOP meter state exactly when this run has a
        meter, a divergence guard state only when its guard is on (one written before the
        guard existed has none: the guard starts afresh), each of which loads
        (:meth:`DivergenceWatch.restored <radbo.simulation.rollback.DivergenceWatch.
        restored>`). With ``rows`` and ``ledger`` (the round records and ledger rows the state
        comes with), every round's ``cost_*`` figures must be the sums
        (:func:`radbo.cost.totals`) of its ledger rows.
        """
        coverage, known = self._coverage_blocks.restored(tensors, meta.get("coverage"))
        meter_saved = self._checked_meter_state(meta.get("flop_meter"))
        watch = self._watch
        undamped = self.algorithm if watch is None or watch.undamped is None else watch.undamped
        watch, algorithm, previous = DivergenceWatch.restored(undamped, tensors, meta, template)
        unknown = sorted(set(tensors) - known - previous)
        if unknown:
            raise ValueError(f"the engine state holds tensors this run does not: {unknown[:5]}")
        if rows is not None and ledger is not None:  # a round's costs are its ledger rows'
            check_round_costs(rows, ledger)
        saved_backend = meta.get("backend")
        stateful = self.backend if isinstance(self.backend, StatefulBackend) else None
        if stateful is not None and saved_backend is not None:  # a copy raises, changing nothing
            copy.deepcopy(stateful).load_state_dict(saved_backend)
        # everything fits: restore it
        self._coverage_blocks = coverage
        if self.flop_meter is not None and meter_saved is not None:
            self.flop_meter.load_state_dict(meter_saved)
        self._watch = watch
        self.algorithm = algorithm
        if stateful is not None and saved_backend is not None:
            stateful.load_state_dict(saved_backend)

    def _checked_meter_state(self, saved: Any) -> Any:
        """``saved``, the FLOP meter state of a checkpoint, once checked: present exactly when
        this run has a meter, and loadable into it (``ValueError`` otherwise)."""
        if (self.flop_meter is None) != (saved is None):
            held = "no" if saved is None else "a"
            raise ValueError(
                f"the engine state has {held} FLOP meter state; this run's FLOP meter is "
                + ("off" if self.flop_meter is None else "on")
            )
        if self.flop_meter is not None:
            copy.copy(self.flop_meter).load_state_dict(saved)  # raises before it counts
        return saved

    def _divergence_watch(self) -> DivergenceWatch | None:
        """The divergence guard of this run (``None`` when off), made from the algorithm's
        ``divergence*`` settings the first time it is needed."""
        if self._watch is None:
            self._watch = DivergenceWatch.of(self.algorithm)
        return self._watch

    def available_clients(self, round: int, clock_s: float = 0.0) -> list[int]:
        """Clients available in ``round``, which starts at ``clock_s`` on the virtual clock
        (:meth:`Participation.available <radbo.simulation.participation.Participation.
        available>`)."""
        return self.participation.available(round, clock_s)

    def next_window_opening(self, clock_s: float) -> float:
        """The earliest virtual time ``>= clock_s`` at which some client's availability window
        is open: ``clock_s`` itself without profiles or windows, or when one is open."""
        return self.participation.next_window_opening(clock_s)

    def dropouts(self, round: int, sampled: Sequence[int], num_phases: int) -> dict[int, int]:
        """Which sampled clients drop out of ``round``, and in which phase: ``{client: phase}``
        (:meth:`Participation.dropouts <radbo.simulation.participation.Participation.
        dropouts>`)."""
        return self.participation.dropouts(round, sampled, num_phases)

    def needed_clients(self, num_available: int) -> int:
        """K: the results a round needs, ``clients_per_round`` or all available clients."""
        return self.participation.needed(num_available)

    def sample_clients(
        self, round: int, available: Sequence[int] | None = None, clock_s: float = 0.0
    ) -> list[int]:
        """Clients taking part in ``round`` (sorted): the available ones (drawn here for a round
        starting at ``clock_s`` unless given), then drawn without replacement down to
        ``ceil(K (1 + overcommit))``."""
        return self.participation.sample(round, available, clock_s)

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
        seeds = derive_seeds((self.seed, round, Stream.MASK), clients)  # one derive_seed each
        return [
            self.masks.assign(b, c, round, torch.Generator().manual_seed(seed))
            for c, b, seed in zip(clients, budgets, seeds, strict=True)
        ]

    def _plan(self, state: State, round: int, sampled: list[int]) -> RoundPlan:
        """The budgets, submodels and weights of the clients ``sampled`` for ``round``."""
        budgets = self.round_budgets(round, sampled)
        index_sets = self.round_index_sets(state, round, sampled, budgets)
        return RoundPlan(
            clients=sampled,
            budgets=budgets,
            index_sets=index_sets,
            weights=[1.0 if self.weights is None else float(self.weights[c]) for c in sampled],
            metadata=[index_metadata_bytes(idx) for idx in index_sets],
        )

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
        with paused_collection(self.pause_gc):
            return self._step(state, round, clock_s)

    def _step(self, state: State, round: int, clock_s: float) -> tuple[State, RoundRecord]:
        """:meth:`step`, with the collector as :attr:`pause_gc` says."""
        start = time.perf_counter()
        phases = self.algorithm.phases()
        turnout = self.participation.turnout(round, clock_s, len(phases))
        if not turnout.sampled:
            return state, self._idle_round(round, clock_s, turnout, start)
        plan = self._plan(state, round, turnout.sampled)
        tally = RoundTally(metrics=self._coverage_blocks.update(plan.index_sets, plan.weights))
        still_in = list(turnout.sampled)  # clients that have not left the round
        for p, phase in enumerate(phases):
            chosen = self.participation.phase_members(phase, p, state, still_in, round)
            if chosen:
                state, left = self._phase(state, round, p, phase, chosen, plan, turnout, tally)
                still_in = [c for c in still_in if c not in left]
        state = self._within_box(state)
        return state, tally.record(round, turnout, clock_s, start)

    def _idle_round(
        self, round: int, clock_s: float, turnout: Turnout, start: float
    ) -> RoundRecord:
        """The record of a round no client takes part in: every availability window closed,
        the server waits for the next one to open."""
        opening = self.next_window_opening(clock_s)
        return RoundRecord(
            round=round,
            clients=[],
            metrics={},
            ledger=[],
            communication_rounds=0,
            wall_time_s=time.perf_counter() - start,
            round_time_s=opening - clock_s,
            clock_s=opening,
            unavailable=turnout.unavailable,
        )

    def _phase(
        self,
        state: State,
        round: int,
        p: int,
        phase: Phase[State],
        chosen: list[int],
        plan: RoundPlan,
        turnout: Turnout,
        tally: RoundTally,
    ) -> tuple[State, set[int]]:
        """Phase number ``p`` of ``round`` for the clients ``chosen``: broadcast, run on the
        backend, price into ``tally``'s ledger, screen, and the server's update. Returns the
        new state and the clients that left the round in this phase (dropped out or late)."""
        at = [plan.position[c] for c in chosen]
        if phase.broadcast_many is not None:  # every client's submodel at once
            sent = phase.broadcast_many(state, [plan.index_sets[i] for i in at], range(len(at)))
        else:
            sent = [phase.broadcast(state, plan.index_sets[i], slot) for slot, i in enumerate(at)]
        seeds = task_seeds(self.seed, round, p, [plan.clients[i] for i in at])
        tasks = [
            ClientTask(
                client=plan.clients[i],
                round=round,
                phase=phase.name,
                params=sent[slot],
                index_set=plan.index_sets[i],
                data=plan.data_of(self.clients, plan.clients[i]),
                seed=seeds[slot],
                budget=plan.budgets[i],
                slot=slot,
            )
            for slot, i in enumerate(at)
        ]
        ran = self.backend.run(phase.client, self.runtime, self.flop_meter, tasks)
        results = [replace(r, slot=slot) for slot, r in enumerate(ran)]
        # a client drawn to drop out in this phase, or whose reply the backend lost
        lost = [turnout.drops.get(r.client) == p or r.lost is not None for r in results]
        entries = self._price(
            round, phase.name, results, lost, [plan.metadata[i] for i in at], tally
        )
        target = len(chosen) if phase.select is not None else min(turnout.needed, len(chosen))
        slow, duration = self.participation.arrivals(entries, lost, target)
        index_sets = [plan.index_sets[i] for i in at]
        screened = screen(results, index_sets, lost, slow, self.shapes)
        tally.add_phase(phase.name, results, screened, duration)
        keep = screened.keep
        # the backend's idle CPUs aggregate too (the same bits on any number of threads)
        threads = self.backend.server_threads if isinstance(self.backend, ParallelBackend) else 1
        with aggregation_threads(threads):
            state, metrics = phase.server(
                state,
                [results[j] for j in keep],
                [index_sets[j] for j in keep],
                [plan.weights[at[j]] for j in keep],
            )
        tally.metrics.update(metrics)
        return state, {*screened.dropped, *screened.late}

    def _price(
        self,
        round: int,
        phase: str,
        results: Sequence[ClientResult],
        lost: Sequence[bool],
        metadata: Sequence[int],
        tally: RoundTally,
    ) -> list[LedgerEntry]:
        """The ledger entries of a phase's results, added to ``tally``'s ledger. The work was
        done and the bytes were sent, sound or not: all of it is charged; a client that drops
        out computed but its upload never arrived. Index metadata (``metadata``, per result)
        travels with a client's first phase of the round."""
        entries = [
            ledger_entry(
                round,
                phase,
                replace(r, cost=replace(r.cost, bytes_up=0)) if gone else r,
                0 if r.client in tally.briefed else extra,
                None if self.profiles is None else self.profiles[r.client],
            )
            for r, gone, extra in zip(results, lost, metadata, strict=True)
        ]
        tally.ledger += entries
        tally.briefed.update(r.client for r in results)
        return entries

    def _within_box(self, state: State) -> State:
        """``state`` with x projected onto the task's box for the algorithm's current (maybe
        damped) ``inner_lr``; unchanged when the task has no box."""
        problem = self.runtime.problem
        if not isinstance(problem, BoxedProblem):
            return state
        bounds = problem.outer_bounds(getattr(self.algorithm, "inner_lr", None))
        return project_outer(state, bounds)

    def iterate(
        self,
        state: State,
        rounds: int,
        start_round: int = 0,
        clock_s: float = 0.0,
        observers: Sequence[RoundObserver] = (),
    ) -> Iterator[tuple[State, RoundRecord]]:
        """Yield ``(state, record)`` after each round; evaluates every ``eval_every`` rounds
        and after the last one. ``clock_s`` is the virtual clock at the start; a starting
        ``state`` outside the task's box (:meth:`step`) is projected onto it first. Each of
        ``observers`` sees every round (:class:`~radbo.simulation.record.RoundObserver`), in
        order, before it is yielded.

        Each round passes the divergence guard of the algorithm's ``[algorithm] divergence``
        settings (:mod:`radbo.simulation.divergence`): on ``"rollback"`` a diverged round
        yields the last good state instead (evaluated again when the round is evaluated; the
        diverged evaluation goes to ``record.divergence``) and the following rounds run with
        damped step sizes."""
        state = self._within_box(state)
        watch = self._divergence_watch()
        if watch is not None:
            watch.begin(state, self.algorithm, start_round)
        for q in range(start_round, start_round + rounds):
            new, record = self.step(state, q, clock_s)
            clock_s = record.clock_s
            last = q == start_round + rounds - 1
            if self.evaluate is not None and ((q + 1) % self.eval_every == 0 or last):
                record.evaluation = self.evaluate(self.algorithm.model_state(new))
            if watch is not None:
                new, self.algorithm = watch.judge(self.algorithm, state, new, record, self.evaluate)
            state = new
            for observer in observers:
                observer.on_round(state, record)
            yield state, record
