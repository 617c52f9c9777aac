"""Per-round logs of a run: ``metrics.csv`` beside ``results.json`` and, with ``[logging]
tensorboard = true``, TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``, from
the optional extra ``radbo[tensorboard]``).

Both hold the same scalars, one row (TensorBoard: one step) per round:

- ``round``: rounds completed (``results.json``'s 0-based ``round`` + 1, as on the x-axis of
  ``radbo report``'s plots); row 0 is the initial evaluation, before any training, when the
  run has one (``initial`` in ``results.json``);
- the round's own scalar metrics as in ``results.json`` (``inner_loss``, ``outer_loss``,
  ``coverage_x_min``, ``rejected_updates``, ...; lists such as the coverage histograms and
  the wall-clock time are left out);
- ``test_*``: the evaluation, on evaluated rounds only (an empty cell elsewhere);
- cumulative cost counters up to and including the round: ``cumulative_communication_rounds``,
  ``cumulative_flops``, ``cumulative_bytes_down``, ``cumulative_bytes_up``,
  ``cumulative_bytes``, ``cumulative_energy_j`` (known joules, compute + radio; empty while
  nothing has been priced, so in row 0, and absent for a run without energy figures) and
  ``sim_clock_s`` (the virtual clock; absent for a run without device profiles, which has no
  clock).

The CSV is written at the end of a run (atomically, :func:`radbo.atomic.atomic_write_text`),
the TensorBoard events while it runs (``<run folder>/tensorboard/run``, and
``.../baseline`` for the paired baseline). A resumed run restores the cumulative counters
from its checkpoint's rows and logs from the round it resumes at; TensorBoard's
``purge_step`` hides the events a stopped run wrote past that round. A fresh run removes the
event files of a run it writes over.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from radbo.atomic import atomic_write_text
from radbo.registry import ConfigError

__all__ = [
    "MetricsAccumulator",
    "RoundLogger",
    "metrics_rows",
    "metrics_csv",
    "write_metrics_csv",
]

#: scalar keys of a ``results.json`` round that are not the round's metrics: structure, the
#: wall clock (not reproducible), and what the cumulative counters replace
_NOT_METRICS = frozenset(
    {"round", "communication_rounds", "wall_time_s", "sim_round_time_s", "sim_clock_s"}
)
#: per-round ``cost_<key>`` summed into ``cumulative_<key>``, in column order
_SUMMED = ("communication_rounds", "flops", "bytes_down", "bytes_up", "bytes")


def _is_scalar(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class MetricsAccumulator:
    """Turns ``results.json`` round rows, one after another, into metrics rows (see the module
    docstring) by keeping the cumulative cost counters.

    Args:
        clock: whether the run has a simulated clock (device profiles); without one
            ``sim_clock_s`` is left out.
    """

    def __init__(self, *, clock: bool) -> None:
        self.clock = clock
        self._sums: dict[str, float] = dict.fromkeys(_SUMMED, 0)
        self._energy: float = 0

    def initial(self, evaluation: Mapping[str, Any]) -> dict[str, Any]:
        """Row 0: the evaluation before training (``test_*`` keys) and zero costs."""
        row: dict[str, Any] = {"round": 0}
        row.update({k: v for k, v in evaluation.items() if _is_scalar(v)})
        row.update({f"cumulative_{k}": 0 for k in _SUMMED})
        if self.clock:
            row["sim_clock_s"] = 0.0
        return row

    def add(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """The metrics row of the round ``record`` (a ``results.json`` round)."""
        row: dict[str, Any] = {"round": int(record["round"]) + 1}
        tests: dict[str, Any] = {}
        for key, value in record.items():
            if not _is_scalar(value) or key in _NOT_METRICS or key.startswith("cost_"):
                continue
            (tests if key.startswith("test_") else row)[key] = value
        row.update(tests)
        self._sums["communication_rounds"] += record["communication_rounds"]
        for key in _SUMMED[1:]:
            self._sums[key] += record.get(f"cost_{key}", 0)
        row.update({f"cumulative_{k}": v for k, v in self._sums.items()})
        energy: Any = record.get("cost_energy_j")
        if _is_scalar(energy):
            self._energy += energy
        if self._energy > 0:  # nothing priced yet: unknown, not 0 J
            row["cumulative_energy_j"] = self._energy
        if self.clock:
            row["sim_clock_s"] = record["sim_clock_s"]
        return row


def metrics_rows(
    rounds: Sequence[Mapping[str, Any]],
    *,
    initial: Mapping[str, Any] | None = None,
    clock: bool = True,
) -> list[dict[str, Any]]:
    """The metrics rows of a run (module docstring): row 0 from ``initial`` when given, then
    one per element of ``rounds`` (``results.json`` rows, in order).

    >>> rows = metrics_rows(
    ...     [{"round": 0, "communication_rounds": 2, "sim_clock_s": 1.5, "outer_loss": 0.5,
    ...       "clients": [0, 1], "cost_flops": 10, "cost_bytes_down": 3, "cost_bytes_up": 1,
    ...       "cost_bytes": 4, "cost_energy_j": 0.0, "cost_energy_unpriced_flops": 10,
    ...       "test_accuracy": 0.5}],
    ...     initial={"test_accuracy": 0.1}, clock=False)
    >>> rows[0]["round"], rows[0]["test_accuracy"], rows[0]["cumulative_flops"]
    (0, 0.1, 0)
    >>> sorted(rows[1].items())  # doctest: +NORMALIZE_WHITESPACE
    [('cumulative_bytes', 4), ('cumulative_bytes_down', 3), ('cumulative_bytes_up', 1),
     ('cumulative_communication_rounds', 2), ('cumulative_flops', 10), ('outer_loss', 0.5),
     ('round', 1), ('test_accuracy', 0.5)]
    """
    acc = MetricsAccumulator(clock=clock)
    out = [] if initial is None else [acc.initial(initial)]
    out += [acc.add(r) for r in rounds]
    return out


def _columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """``round``, the metrics and ``test_*`` in first-seen order, then the cost counters."""
    costs = [f"cumulative_{k}" for k in _SUMMED] + ["cumulative_energy_j", "sim_clock_s"]
    seen: dict[str, None] = {"round": None}
    tests: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key not in costs:
                (tests if key.startswith("test_") else seen)[key] = None
    present = [c for c in costs if any(c in row for row in rows)]
    return [*seen, *tests, *present]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)  # repr round-trips
    return str(value)


def metrics_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` (:func:`metrics_rows`) as CSV text: a header, one line per row, an empty cell
    where a row has no value (a round not evaluated). Floats are written exactly (``repr``)."""
    columns = _columns(rows)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(c)) for c in columns])
    return buffer.getvalue()


