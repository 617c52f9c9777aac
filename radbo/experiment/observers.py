"""What a run does after each round, as observers of its rounds.

:func:`radbo.experiment.runner.run` drives :meth:`radbo.simulation.Simulation.iterate` with
these :class:`~radbo.simulation.record.RoundObserver` s, in this order: :class:`RunHistory`
(the rows and ledger of the results, logged as they come), :class:`StopCheck` (whether a
SIGINT / SIGTERM asks the run to stop after this round), :class:`Checkpointer` (a checkpoint
every ``checkpoint_every`` rounds, after the last, and at a stop) and :class:`ProgressShown`
(the progress bar and its figures).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radbo.checkpoint import save_checkpoint
from radbo.cost import as_dicts
from radbo.experiment.logs import RoundLogger
from radbo.experiment.progress import Progress
from radbo.experiment.stop import signal_name, stop_requested
from radbo.simulation import RUN_CHECKPOINT, RoundRecord, Simulation

__all__ = ["Checkpointer", "ProgressShown", "RunHistory", "StopCheck"]


@dataclass
class RunHistory:
    """A run's results so far: one row per round (:meth:`RoundRecord.as_dict`), each logged
    to ``board`` as it comes, the ledger rows, and the last evaluation.

    Attributes:
        rows / ledger: the rounds and ledger rows so far (a resumed run's to begin with).
        board: the per-round log (TensorBoard scalars, or nothing).
        last_eval: the metrics of the last evaluated round (no ``test_`` prefix).
    """

    rows: list[dict[str, Any]]
    ledger: list[dict[str, Any]]
    board: RoundLogger
    last_eval: dict[str, float] = field(default_factory=dict)

    def on_round(self, state: Any, record: RoundRecord) -> None:
        self.rows.append(record.as_dict())
        self.board.log(self.rows[-1])
        self.ledger += as_dicts(record.ledger)
        if record.evaluation is not None:
            self.last_eval = record.evaluation


@dataclass
class StopCheck:
    """Whether the run stops after a round: :attr:`stopped` says when (``"SIGTERM after round
    3 of 60"``) once a stop was requested (:func:`radbo.experiment.stop.stop_requested`) after
    a round before the last of ``rounds``; a stop after the last round is none."""

    rounds: int
    stopped: str | None = None

    def on_round(self, state: Any, record: RoundRecord) -> None:
        completed = record.round + 1
        # read once: a signal may come at any moment
        signum = stop_requested() if completed < self.rounds else None
        if signum is not None:
            self.stopped = f"{signal_name(signum)} after round {completed} of {self.rounds}"


@dataclass
class Checkpointer:
    """Writes a run's checkpoints: the algorithm state, the engine's state and the results so
    far (``history``), into ``directory`` every ``every`` rounds and after the last of
    ``rounds`` (``every`` ``None``: never), and, with ``on_stop``, after the round a stop
    came in (``stop``). ``directory`` ``None``: no checkpoints but those :meth:`write` is
    asked for."""

    simulation: Simulation[Any]
    config: Mapping[str, Any]
    history: RunHistory
    stop: StopCheck
    directory: Path | None = None
    every: int | None = None
    rounds: int = 0
    on_stop: bool = False

    def on_round(self, state: Any, record: RoundRecord) -> None:
        if self.directory is None:
            return
        completed = record.round + 1
        every = self.every
        regular = every is not None and (completed % every == 0 or completed == self.rounds)
        if regular or (self.stop.stopped is not None and self.on_stop):
            self.write(self.directory, state, completed, record.clock_s)

    def write(self, directory: Path, state: Any, rounds_done: int, clock_s: float) -> Path:
        """A checkpoint of ``state`` after ``rounds_done`` rounds, at ``clock_s`` on the
        virtual clock, in ``directory``; returns its index."""
        sim_tensors, sim_meta = self.simulation.state_dict()
        return save_checkpoint(
            directory,
            config=self.config,
            state=state,
            rounds_done=rounds_done,
            clock_s=clock_s,
            rows=self.history.rows,
            ledger=self.history.ledger,
            sim_tensors=sim_tensors,
            sim_meta=sim_meta,
            contents=RUN_CHECKPOINT,
        )

    def write_last(self, directory: Path, *, state: Any, start_clock_s: float) -> Path:
        """A checkpoint of ``state``, the state after the last round run (``start_clock_s``:
        the virtual clock when no round was run), in ``directory``; returns its index."""
        rows = self.history.rows
        clock_s = rows[-1]["sim_clock_s"] if rows else start_clock_s
        return self.write(directory, state, len(rows), clock_s)


@dataclass
class ProgressShown:
    """The progress bar of a run, one step a round, with the round's training loss, the last
    evaluation's accuracy (from ``history``) and the latest divergence, from its round on (a
    resumed run's from the rows it resumes with)."""

    bar: Progress
    history: RunHistory
    diverged: Mapping[str, Any] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        rows = self.history.rows
        self.diverged = next((r["divergence"] for r in reversed(rows) if "divergence" in r), None)

    def on_round(self, state: Any, record: RoundRecord) -> None:
        self.bar.update(1)
        postfix = {}
        for key, label in (("outer_loss", "outer"), ("train_loss", "loss")):
            if key in record.metrics:
                postfix[label] = f"{record.metrics[key]:.3f}"
                break
        last_eval = self.history.last_eval
        if last_eval:
            postfix["acc"] = f"{last_eval['accuracy']:.3f}"
            if "accuracy_ci95" in last_eval:
                postfix["acc"] += f"±{last_eval['accuracy_ci95']:.3f}"
        if record.divergence is not None:
            self.diverged = record.divergence
        if self.diverged is not None:
            postfix["diverged"] = f"r{self.diverged['round']}"
            if self.diverged["action"] == "rollback":
                postfix["diverged"] += f" rolled back, lr x{self.diverged['lr_scale']:g}"
        self.bar.set_postfix(postfix)
