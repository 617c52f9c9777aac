"""Who takes part in a round: availability, sampling, over-commitment, dropout and deadlines.

:class:`Participation` is the engine's participation policy. It answers, for a round that
starts at a time on the virtual clock, which clients are available (a Bernoulli draw per
client, and their availability windows), which of them are sampled (down to ``ceil(K (1 +
overcommit))``), which of those drop out and in which phase, which clients a phase
addresses, and, once a phase's results are priced on the clock, which of them arrive too late
(over-commitment's surplus, or past the phase deadline). Every draw derives from the run seed
and the round (:mod:`radbo.randomness`), so the answers are the same in any backend and after
a resume. It holds no state across rounds but two caches of the fleet's profiles.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from radbo.client import Phase
from radbo.cost import DeviceLike, LedgerEntry
from radbo.devices.fleet import WindowSchedule
from radbo.randomness import Stream, generator

__all__ = ["Participation", "Turnout"]


@dataclass(frozen=True)
class Turnout:
    """Who takes part in one round.

    Attributes:
        available: the clients available when the round starts (sorted).
        sampled: the clients sampled from them (sorted); empty when none is available.
        unavailable: the clients not available (sorted).
        needed: K, the results each phase aggregates at most (:meth:`Participation.needed`).
        drops: the sampled clients that drop out, and the phase they drop out in.
    """

    available: list[int]
    sampled: list[int]
    unavailable: list[int]
    needed: int
    drops: dict[int, int]


@dataclass
class Participation:
    """The participation policy of a fleet of ``num_clients`` clients (see the module).

    Attributes:
        num_clients: clients in the fleet.
        seed: run seed; every draw derives from it.
        profiles: one device profile per client: its availability and windows (``None``:
            every client is always available).
        clients_per_round: K, how many clients a round needs (``None``: all available).
        dropout: per-client probability of dropping out of a round it was sampled for
            (``None``: nobody drops out).
        overcommit: FedScale's over-commitment ``oc >= 0``: sample ``ceil(K (1 + oc))``
            clients and aggregate the first K results of each phase to arrive.
        phase_deadline_s: results arriving later than this many simulated seconds after a
            phase starts are discarded (``None``: no deadline).
    """

    num_clients: int
    seed: int = 0
    profiles: Sequence[DeviceLike] | None = None
    clients_per_round: int | None = None
    dropout: Sequence[float] | None = None
    overcommit: float = 0.0
    phase_deadline_s: float | None = None
    # every client's availability in one float64 tensor, and the clients' availability
    # windows (None when no profile has any), gathered from `profiles` on the first draw
    _availability: Tensor | None = field(default=None, init=False, repr=False)
    _windows: tuple[WindowSchedule | None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        n = self.num_clients
        if self.profiles is not None and len(self.profiles) != n:
            raise ValueError(f"got {n} clients but {len(self.profiles)} device profiles")
        k = self.clients_per_round
        if k is not None and not 1 <= k <= n:
            raise ValueError(f"clients_per_round must be in [1, {n}], got {k}")
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

    def turnout(self, round: int, clock_s: float, num_phases: int) -> Turnout:
        """Who takes part in ``round``, which starts at ``clock_s`` and has ``num_phases``
        phases."""
        available = self.available(round, clock_s)
        sampled = self.sample(round, available)
        return Turnout(
            available=available,
            sampled=sampled,
            unavailable=self.unavailable(available),
            needed=self.needed(len(available)),
            drops=self.dropouts(round, sampled, num_phases),
        )

    def available(self, round: int, clock_s: float = 0.0) -> list[int]:
        """Clients available in ``round``, which starts at ``clock_s`` on the virtual clock:
        one Bernoulli(availability) draw per client (client c is available when the c-th of
        ``n`` float64 uniforms is below its availability), compared for all clients at once,
        and of those only the clients whose availability windows (a profile's ``windows``,
        :class:`~radbo.devices.fleet.WindowSchedule`) cover ``clock_s``. The draws are the
        same with and without windows."""
        n = self.num_clients
        if self.profiles is None:
            return list(range(n))
        draws = torch.rand(
            n, generator=generator(self.seed, round, Stream.AVAILABILITY), dtype=torch.float64
        )
        available = draws < self.availabilities()
        schedule = self._window_schedule()
        if schedule is not None:
            available &= schedule.open(clock_s)
        return torch.nonzero(available).flatten().tolist()

    def availabilities(self) -> Tensor:
        """Every client's availability (float64), gathered once (requires ``profiles``)."""
        assert self.profiles is not None
        if self._availability is None:
            values = [float(p.availability) for p in self.profiles]
            self._availability = torch.tensor(values, dtype=torch.float64)
        return self._availability

    def _window_schedule(self) -> WindowSchedule | None:
        """The clients' availability windows (``None``: no profile has any), gathered once."""
        assert self.profiles is not None
        if self._windows is None:
            self._windows = (WindowSchedule.of(self.profiles),)
        return self._windows[0]

    def next_window_opening(self, clock_s: float) -> float:
        """The earliest virtual time ``>= clock_s`` at which some client's availability window
        is open: ``clock_s`` itself without profiles or windows, or when one is open."""
        if self.profiles is None:
            return clock_s
        schedule = self._window_schedule()
        return clock_s if schedule is None else schedule.next_opening(clock_s)

    def unavailable(self, available: Sequence[int]) -> list[int]:
        """The clients not in ``available``, sorted."""
        n = self.num_clients
        if len(available) == n:
            return []
        missing = torch.ones(n, dtype=torch.bool)
        missing[torch.tensor(list(available), dtype=torch.int64)] = False
        return torch.nonzero(missing).flatten().tolist()

    def needed(self, num_available: int) -> int:
        """K: the results a round needs, ``clients_per_round`` or all available clients."""
        k = self.clients_per_round
        return num_available if k is None else min(k, num_available)

    def sample(
        self, round: int, available: Sequence[int] | None = None, clock_s: float = 0.0
    ) -> list[int]:
        """Clients taking part in ``round`` (sorted): the available ones (drawn here for a round
        starting at ``clock_s`` unless given), then drawn without replacement down to
        ``ceil(K (1 + overcommit))``."""
        if available is None:
            available = self.available(round, clock_s)
        available = list(available)
        k = math.ceil(self.needed(len(available)) * (1.0 + self.overcommit))
        if k >= len(available):
            return available
        gen = generator(self.seed, round, Stream.SAMPLE)
        pick = torch.randperm(len(available), generator=gen)[:k]
        return sorted(available[i] for i in pick.tolist())

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
        gen = generator(self.seed, round, Stream.DROPOUT)
        n = self.num_clients
        drop = torch.rand(n, generator=gen, dtype=torch.float64)
        when = torch.rand(n, generator=gen, dtype=torch.float64)
        return {
            c: min(int(float(when[c]) * num_phases), num_phases - 1)
            for c in sampled
            if float(drop[c]) < self.dropout[c]
        }

    def phase_members(
        self, phase: Phase[Any], p: int, state: Any, still_in: Sequence[int], round: int
    ) -> list[int]:
        """The clients of phase number ``p`` of ``round``, in slot order: every client still in
        the round, or ``phase.select``'s choice among them (checked)."""
        if phase.select is None:
            return list(still_in)
        gen = generator(self.seed, round, Stream.SELECT, p)
        chosen = [int(c) for c in phase.select(state, list(still_in), gen)]
        if set(chosen) - set(still_in) or len(set(chosen)) != len(chosen):
            raise ValueError(
                f"phase {phase.name!r} selected clients {chosen}; each must be one of the "
                f"round's remaining clients {list(still_in)}, at most once"
            )
        return chosen

    def arrivals(
        self, entries: Sequence[LedgerEntry], lost: Sequence[bool], target: int
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
        taken = set(accepted)  # a set: a round of 1,000 clients made the list test quadratic
        slow = [not lost[i] and i not in taken for i in range(len(entries))]
        if not any(slow):
            return slow, max(times, default=0.0)
        if len(accepted) == target:  # the K-th result arrived: the server stops waiting
            return slow, max(times[i] for i in accepted)
        assert deadline is not None  # without one, only surplus results can be late
        return slow, float(deadline)