def write_metrics_csv(
    path: str | Path,
    rounds: Sequence[Mapping[str, Any]],
    *,
    initial: Mapping[str, Any] | None = None,
    clock: bool = True,
) -> Path:
    """Write :func:`metrics_csv` of :func:`metrics_rows` to ``path`` atomically; returns it."""
    path = Path(path)
    atomic_write_text(path, metrics_csv(metrics_rows(rounds, initial=initial, clock=clock)))
    return path


def _summary_writer() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or a :class:`ConfigError` naming the extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "config error: logging.tensorboard = true needs the tensorboard package, which is "
            "not installed: pip install 'radbo[tensorboard]' (or set tensorboard = false)"
        ) from None
    return SummaryWriter


#: TensorBoard event files: events.out.tfevents.<10-digit seconds>.<host>.<pid>.<n>...
_EVENTS = "events.out.tfevents."


def _prepare_log_dir(log_dir: Path, *, resumed: bool) -> None:
    """Before a run opens its event file in ``log_dir``: a fresh run removes the event files
    there (those of a run it writes over, which TensorBoard would show beside its own); a
    resumed run waits, at most a second, until its file's name (which starts with the time
    in whole seconds) sorts after theirs, since TensorBoard reads the files in name order
    and its purge of the stopped run's later steps works only forward."""
    if not log_dir.is_dir():
        return
    files = [f for f in log_dir.iterdir() if f.name.startswith(_EVENTS) and f.is_file()]
    if not resumed:
        for f in files:
            f.unlink()
        return
    stamps = [f.name[len(_EVENTS) :].split(".", 1)[0] for f in files]
    latest = max((int(s) for s in stamps if s.isdigit()), default=None)
    while latest is not None and int(time.time()) <= latest:
        time.sleep(0.05)


class RoundLogger:
    """Writes each round's metrics row (:class:`MetricsAccumulator`) to TensorBoard while a
    run runs; does nothing when ``log_dir`` is ``None`` or ``tensorboard`` is false.

    Args:
        log_dir: the TensorBoard folder (created by the writer in :meth:`start`).
        tensorboard: ``[logging] tensorboard``.
        clock: whether the run has a simulated clock (device profiles).

    Raises:
        ConfigError: ``tensorboard`` is true and the ``tensorboard`` package is missing (at
            construction, before a run builds anything).
    """

    def __init__(self, log_dir: Path | None, *, tensorboard: bool, clock: bool) -> None:
        self.log_dir = log_dir
        self.accumulator = MetricsAccumulator(clock=clock)
        self.writer: Any = None
        self._writer_class: Any = None
        if log_dir is not None and tensorboard:
            self._writer_class = _summary_writer()

    def start(
        self, done: Sequence[Mapping[str, Any]] = (), initial: Mapping[str, Any] | None = None
    ) -> None:
        """Open the event file. ``done``: rows of the rounds already run (a resumed run's
        checkpoint): they restore the cumulative counters, are not logged again, and events a
        stopped run wrote from the resumed round on are purged (TensorBoard's
        ``purge_step``); a fresh run removes the event files of a run it writes over.
        ``initial``: the initial evaluation, logged at step 0 unless resuming."""
        if self._writer_class is None:
            return
        for row in done:
            self.accumulator.add(row)
        assert self.log_dir is not None  # a writer class is found only for a log_dir
        _prepare_log_dir(self.log_dir, resumed=bool(done))
        # a resumed run's first step is rounds done + 1 (step k is the row after round k - 1):
        # TensorBoard hides the events a stopped run wrote from that step on
        first = int(done[-1]["round"]) + 2 if done else None
        self.writer = self._writer_class(log_dir=str(self.log_dir), purge_step=first)
        if not done and initial is not None:
            self._write(self.accumulator.initial(initial))

    def log(self, record: Mapping[str, Any]) -> None:
        """Log the round ``record`` (a ``results.json`` round) at step ``round + 1``."""
        if self.writer is not None:
            self._write(self.accumulator.add(record))

    def _write(self, row: Mapping[str, Any]) -> None:
        step = int(row["round"])
        for key, value in row.items():
            if key != "round":
                self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
