"""Running a config end to end: the round loop with progress, checkpoints and results.

>>> from radbo.config import RunConfig
>>> cfg = RunConfig(rounds=2, eval_every=1)        # doctest: +SKIP
>>> result = radbo.run(cfg, progress=False)        # doctest: +SKIP
>>> result.final["test_accuracy"]                  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from radbo.allocator import retain_freed_memory
from radbo.atomic import atomic_write_text
from radbo.checkpoint import (
    CheckpointError,
    has_checkpoint,
    load_checkpoint,
)
from radbo.client import Backend
from radbo.config import ConfigError, RunConfig
from radbo.cost import (
    FlopMeter,
    LedgerEntry,
    savings,
    savings_at_accuracy,
    totals,
    totals_by_tier,
)
from radbo.experiment.baseline import baseline_config
from radbo.experiment.build import Experiment, build
from radbo.experiment.lock import (
    LOCK_FILE,
    RunFolderError,
    lock_run_folder,
    path_errors,
    path_problem,
)
from radbo.experiment.logs import RoundLogger, write_metrics_csv
from radbo.experiment.observers import Checkpointer, ProgressShown, RunHistory, StopCheck
from radbo.experiment.progress import progress_bar
from radbo.experiment.stop import RunStopped, signal_name, stop_requested
from radbo.jsonio import dumps as json_dumps
from radbo.limits import caps_lifted
from radbo.threads import torch_threads
from radbo.version import __version__

__all__ = [
    "RunResult",
    "check_run_folder",
    "run",
    "run_folder_contents",
    "save_results",
    "torch_threads",
]


@dataclass
class RunResult:
    """Outcome of :func:`run`.

    Attributes:
        rounds: per-round metrics (``RoundRecord.as_dict``).
        final: the last evaluation (``test_accuracy``, ``test_loss``).
        state: the final algorithm state.
        totals: run totals (FLOPs, bytes, simulated time, communication rounds, energy in
            joules: ``energy_compute_j``, ``energy_radio_j``, ``energy_j`` and the FLOPs and
            bytes without an energy figure, ``energy_unpriced_flops`` / ``_bytes``; see
            :func:`radbo.cost.totals`, ...).
        totals_by_tier: the same counters per device tier.
        ledger: one row per client, phase and round.
        baseline: the paired full-model run's result (when ``baseline.enabled``).
        savings: this run's compute, bytes, simulated time and energy as fractions of the
            baseline's (:func:`radbo.cost.savings`).
        savings_at_accuracy: what this run and the baseline each spent to first reach the
            final accuracy of the worse of the two, and this run's as fractions of the
            baseline's (:func:`radbo.cost.savings_at_accuracy`).
        initial: the evaluation of the initial state, before round 0 (``test_`` keys), or
            ``None`` when the run has no evaluator.
        resumed_from_fallback: ``None``, or why the newest checkpoint was refused when a resume
            continued from the previous one (``results.json`` has it then).
        overrides: the command-line overrides the config was made with
            (``"algorithm.inner_lr=0.2"``, :func:`radbo.config.apply_overrides`), as given;
            ``results.json`` records them beside the merged config.
        stopped: ``None``, or, for a run stopped early by SIGINT / SIGTERM
            (:mod:`radbo.experiment.stop`), when: ``"SIGTERM after round 3 of 60"``
            (``results.json`` has it then: its rounds are those run so far).
    """

    config: RunConfig
    rounds: list[dict[str, Any]]
    final: dict[str, float]
    state: Any
    output_dir: Path | None = None
    totals: dict[str, float] = field(default_factory=dict)
    totals_by_tier: dict[str, dict[str, float]] = field(default_factory=dict)
    ledger: list[dict[str, Any]] = field(default_factory=list)
    baseline: RunResult | None = None
    savings: dict[str, float] | None = None
    resumed_from_fallback: str | None = None
    overrides: list[str] = field(default_factory=list)
    savings_at_accuracy: dict[str, Any] | None = None
    initial: dict[str, float] | None = None
    stopped: str | None = None
    # writes this run's state after its last round as a checkpoint into a folder (a stop in
    # the baseline keeps the finished main run resumable from checkpoints/run)
    _write_checkpoint: Callable[[Path], object] | None = field(
        default=None, repr=False, compare=False
    )


def run(
    config: RunConfig,
    *,
    progress: bool = True,
    output_dir: str | Path | None = None,
    save: bool = True,
    resume: bool = False,
    backend_factory: Callable[[RunConfig], Backend] | None = None,
    overwrite: bool = True,
    overrides: Sequence[str] = (),
) -> RunResult:
    """Run ``config`` end to end (and its full-model baseline when ``baseline.enabled``).

    With ``save`` writes ``results.json``, ``ledger.json`` and ``accuracy.png`` to
    ``output_dir`` (default ``config.output_dir``). That folder is made before round 0 (one
    that cannot be made or written is a :class:`ConfigError`), and the empty folders made for
    it are removed again when the run stops with an error.

    With ``config.checkpoint_every = N`` a checkpoint (safetensors + JSON, atomic) is written
    to ``<output_dir>/checkpoints/run`` (``.../baseline`` for the baseline) every N rounds and
    after the last. ``resume=True`` continues from those checkpoints (a folder without a
    checkpoint of the run is a :class:`CheckpointError`: nothing is started afresh unasked):
    the result is the same as an uninterrupted run's, number for number. The
    stored config must match ``config`` except ``rounds``, which may grow (``output_dir`` and
    ``checkpoint_every`` may differ too). Extending a finished run equals running the longer
    run at once: the evaluation its last round got only because it was last is dropped
    (:func:`radbo.simulation.forget_end_of_run_evaluation`).

    ``backend_factory(run_config)``, when given, makes the backend that runs the client work of
    each run (the main run and its baseline; e.g. :class:`radbo.flower.FlowerBackend`) in
    place of the one ``[runtime] backend`` names.

    ``overwrite=False`` refuses (:class:`ConfigError`, before anything is built) an output
    folder that already holds a run (:func:`check_run_folder`; ``radbo run`` without
    ``--overwrite``); the default writes over it. ``overrides`` are recorded in
    ``results.json`` (:attr:`RunResult.overrides`), not applied: ``config`` has them already.

    A run that writes takes the lock of its output folder first (``radbo.lock``,
    :mod:`radbo.experiment.lock`) and releases it at the end: a second run into a folder
    another process is running into is refused (``RunFolderBusyError``, naming its PID).
    Paths the system refuses (a name too long, a NUL character), a folder where the run
    writes a file or the reverse, and results that cannot be written (disk full, a read-only
    folder) are a ``RunFolderError`` naming the path, each found before round 0 where it
    can be.

    Under :func:`radbo.experiment.stop.stop_on_signals` (what ``radbo run`` does), SIGINT and
    SIGTERM stop the run after its current round: it writes a checkpoint to
    ``<output_dir>/checkpoints/run`` (``.../baseline`` in the baseline; with or without
    ``checkpoint_every``), saves the results so far (with ``save``) and raises
    :class:`~radbo.experiment.stop.RunStopped`; ``resume=True`` then continues it to the
    numbers an uninterrupted run gives. A stop in the main run stops its baseline too.
    """
    out = Path(output_dir if output_dir is not None else config.output_dir)
    writes = save or config.checkpoint_every is not None
    made = _make_output_dir(out) if writes else []
    try:
        # the lock first: a run in progress is named as such, not as a folder holding a run
        with _locked(out) if writes else nullcontext():
            if writes or resume:
                check_run_folder(out, resume=resume, overwrite=overwrite or not writes)
            if config.runtime.allocator == "retain":
                retain_freed_memory()  # the process's, for good (radbo.allocator)
            with torch_threads(config.runtime.threads):
                return _run(
                    config, progress, output_dir, save, resume, backend_factory, tuple(overrides)
                )
    except BaseException:  # a refused config, a failed run: leave no empty folders behind
        for folder in made:
            with suppress(OSError):
                folder.rmdir()  # only if still empty
        raise


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    """The lock of the run folder ``out`` held inside the block (released on the way out)."""
    with path_errors(out, "run folder error: cannot lock the output folder"):
        lock = lock_run_folder(out)
    try:
        yield
    finally:
        lock.release()


def _run(
    config: RunConfig,
    progress: bool,
    output_dir: str | Path | None,
    save: bool,
    resume: bool,
    backend_factory: Callable[[RunConfig], Backend] | None,
    overrides: tuple[str, ...] = (),
) -> RunResult:
    out = Path(output_dir if output_dir is not None else config.output_dir)
    checkpoints = out / "checkpoints"
    keeps = save or config.checkpoint_every is not None  # a stopped run leaves a checkpoint
    result = _run_once(
        config,
        progress=progress,
        desc="radbo",
        checkpoints=checkpoints / "run",
        resume=resume,
        backend_factory=backend_factory,
        final=checkpoints / "final" if save else None,
        log_dir=out / "tensorboard" / "run" if save else None,
        checkpoint_on_stop=keeps,
    )
    if config.baseline.enabled and result.stopped is None:
        signum = stop_requested()
        if signum is not None:  # between the two runs: the baseline is not begun
            result.stopped = (
                f"{signal_name(signum)} after round {config.rounds} of {config.rounds}, "
                "before the baseline"
            )
        else:
            with caps_lifted():  # config passed the caps (or was forced past them); so does this
                base_config = baseline_config(config)
            base = _run_once(
                base_config,
                progress=progress,
                desc="baseline",
                checkpoints=checkpoints / "baseline",
                resume=resume,
                backend_factory=backend_factory,
                log_dir=out / "tensorboard" / "baseline" if save else None,
                checkpoint_on_stop=keeps,
            )
            result.baseline = base
            if base.stopped is not None:  # savings of a part of the baseline would mislead
                result.stopped = f"{base.stopped} of the baseline"
            else:
                result.savings = savings(result.totals, base.totals)
                result.savings_at_accuracy = savings_at_accuracy(
                    result.rounds,
                    result.final,
                    base.rounds,
                    base.final,
                    run_initial=result.initial,
                    baseline_initial=base.initial,
                )
        if result.stopped is not None and keeps and config.checkpoint_every is None:
            # the finished main run's state where --resume looks for it (with
            # checkpoint_every its last checkpoint there holds it already)
            assert result._write_checkpoint is not None, "a finished run keeps its writer"
            result._write_checkpoint(checkpoints / "run")
    result.overrides = list(overrides)
    if save:
        _save(result, out)
        result.output_dir = out
    if result.stopped is not None:
        signum = stop_requested()
        raise RunStopped(signum if signum is not None else 0, out if keeps else None, result)
    return result


def _save(result: RunResult, out: Path) -> None:
    """:func:`save_results`, with a write the system refuses (disk full, a read-only folder)
    as a :class:`RunFolderError` naming the file, not a traceback after the last round."""
    try:
        save_results(result, out)
    except OSError as err:
        name = f" ({err.filename})" if err.filename else ""
        kept = ""
        if has_checkpoint(out / "checkpoints" / "run"):
            kept = "; its checkpoints are intact: make room and continue with --resume"
        raise RunFolderError(
            f"run folder error: cannot write the results to {out}{name}: {path_problem(err)}{kept}"
        ) from None


# config keys a resumed run may change: the target length, where it writes, how often,
# what it logs besides results.json
_RESUMABLE = ("rounds", "output_dir", "checkpoint_every", "logging")


def _run_once(
    config: RunConfig,
    *,
    progress: bool,
    desc: str,
    checkpoints: Path | None = None,
    resume: bool = False,
    backend_factory: Callable[[RunConfig], Backend] | None = None,
    final: Path | None = None,
    log_dir: Path | None = None,
    checkpoint_on_stop: bool = False,
) -> RunResult:
    """One run of ``config`` (the main run or its baseline). ``final``: where to write the
    state after the last round as a checkpoint (what ``radbo export RUN_DIR`` exports) when
    no checkpoint of ``checkpoints`` holds it already.

    When a stop is requested (:func:`radbo.experiment.stop.stop_requested`) the run ends
    after the round in progress, its checkpoint written to ``checkpoints`` with
    ``checkpoint_on_stop`` (as the regular checkpoint of that round would be), and the
    result says so (:attr:`RunResult.stopped`)."""
    # per-round TensorBoard scalars ([logging] tensorboard) to log_dir; a missing extra is
    # a ConfigError before anything is built
    board = RoundLogger(
        log_dir, tensorboard=config.logging.tensorboard, clock=config.fleet.has_devices
    )
    exp = build(config)
    sim = exp.simulation
    if backend_factory is not None:
        sim.backend = backend_factory(config)
    config_data = config.model_dump(mode="json")
    begin = _beginning(config, exp, config_data, checkpoints, final, resume)
    initial = _initial_evaluation(exp)
    board.start(begin.rows, initial)
    history = RunHistory(begin.rows, begin.ledger, board, _last_evaluation(begin.rows))
    stop = StopCheck(config.rounds)
    every = config.checkpoint_every
    saver = Checkpointer(
        sim, config_data, history, stop, checkpoints, every, config.rounds, checkpoint_on_stop
    )
    bar = progress_bar(config.rounds, initial=begin.done, desc=desc, enabled=progress)
    observers = (history, stop, saver, ProgressShown(bar, history))
    state = begin.state
    try:
        rounds = config.rounds - begin.done
        run = sim.iterate(begin.state, rounds, begin.done, begin.clock_s, observers)
        for state, _ in run:  # noqa: B007 (the state after the loop is the run's last)
            if stop.stopped is not None:
                break
    finally:
        bar.close()
        board.close()
        _close(sim.backend)
    # writes the state after the last round run as a checkpoint into a folder
    write_last = partial(saver.write_last, state=state, start_clock_s=begin.clock_s)
    # a stopped run is not finished: no final state to export
    if stop.stopped is None and final is not None and (every is None or checkpoints is None):
        write_last(final)
    stopped = stop.stopped
    return _result(config, history, state, begin, initial, stopped, sim.flop_meter, write_last)


def _result(
    config: RunConfig,
    history: RunHistory,
    state: Any,
    begin: _Beginning,
    initial: dict[str, float] | None,
    stopped: str | None,
    meter: FlopMeter | None,
    write_last: Callable[[Path], object],
) -> RunResult:
    """The result of a run of ``config`` that began at ``begin`` and left ``history`` and
    ``state`` (``write_last`` writes that state as a checkpoint; not for a stopped run)."""
    entries = [LedgerEntry(**row) for row in history.ledger]
    measurements = 0 if meter is None else meter.measurements
    return RunResult(
        config=config,
        rounds=history.rows,
        final={f"test_{k}": v for k, v in history.last_eval.items()},
        state=state,
        totals=_run_totals(history.rows, entries, measurements),
        totals_by_tier=totals_by_tier(entries),
        ledger=history.ledger,
        resumed_from_fallback=begin.fallback,
        initial=initial,
        stopped=stopped,
        _write_checkpoint=None if stopped is not None else write_last,
    )


@dataclass
class _Beginning:
    """Where a run begins: its state, virtual clock, rounds done, rows and ledger rows so far
    and, for a resume that fell back to an older checkpoint, why (:attr:`RunResult.
    resumed_from_fallback`)."""

    state: Any
    clock_s: float = 0.0
    done: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    ledger: list[dict[str, Any]] = field(default_factory=list)
    fallback: str | None = None


def _beginning(
    config: RunConfig,
    exp: Experiment,
    config_data: dict[str, Any],
    checkpoints: Path | None,
    final: Path | None,
    resume: bool,
) -> _Beginning:
    """Where the run of ``exp`` begins: its initial state, or with ``resume`` the newest
    usable checkpoint in ``checkpoints`` (or ``final``, the final state of a run finished
    without ``checkpoint_every``), with the engine's state restored into
    ``exp.simulation``."""
    source = checkpoints
    if resume and final is not None and (checkpoints is None or not has_checkpoint(checkpoints)):
        # a run finished without checkpoint_every: its final state, checkpoints/final, is
        # where it continues from (extended, or resumed as a --seeds run's finished seed)
        source = final
    if not (resume and source is not None and has_checkpoint(source)):
        return _Beginning(exp.initial_state)
    from radbo.checkpoint import Checkpoint, remove_temporary_files
    from radbo.simulation import RUN_CHECKPOINT, forget_end_of_run_evaluation
    from radbo.simulation.divergence import SMOOTHING

    remove_temporary_files(source)  # left by saves that crashed

    def restore(ckpt: Checkpoint) -> None:
        if ckpt.rounds_done < config.rounds:  # extending a finished run: as a longer run
            forget_end_of_run_evaluation(ckpt, config.eval_every, SMOOTHING)
        exp.simulation.load_state_dict(
            ckpt.sim_tensors,
            ckpt.sim_meta,
            template=exp.initial_state,
            rows=ckpt.rows,
            ledger=ckpt.ledger,
        )

    # verified (SHA-256, index model, finite tensors) and checked for sense (shapes,
    # counters against the history), the engine's state restored as its last check; falls
    # back to the previous checkpoint with a CheckpointWarning when the newest is unusable
    ckpt = load_checkpoint(
        source,
        template=exp.initial_state,
        config=config_data,
        ignore=_RESUMABLE,
        restore=restore,
        contents=RUN_CHECKPOINT,
    )
    if ckpt.rounds_done > config.rounds:
        raise CheckpointError(
            f"the checkpoint in {source} is after round {ckpt.rounds_done}, past "
            f"rounds = {config.rounds}; raise rounds to continue it"
        )
    return _Beginning(
        ckpt.state, ckpt.clock_s, ckpt.rounds_done, ckpt.rows, ckpt.ledger, ckpt.fallback
    )


def _run_totals(
    rows: list[dict[str, Any]], entries: list[LedgerEntry], flop_measurements: int
) -> dict[str, float]:
    """A run's totals (:attr:`RunResult.totals`) from its round ``rows`` and ledger
    ``entries``: the ledger's counters (:func:`radbo.cost.totals`), then the rounds'."""
    run_totals = totals(entries)
    run_totals["communication_rounds"] = sum(r["communication_rounds"] for r in rows)
    run_totals["sim_time_s"] = rows[-1]["sim_clock_s"] if rows else 0.0
    run_totals["client_rounds"] = sum(len(r["clients"]) for r in rows)
    run_totals["unavailable_client_rounds"] = sum(len(r["unavailable"]) for r in rows)
    run_totals["rejected_updates"] = sum(len(c) for r in rows for c in r["rejected"].values())
    run_totals["dropped_client_rounds"] = sum(
        len(c) for r in rows for c in r.get("dropped", {}).values()
    )
    run_totals["late_results"] = sum(len(c) for r in rows for c in r.get("late", {}).values())
    run_totals["empty_rounds"] = sum(1 for r in rows if not r["clients"])
    run_totals["flop_measurements"] = flop_measurements
    return run_totals


def _make_output_dir(out: Path) -> list[Path]:
    """Create the output folder before round 0, so that a folder that cannot be made or
    written is a :class:`ConfigError` naming it, not a traceback after the last round.
    Returns the folders it created, deepest first."""
    _check_path(out)
    problem = None
    with path_errors(out, "config error: output_dir ="):
        made = [p for p in (out, *out.parents) if not p.exists()]
        if out.exists() and not out.is_dir():
            problem = "it is a file, not a folder"
        else:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                problem = f"the folder cannot be created ({err.strerror or err})"
            else:
                if not os.access(out, os.W_OK | os.X_OK):
                    problem = "the folder is not writable"
    if problem is not None:
        raise ConfigError(f"config error: output_dir = {str(out)!r}: {problem}")
    return made


def _check_path(out: Path) -> None:
    """A :class:`RunFolderError` for an output folder path no system accepts (a NUL
    character), before anything looks it up (``Path.exists`` says ``False`` to it)."""
    if "\0" in str(out):
        raise RunFolderError(
            f"config error: output_dir = {str(out)!r}: a path cannot hold a NUL character"
        )


#: What a run writes in its folder, by kind: a file or folder of another kind there is
#: refused before round 0 (it would stop the run at its first checkpoint or after its last
#: round, the results lost).
_RUN_FILES = (
    "results.json",
    "ledger.json",
    "metrics.csv",
    "baseline_metrics.csv",
    "accuracy.png",
    LOCK_FILE,
)
_RUN_FOLDERS = (
    "checkpoints",
    "checkpoints/run",
    "checkpoints/baseline",
    "checkpoints/final",
    "tensorboard",
)


def _check_layout(out: Path) -> None:
    """A :class:`RunFolderError` when ``out`` holds a folder where a run writes a file
    (``results.json``, ...) or something else than a folder where it writes one
    (``checkpoints``, ...)."""
    for name in _RUN_FILES:
        path = out / name
        if path.exists() and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file"
            raise RunFolderError(
                f"run folder error: {path} is {kind}, where the run writes a file; move it "
                "away, or write elsewhere (--output-dir)"
            )
    for name in _RUN_FOLDERS:
        path = out / name
        if path.exists() and not path.is_dir():
            raise RunFolderError(
                f"run folder error: {path} is a file, where the run writes a folder; move it "
                "away, or write elsewhere (--output-dir)"
            )


def run_folder_contents(out: str | Path) -> list[str]:
    """What in the folder ``out`` shows that a run wrote there: ``results.json`` and each
    ``checkpoints/<name>`` that holds a checkpoint (``run``, ``baseline``, ...), relative to
    ``out``; empty for a folder that holds no run (or does not exist)."""
    out = Path(out)
    found = ["results.json"] if (out / "results.json").is_file() else []
    folder = out / "checkpoints"
    if folder.is_dir():
        with suppress(OSError):
            found += sorted(
                f"checkpoints/{d.name}"
                for d in folder.iterdir()
                if d.is_dir() and has_checkpoint(d)
            )
    return found


def check_run_folder(out: str | Path, *, resume: bool, overwrite: bool) -> None:
    """The rules ``radbo run`` applies to its output folder ``out`` before round 0.

    ``resume``: ``out`` must hold a checkpoint of the run (``checkpoints/run``, or the final
    state of a run finished without ``checkpoint_every``, ``checkpoints/final``), else a
    :class:`CheckpointError` says so and how to start afresh. Otherwise, unless
    ``overwrite``, a folder that holds a run (:func:`run_folder_contents`) is refused with a
    :class:`ConfigError` naming it and the ways out. Always: a path the system refuses, and a
    folder where the run writes a file (``results.json``, ...) or a file where it writes a
    folder (``checkpoints``, ...), are a :class:`RunFolderError` naming it.
    """
    out = Path(out)
    _check_path(out)
    with path_errors(out, "config error: output_dir ="):
        _check_layout(out)
        found = run_folder_contents(out)
        resumable = has_checkpoint(out / "checkpoints" / "run") or has_checkpoint(
            out / "checkpoints" / "final"
        )
    if resume:
        if resumable:
            return
        if found:
            raise CheckpointError(
                f"nothing to resume in {out}: it holds a run ({', '.join(found)}) but no "
                "checkpoint of it in checkpoints/run; run with "
                "--overwrite instead of --resume to start it afresh"
            )
        raise CheckpointError(
            f"nothing to resume in {out}: it holds no checkpoint (checkpoints/run); run "
            "without --resume to start afresh, with checkpoint_every or --checkpoint-every N "
            "to be able to resume"
        )
    if found and not overwrite:
        raise ConfigError(
            f"{out} already holds a run ({', '.join(found)}); pass --overwrite to replace it, "
            "--resume to continue it, or --output-dir to write elsewhere"
        )


def _close(backend: Backend) -> None:
    """Stop what ``backend`` runs beside this process (a :class:`radbo.simulation.
    ProcessBackend`'s workers); backends without a ``close`` hold nothing to stop."""
    close = getattr(backend, "close", None)
    if callable(close):
        close()


def _last_evaluation(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The metrics of the last evaluated round among ``rows`` (``test_`` prefix removed)."""
    for row in reversed(rows):
        evaluation = {k[5:]: v for k, v in row.items() if k.startswith("test_")}
        if evaluation:
            return evaluation
    return {}


def _summary(result: RunResult) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "final": result.final,
        "totals": result.totals,
        "totals_by_tier": result.totals_by_tier,
    }
    if result.initial is not None:
        summary["initial"] = result.initial
    if result.resumed_from_fallback is not None:  # only when a resume fell back
        summary["resumed_from_fallback"] = result.resumed_from_fallback
    if result.stopped is not None:  # only for a run stopped early: its rounds so far
        summary["stopped"] = result.stopped
    return summary


def save_results(result: RunResult, out: Path) -> None:
    """``results.json`` (config, initial evaluation, final, totals, totals per tier, per-round
    metrics, baseline with its rounds, savings at equal rounds and at equal accuracy),
    ``ledger.json`` (one row per client, phase and round), ``metrics.csv`` (one row per round,
    :mod:`radbo.experiment.logs`; ``baseline_metrics.csv`` for the baseline) and
    ``accuracy.png``."""
    payload: dict[str, Any] = {
        "radbo_version": _version(),
        "config": result.config.model_dump(mode="json"),
        "overrides": result.overrides,
        **_summary(result),
        "rounds": result.rounds,
    }
    if result.baseline is not None:
        payload["baseline"] = {
            "config": result.baseline.config.model_dump(mode="json"),
            **_summary(result.baseline),
            "rounds": result.baseline.rounds,
        }
        payload["savings"] = result.savings
        payload["savings_at_accuracy"] = result.savings_at_accuracy
    atomic_write_text(out / "results.json", json_dumps(payload, indent=2))
    atomic_write_text(out / "ledger.json", json_dumps(result.ledger))
    for each, name in ((result, "metrics.csv"), (result.baseline, "baseline_metrics.csv")):
        if each is not None:
            clock = each.config.fleet.has_devices
            write_metrics_csv(out / name, each.rounds, initial=each.initial, clock=clock)
    from radbo.report import plot_accuracy

    plot_accuracy(
        result.rounds,
        out / "accuracy.png",
        title=f"{result.config.algorithm.name}",
        initial=result.initial,
        baseline=None if result.baseline is None else result.baseline.rounds,
        baseline_initial=None if result.baseline is None else result.baseline.initial,
    )


def _initial_evaluation(exp: Experiment) -> dict[str, float] | None:
    """The evaluation of ``exp``'s initial state (``test_`` keys; round 0 of the curves), or
    ``None`` without an evaluator. Evaluators are pure: the run's numbers do not change."""
    sim = exp.simulation
    if sim.evaluate is None:
        return None
    metrics = sim.evaluate(sim.algorithm.model_state(exp.initial_state))
    return {f"test_{k}": v for k, v in metrics.items()}


def _version() -> str:
    return __version__
