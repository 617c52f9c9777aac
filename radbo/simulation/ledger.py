"""Pricing a client's phase into the cost ledger, and checking a ledger against its rounds.

The engine prices each client result as it arrives (its simulated compute and transfer times
decide which results arrive in time: :meth:`radbo.simulation.participation.Participation.
arrivals`), so pricing is a step of the phase, not an afterthought of the round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from radbo.client import ClientResult
from radbo.cost import DeviceLike, LedgerEntry, phase_energy, phase_times, totals

__all__ = ["check_ledger_rows", "check_round_costs", "ledger_entry"]


def ledger_entry(
    round: int, phase: str, result: ClientResult, extra_down: int, profile: DeviceLike | None
) -> LedgerEntry:
    """The ledger row of ``result`` in ``phase`` of ``round``: its counters, with
    ``extra_down`` bytes (index metadata) added to its download, priced in time and energy on
    the client's device ``profile`` (``None``: no device, no time or energy)."""
    c = result.cost
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


def check_round_costs(
    rows: Sequence[Mapping[str, Any]], ledger: Sequence[Mapping[str, Any]]
) -> None:
    """``ValueError`` unless every round's ``cost_*`` figures among ``rows`` (round records)
    are the sums (:func:`radbo.cost.totals`) of its ``ledger`` rows, of the same types. Rows
    written before a total existed lack its key."""
    charged: dict[Any, list[LedgerEntry]] = {}
    for entry in ledger:
        charged.setdefault(entry["round"], []).append(LedgerEntry(**entry))
    for row in rows:
        spent = totals(charged.get(row["round"], []))
        recorded = {k[5:]: v for k, v in row.items() if k.startswith("cost_")}
        differ = sorted(
            f"cost_{k}"
            for k, v in recorded.items()
            if spent.get(k) != v or type(spent.get(k)) is not type(v)
        )
        if differ:
            raise ValueError(
                f"round {row['round']}'s {', '.join(differ[:3])} are not the sums of its "
                "ledger rows"
            )


def check_ledger_rows(
    ledger: list[dict[str, Any]], rows: list[dict[str, Any]], done: int, history: str
) -> None:
    """A checkpoint's ledger rows (of its history file named ``history``) against its round
    records: rows of the ``done`` rounds, in round order, each charging a client its round
    sampled; raises ``ValueError`` saying what does not fit."""
    clients = [set(row["clients"]) for row in rows]
    last = 0
    for i, entry in enumerate(ledger):
        q = entry["round"]
        if not last <= q < done:
            raise ValueError(
                f"{history}: ledger[{i}] is of round {q}, "
                + (f"after round {last}'s rows" if q < last else f"but {done} rounds are done")
            )
        if entry["client"] not in clients[q]:
            raise ValueError(
                f"{history}: ledger[{i}] charges client {entry['client']}, which round {q} did "
                "not sample"
            )
        last = q
