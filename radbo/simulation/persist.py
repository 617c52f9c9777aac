"""What a run's checkpoint holds beside the algorithm state, composed from the schemas and
checks each part of the engine declares beside its own code: round records
(:class:`~radbo.simulation.record.RoundRow`), ledger rows (:class:`radbo.cost.LedgerRow`), the
coverage trackers (:class:`radbo.masks.coverage_report.CoverageState`), the FLOP meter
(:class:`radbo.cost.FlopMeterState`) and the divergence guard. :mod:`radbo.checkpoint` stores
and verifies the files; :data:`RUN_CHECKPOINT` tells it what they mean.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict

from radbo.checkpoint import Checkpoint, Contents, memory_ceiling
from radbo.cost import FlopMeterState, LedgerRow
from radbo.masks.coverage_report import CoverageState
from radbo.schema import is_count
from radbo.simulation.coverage import check_coverage_history
from radbo.simulation.divergence import check_guard_history, replay_test_loss
from radbo.simulation.ledger import check_ledger_rows
from radbo.simulation.record import RoundRow, check_rounds, round_row_values

__all__ = ["RUN_CHECKPOINT", "EngineState", "check_run_history", "forget_end_of_run_evaluation"]


class EngineState(BaseModel):
    """The engine's JSON state (:meth:`radbo.simulation.Simulation.state_dict`) as a
    checkpoint's index stores it; parts other than coverage and the FLOP meter (the divergence
    guard's) are checked against the rounds by :func:`check_run_history` and restored by the
    engine, which refuses what does not fit."""

    model_config = ConfigDict(extra="allow")
    coverage: dict[str, CoverageState] = {}
    flop_meter: FlopMeterState | None = None


def check_run_history(
    done: int,
    clock_s: float,
    engine: Mapping[str, Any],
    rows: list[dict[str, Any]],
    ledger: list[dict[str, Any]],
    history: str,
) -> None:
    """The counters of a run's checkpoint against the history it names (each part checks its
    own: :func:`~radbo.simulation.record.check_rounds`,
    :func:`~radbo.simulation.ledger.check_ledger_rows`,
    :func:`~radbo.simulation.coverage.check_coverage_history`,
    :func:`~radbo.simulation.divergence.check_guard_history`); raises ``ValueError``."""
    check_rounds(done, clock_s, rows, history)
    check_ledger_rows(ledger, rows, done, history)
    check_coverage_history(engine.get("coverage") or {}, rows)
    guard = engine.get("divergence")
    if isinstance(guard, dict):
        check_guard_history(guard, rows)
    elif any("divergence" in row for row in rows):
        raise ValueError("rounds record divergences, but the engine state has no divergence guard")


#: What an index holds besides the per-round coverage history: the config, the state's
#: scalars, the FLOP meter's cache, the divergence guard's values (measured: 4 KB after 3
#: rounds of a 3-client run, 8 KB after 4 rounds of the 10-client demo), with a wide margin.
INDEX_BASE_BYTES = 16 << 20
#: An index's coverage history per round: one entry per tracked block (about 250 bytes with a
#: histogram of a few counts), whose histogram holds up to one count per client.
INDEX_ROUND_BYTES = 4 << 10
INDEX_CLIENT_BYTES = 64
#: A history per round: its record (about 2 KB, one id per client in its lists) and one ledger
#: row (about 300 bytes) per client and phase.
HISTORY_BASE_BYTES = 16 << 20
HISTORY_ROUND_BYTES = 64 << 10
HISTORY_CLIENT_BYTES = 4 << 10


def checkpoint_caps(config: Mapping[str, Any] | None) -> tuple[int, int]:
    """The largest index and history file (bytes) a run of ``config`` writes, with a wide
    margin, from its rounds and clients (an unknown size: what memory can take,
    :func:`radbo.checkpoint.memory_ceiling`)."""
    ceiling = memory_ceiling()
    if config is None:
        return ceiling, ceiling
    rounds = config.get("rounds")
    fleet = config.get("fleet")
    clients = fleet.get("num_clients") if isinstance(fleet, Mapping) else None
    if not (is_count(rounds) and is_count(clients)):
        return ceiling, ceiling
    extra = 4 * len(json.dumps(config, allow_nan=True))
    index = INDEX_BASE_BYTES + extra + rounds * (INDEX_ROUND_BYTES + INDEX_CLIENT_BYTES * clients)
    history = HISTORY_BASE_BYTES + rounds * (HISTORY_ROUND_BYTES + HISTORY_CLIENT_BYTES * clients)
    return min(index, ceiling), min(history, ceiling)


#: A run's checkpoint: what :func:`radbo.run` saves and resumes from.
RUN_CHECKPOINT = Contents(
    row=Annotated[RoundRow, AfterValidator(round_row_values)],
    ledger_row=LedgerRow,
    engine=EngineState,
    check=check_run_history,
    caps=checkpoint_caps,
)


def forget_end_of_run_evaluation(ckpt: Checkpoint, eval_every: int, smoothing: float) -> bool:
    """Make the checkpoint of a finished run continue as a longer run would: drop the
    evaluation its last round got only for being the last (``rounds_done`` not a multiple of
    ``eval_every``), from the round's record and from the divergence guard's running test loss
    (``ckpt.sim_meta["divergence"]``, replayed from the rounds that passed the guard without
    it; ``smoothing`` is the guard's weight of the past,
    :data:`radbo.simulation.divergence.SMOOTHING`), so that extending a run of N rounds to M
    equals a run of M rounds. Returns whether there was such an evaluation. A regular
    evaluation (every ``eval_every`` rounds) stays."""
    if not ckpt.rows or ckpt.rounds_done % eval_every == 0:
        return False
    last = ckpt.rows[-1]
    tests = [k for k in last if isinstance(k, str) and k.startswith("test_")]
    if not tests:
        return False
    for key in tests:
        del last[key]
    divergence = last.get("divergence")
    if isinstance(divergence, dict):  # a rollback keeps the diverged evaluation
        divergence.pop("evaluation", None)
    guard = ckpt.sim_meta.get("divergence")
    if divergence is None and isinstance(guard, dict):  # the round passed: the guard took it
        replay_test_loss(guard, ckpt.rows, smoothing)
    return True
