"""What a round leaves behind: its :class:`RoundRecord`, and the observers that read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from radbo.cost import LedgerEntry, totals

__all__ = ["RoundObserver", "RoundRecord"]


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


class RoundObserver(Protocol):
    """Something that follows a run round by round (a checkpointer, a progress bar, a log):
    :meth:`radbo.simulation.Simulation.iterate` calls :meth:`on_round` after every round, in
    order, once the round is final (evaluated and past the divergence guard)."""

    def on_round(self, state: Any, record: RoundRecord) -> None:
        """Take note of ``record`` and of ``state``, the state the round left."""
        ...
