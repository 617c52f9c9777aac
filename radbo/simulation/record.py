"""What a round leaves behind: its :class:`RoundRecord`, and the observers that read it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NotRequired, Protocol

from pydantic import ConfigDict
from typing_extensions import TypedDict

from radbo.cost import LedgerEntry, totals
from radbo.schema import Amount, Count, is_count, is_finite, is_number, short

__all__ = ["RoundObserver", "RoundRecord", "RoundRow", "check_rounds", "round_row_values"]


@dataclass
class RoundRecord:
    """What happened in one round: sampled and unavailable clients, phase metrics, the cost
    ledger (one entry per client and phase), simulated round time and virtual clock, and the
    clients whose update was rejected in each phase (``{phase: [client, ...]}``; see
    :func:`~radbo.simulation.screening.update_problem`) and those that dropped out in each
    phase. ``failures`` gives the reasons a backend reported for the clients it marked lost or
    rejected (``{phase: {client: reason}}``; :attr:`ClientResult.lost` / ``rejected``), written
    to :meth:`as_dict` only when there are any. ``divergence`` is set when the divergence guard
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


class RoundRow(TypedDict):
    """The schema of one round record (:meth:`RoundRecord.as_dict`) as a checkpoint's history
    stores it: the engine's fields typed (times finite and not negative), the algorithm's
    metrics free (a NaN there means nothing was measured: no client's result reached that
    phase), the rest checked by :func:`round_row_values`."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    round: Count
    clients: list[Count]
    unavailable: list[Count]
    rejected: dict[str, list[Count]]
    dropped: NotRequired[dict[str, list[Count]]]
    late: NotRequired[dict[str, list[Count]]]
    communication_rounds: Count
    wall_time_s: Amount
    sim_round_time_s: Amount
    sim_clock_s: Amount


# the engine's counters of a round (RoundRecord.metrics), each the size of one of its lists
_ROUND_COUNTS = {
    "rejected_updates": "rejected",
    "dropped_clients": "dropped",
    "late_clients": "late",
}


def round_row_values(row: RoundRow) -> RoundRow:
    """The values of a round record's free keys that radbo computes as numbers: evaluations
    (``test_*``: finite, but a confidence interval of one episode, ``*_ci95``, is NaN), cost
    counters (``cost_*``: finite, not negative), coverage figures and the engine's counts of
    rejected, dropped and late clients (equal to its lists)."""
    for key, value in row.items():
        if not isinstance(key, str):
            continue
        if key.startswith("test_"):
            if not is_number(value):
                raise ValueError(f"{key} = {short(value)} is not a number")
            if not (is_finite(value) or (key.endswith("_ci95") and math.isnan(value))):
                raise ValueError(f"{key} = {short(value)} is not a finite number")
        elif key.startswith("cost_") or (key.startswith("coverage_") and key.endswith("_min")):
            if not (is_finite(value) and value >= 0):
                raise ValueError(f"{key} = {short(value)} is not a finite number >= 0")
        elif key.startswith(("untrained_fraction_", "never_trained_fraction_")):
            if not (is_number(value) and 0 <= value <= 1):
                raise ValueError(f"{key} = {short(value)} is not a fraction in [0, 1]")
        elif key.startswith("coverage_") and key.endswith("_histogram"):
            if not (isinstance(value, list) and all(is_count(v) for v in value)):
                raise ValueError(f"{key} = {short(value)} is not a list of counts")
        elif key in _ROUND_COUNTS:
            listed = row.get(_ROUND_COUNTS[key], {})
            size = sum(len(c) for c in listed.values()) if isinstance(listed, dict) else None
            if not is_count(value) or value != size:
                raise ValueError(f"{key} = {short(value)}, but the round lists {size} such clients")
    return row


def check_rounds(done: int, clock_s: float, rows: list[dict[str, Any]], history: str) -> None:
    """A checkpoint's round records (of its history file named ``history``) against its
    counters: ``done`` records, numbered 0 to ``done - 1``, on a clock that never runs back
    and ends at ``clock_s``; raises ``ValueError`` saying what does not fit."""
    if len(rows) != done:
        raise ValueError(
            f"the index says {done} rounds are done, but its history {history} holds {len(rows)}"
        )
    clock = 0.0
    for i, row in enumerate(rows):
        if row["round"] != i:
            raise ValueError(f"{history}: rows[{i}] is of round {row['round']}, not {i}")
        if row["sim_clock_s"] < clock:
            raise ValueError(
                f"{history}: rows[{i}].sim_clock_s = {row['sim_clock_s']!r} is before the "
                f"round before ({clock!r})"
            )
        clock = row["sim_clock_s"]
    if clock_s < 0 or clock_s != clock:
        raise ValueError(
            f"clock_s = {clock_s!r}, but the clock after round {done - 1} is {clock!r}"
            if rows
            else f"clock_s = {clock_s!r} before any round, not 0.0"
        )


class RoundObserver(Protocol):
    """Something that follows a run round by round (a checkpointer, a progress bar, a log):
    :meth:`radbo.simulation.Simulation.iterate` calls :meth:`on_round` after every round, in
    order, once the round is final (evaluated and past the divergence guard)."""

    def on_round(self, state: Any, record: RoundRecord) -> None:
        """Take note of ``record`` and of ``state``, the state the round left."""
        ...
