"""One config run under several seeds, and the mean and 95 % confidence interval of its
results over them (``radbo run CONFIG --seeds 0 1 2``; :func:`run_seeds` in Python).

``OUTPUT`` (``--output-dir``, else the config's ``output_dir``) then holds::

    OUTPUT/seed-0/          a plain run folder, as radbo run --seed 0 --output-dir OUTPUT/seed-0
    OUTPUT/seed-1/          writes it (results.json, ledger.json, accuracy.png, ...)
    ...
    OUTPUT/aggregate.json   per metric: mean, 95 % interval half-width, std, n, per-seed values
    OUTPUT/aggregate.md     the same as a table

The runs differ only in ``seed``: each ``results.json`` holds the same config but for it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radbo.atomic import atomic_write_text
from radbo.client import Backend
from radbo.config import ConfigError, RunConfig
from radbo.experiment.runner import (
    RunResult,
    check_run_folder,
    run,
    run_folder_contents,
)
from radbo.jsonio import dumps as json_dumps
from radbo.report import mean_ci95
from radbo.version import __version__

__all__ = [
    "AGGREGATE_JSON",
    "AGGREGATE_MD",
    "SeedsResult",
    "aggregate_runs",
    "aggregate_table",
    "check_seeds",
    "run_seeds",
    "seed_folder",
    "write_aggregate",
]

AGGREGATE_JSON = "aggregate.json"
AGGREGATE_MD = "aggregate.md"
LEVEL = 0.95
_MAX_SEED = 2**63 - 1

# the totals aggregate.md shows (aggregate.json has every total)
_SHOWN_TOTALS = ("communication_rounds", "flops", "bytes", "sim_time_s", "energy_j")


@dataclass
class SeedsResult:
    """Outcome of :func:`run_seeds`.

    Attributes:
        seeds: the seeds, in the order run.
        runs: each seed's :class:`RunResult`.
        aggregate: what ``aggregate.json`` holds (:func:`aggregate_runs`).
        output_dir: the folder of ``aggregate.json`` (``None`` when not saved).
    """

    seeds: list[int]
    runs: list[RunResult]
    aggregate: dict[str, Any]
    output_dir: Path | None = None


def seed_folder(output_dir: str | Path, seed: int) -> Path:
    """The run folder of ``seed`` in a multi-seed output folder: ``OUTPUT/seed-<seed>``."""
    return Path(output_dir) / f"seed-{seed}"


def _summary(values: list[float]) -> dict[str, Any]:
    """Mean, CI half-width, std and ``n`` of the finite ``values`` (a fraction that is 0 / 0
    for a seed, NaN, is left out: ``None`` when every one is), and every value."""
    known = [v for v in values if math.isfinite(v)]
    mean, half = mean_ci95(known) if known else (None, None)  # Student's t, as radbo report
    return {
        "mean": mean,
        "ci95": half,
        "std": statistics.stdev(known) if len(known) > 1 else None,
        "n": len(known),
        "values": values,
    }


def _numbers(mappings: list[dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
    """Per key that every mapping holds as a number: the summary of its values."""
    if not mappings or any(m is None for m in mappings):
        return {}
    first = mappings[0] or {}
    out = {}
    for key in first:
        values = [m.get(key) for m in mappings if m is not None]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if len(numbers) == len(values):
            out[key] = _summary([float(v) for v in numbers])
    return out


def aggregate_runs(
    results: Sequence[RunResult], seeds: Sequence[int], *, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """What ``aggregate.json`` holds for ``results``, the runs of one config under ``seeds``:
    per final metric (``final``), run total (``totals``), baseline final metric
    (``baseline_final``) and savings fraction (``savings``), the mean, the half-width of
    the 95 % confidence interval of the mean (``ci95``, Student's t; ``None`` for one seed),
    the standard deviation, ``n`` and the per-seed values, in the order of ``seeds``. A
    value that is undefined for a seed (NaN: a savings fraction of 0 / 0 when no client was
    ever available) counts in none of the figures, ``n`` included, and is ``null`` among the
    values of ``aggregate.json``; the figures are ``None`` when it is so for every seed."""
    config = results[0].config.model_dump(mode="json")
    config.pop("seed", None)
    return {
        "radbo_version": __version__,
        "seeds": list(seeds),
        "runs": {str(s): seed_folder(".", s).name for s in seeds},
        "level": LEVEL,
        "interval": "Student's t, n - 1 degrees of freedom",
        "config": config,
        "overrides": list(overrides),
        "final": _numbers([r.final for r in results]),
        "totals": _numbers([r.totals for r in results]),
        "baseline_final": _numbers([r.baseline.final if r.baseline else None for r in results]),
        "savings": _numbers([r.savings for r in results]),
    }


def _figure(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if math.isfinite(value) else "-"


def aggregate_table(aggregate: dict[str, Any]) -> list[str]:
    """The rows of ``aggregate.md``'s table (markdown): final metrics, the main totals (those
    not zero in every run), the baseline's final metrics and the savings, as mean ± 95 %
    interval half-width."""
    seeds = ", ".join(str(s) for s in aggregate["seeds"])
    lines = [
        f"| metric | mean ± 95 % CI | n | per seed ({seeds}) |",
        "|---|---|---|---|",
    ]
    sections = (
        ("final", "", None),
        ("totals", "", _SHOWN_TOTALS),
        ("baseline_final", "baseline ", None),
        ("savings", "savings ", None),
    )
    for section, prefix, keys in sections:
        rows = aggregate[section]
        for key in rows if keys is None else [k for k in keys if k in rows]:
            row = rows[key]
            if keys is not None and not any(row["values"]):
                continue  # a total the run does not count (no devices: no time, no energy)
            spread = "" if row["ci95"] is None else f" ± {_figure(row['ci95'])}"
            values = ", ".join(_figure(v) for v in row["values"])
            lines.append(
                f"| {prefix}{key} | {_figure(row['mean'])}{spread} | {row['n']} | {values} |"
            )
    return lines


def _markdown(aggregate: dict[str, Any]) -> str:
    n = len(aggregate["seeds"])
    algorithm = aggregate["config"].get("algorithm", {}).get("name", "?")
    overrides = aggregate["overrides"]
    said = f"; overrides: {' '.join(f'`{o}`' for o in overrides)}" if overrides else ""
    return "\n".join(
        [
            f"# {algorithm}, {aggregate['config'].get('rounds')} rounds, {n} seeds",
            "",
            f"Seeds {', '.join(str(s) for s in aggregate['seeds'])} (run folders "
            f"`seed-<seed>/`){said}. Each figure is the mean over the n seeds ± the half-width "
            "of the 95 % confidence interval of the mean (Student's t, n - 1 degrees of "
            "freedom; none for n = 1).",
            "",
            *aggregate_table(aggregate),
            "",
        ]
    )


def write_aggregate(aggregate: dict[str, Any], output_dir: str | Path) -> tuple[Path, Path]:
    """Write ``aggregate.json`` and ``aggregate.md`` to ``output_dir`` (atomically)."""
    out = Path(output_dir)
    paths = (out / AGGREGATE_JSON, out / AGGREGATE_MD)
    atomic_write_text(paths[0], json_dumps(aggregate, indent=2))
    atomic_write_text(paths[1], _markdown(aggregate))
    return paths


def check_seeds(seeds: Sequence[int]) -> list[int]:
    """``seeds`` as a list, or a :class:`ConfigError` for none, a repeated seed or one that
    is not an integer in [0, 2^63 - 1]."""
    seeds = list(seeds)
    if not seeds:
        raise ConfigError("config error: seeds = []: give at least one seed")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
            raise ConfigError(
                f"config error: seed = {seed!r}: a seed is an integer in [0, 2^63 - 1]"
            )
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ConfigError(
            f"config error: seeds = {seeds}: seed {repeated[0]} is given more than once"
        )
    return seeds


def run_seeds(
    config: RunConfig,
    seeds: Sequence[int],
    *,
    progress: bool = True,
    output_dir: str | Path | None = None,
    save: bool = True,
    resume: bool = False,
    overwrite: bool = True,
    overrides: Sequence[str] = (),
    backend_factory: Callable[[RunConfig], Backend] | None = None,
    on_result: Callable[[int, RunResult], None] | None = None,
) -> SeedsResult:
    """Run ``config`` once per seed of ``seeds`` (its ``seed`` replaced), each into its own
    run folder ``OUTPUT/seed-<seed>`` (:func:`seed_folder`; ``OUTPUT`` = ``output_dir``,
    default ``config.output_dir``), then write ``OUTPUT/aggregate.json`` and
    ``OUTPUT/aggregate.md`` (:func:`aggregate_runs`). ``on_result(seed, result)`` is called
    after each run.

    Every folder is checked before the first run (:func:`radbo.experiment.check_run_folder`):
    with ``overwrite=False`` a seed folder that holds a run, or an ``aggregate.json``, is
    refused. With ``resume`` a seed folder with checkpoints continues from them and one that
    holds nothing yet starts afresh (the seeds after an interrupted one); one that holds a
    run without checkpoints is refused. Other arguments: as :func:`radbo.run`.
    """
    seeds = check_seeds(seeds)
    out = Path(output_dir if output_dir is not None else config.output_dir)
    writes = save or config.checkpoint_every is not None
    resumes = {}
    for seed in seeds:
        folder = seed_folder(out, seed)
        resumes[seed] = resume and bool(run_folder_contents(folder))
        check_run_folder(folder, resume=resumes[seed], overwrite=overwrite or not writes)
    aggregate_file = out / AGGREGATE_JSON
    if writes and not (overwrite or resume) and aggregate_file.is_file():
        raise ConfigError(
            f"{out} already holds runs of several seeds ({AGGREGATE_JSON}); pass --overwrite "
            "to replace them, --resume to continue them, or --output-dir to write elsewhere"
        )
    results = []
    for seed in seeds:
        result = run(
            config.model_copy(update={"seed": seed}),
            progress=progress,
            output_dir=seed_folder(out, seed),
            save=save,
            resume=resumes[seed],
            overwrite=True,  # checked above
            overrides=overrides,
            backend_factory=backend_factory,
        )
        results.append(result)
        if on_result is not None:
            on_result(seed, result)
    aggregate = aggregate_runs(results, seeds, overrides=overrides)
    if save:
        write_aggregate(aggregate, out)
    return SeedsResult(seeds, results, aggregate, out if save else None)
