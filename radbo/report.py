"""Plots and comparisons of run results (matplotlib, Agg backend: no display needed).

:func:`plot_accuracy` draws one run's accuracy curve (``radbo run`` writes it as
``accuracy.png``, with the paired baseline's curve beside it). :func:`load_run` reads a finished
run folder and :func:`compare` compares several (``radbo report RUN_DIR ...``): test accuracy
against iterations (rounds), communication rounds, simulated time, bytes, FLOPs and energy (one
figure each, in PNG, PDF and/or SVG), a Markdown and a JSON summary of the final accuracy, the
totals (energy included), the savings against a paired baseline at equal rounds and at equal
accuracy, and the cost of every device tier.

**Curves.** Each curve starts at round 0, the evaluation of the initial state, when
``results.json`` has it (``initial``; runs written before radbo recorded it start at round 1);
a run with a paired baseline whose per-round records are in ``results.json``
(``baseline.rounds``) draws the baseline's curve beside its own, dashed. The y-axis is fitted to
the data drawn.

**Seeds.** Runs whose configs differ only by ``seed`` (and ``output_dir``,
``checkpoint_every``, ``[logging]``) form one group (:func:`group_runs`): one curve per group,
the mean over its seeds with a band of the 95 % confidence interval of the mean (Student's t
with n - 1 degrees of freedom, :func:`mean_ci95`), and mean ± CI in the tables. On the cost
axes a group's point of round r sits at the mean cost of round r over its seeds.

**No data, no line.** A run without device profiles has no simulated clock and no energy: it
draws no line against time or energy, its time shows ``-`` in the tables, and a plot that no
run has data for is not written (the report says once why). Energy is read where
``results.json`` has it (``energy_*`` totals, ``cost_energy_j`` per round); a run written
before radbo accounted energy shows ``-`` too. A total marked ``>=`` is partial: some FLOPs or
bytes ran on devices without energy figures (``energy_unpriced_flops`` /
``energy_unpriced_bytes`` > 0).

Only JSON is read: nothing in a run folder is unpickled or executed. A folder that is not a
finished run (no ``results.json``, malformed JSON, missing keys) raises :class:`ReportError`
with one line naming the file and the problem.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radbo.atomic import atomic_write, atomic_write_text
from radbo.jsonio import dumps as json_dumps

__all__ = [
    "FORMATS",
    "PLOTS",
    "ReportError",
    "ReportResult",
    "Run",
    "RunGroup",
    "compare",
    "fit_accuracy_limits",
    "group_runs",
    "load_run",
    "mean_ci95",
    "plot_accuracy",
    "plot_comparison",
    "run_labels",
]


class ReportError(ValueError):
    """A run folder cannot be read (missing, not JSON, missing keys) or the report cannot be
    written. The message is one line naming the file and the problem."""


#: Figure formats :func:`compare` writes (``radbo report --format``).
FORMATS = ("png", "pdf", "svg")
#: Metadata that would make two writes of one figure differ (dates) left out.
_METADATA: dict[str, dict[str, Any]] = {
    "png": {},
    "pdf": {"CreationDate": None},
    "svg": {"Date": None},
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig: Any, files: Sequence[tuple[Path, str]]) -> list[Path]:
    """Write ``fig`` to each ``(path, format)`` of ``files`` atomically
    (:func:`radbo.atomic.atomic_write`), then close it. Returns the paths."""
    plt = _pyplot()

    def writer(fmt: str) -> Callable[[Path], None]:
        def write(tmp: Path) -> None:
            fig.savefig(tmp, format=fmt, metadata=_METADATA[fmt], bbox_inches="tight")

        return write

    try:
        with plt.rc_context({"svg.hashsalt": "radbo"}):  # SVG ids the same on every write
            for path, fmt in files:
                atomic_write(path, writer(fmt))
    finally:
        plt.close(fig)
    return [path for path, _ in files]


def fit_accuracy_limits(values: Sequence[float]) -> tuple[float, float]:
    """The y-axis of an accuracy plot fitted to ``values`` (the points and band edges drawn):
    their range with 5 % of it added on each side (0.02 when all are equal), kept in [0, 1];
    (0, 1) without values.

    >>> [round(v, 6) for v in fit_accuracy_limits([0.7, 0.85, 0.9])]
    [0.69, 0.91]
    >>> fit_accuracy_limits([0.99, 1.0])
    (0.9895, 1.0)
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    pad = 0.05 * (high - low) if high > low else 0.02
    return max(0.0, low - pad), min(1.0, high + pad)


def _accuracy_points(
    rounds: Sequence[Mapping[str, Any]], initial: Mapping[str, Any] | None
) -> list[tuple[int, float]]:
    """(rounds completed, test accuracy) at every evaluation; (0, initial) first when given."""
    points = []
    if initial is not None and _is_number(initial.get("test_accuracy")):
        points.append((0, initial["test_accuracy"]))
    points += [
        (r["round"] + 1, r["test_accuracy"]) for r in rounds if _is_number(r.get("test_accuracy"))
    ]
    return points


def plot_accuracy(
    rounds: Sequence[dict[str, Any]],
    path: str | Path,
    *,
    title: str = "",
    initial: Mapping[str, Any] | None = None,
    baseline: Sequence[Mapping[str, Any]] | None = None,
    baseline_initial: Mapping[str, Any] | None = None,
) -> Path:
    """Test accuracy vs round as a PNG (written atomically); returns the path.

    ``rounds`` are ``results.json`` rows; ``initial`` (the evaluation before round 0) adds the
    point at round 0; ``baseline`` (the paired baseline's rows, with ``baseline_initial``) adds
    its curve, dashed. The y-axis is fitted to the data (:func:`fit_accuracy_limits`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    drawn: list[float] = []
    series = [(title or "run", _accuracy_points(rounds, initial), "-")]
    if baseline is not None:
        series.append(("full-model baseline", _accuracy_points(baseline, baseline_initial), "--"))
    for label, points, style in series:
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, marker="o", markersize=3, label=label)
            drawn += ys
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iterations (rounds)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(*fit_accuracy_limits(drawn))
    ax.grid(alpha=0.3)
    if baseline is not None and drawn:
        ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return _save_figure(fig, [(Path(path), "png")])[0]


# ---------------------------------------------------------------------------- reading runs

#: Keys every ``results.json`` must have, with the JSON type each must be.
_REQUIRED: dict[str, type] = {
    "config": dict,
    "final": dict,
    "totals": dict,
    "totals_by_tier": dict,
    "rounds": list,
}
#: Keys every element of ``rounds`` must have (numbers).
_ROUND_KEYS = ("round", "sim_clock_s", "cost_flops", "cost_bytes", "communication_rounds")
#: Keys of ``totals`` (and of each tier's totals) the report needs (numbers).
_TOTAL_KEYS = ("flops", "bytes", "bytes_down", "bytes_up", "compute_s", "comm_s")
_RUN_TOTAL_KEYS = (*_TOTAL_KEYS, "communication_rounds", "sim_time_s")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ReportError(f"report error: {path}: not UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise ReportError(f"report error: {path}: cannot read: {err.strerror or err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ReportError(
            f"report error: {path}: malformed JSON at line {err.lineno} column {err.colno}: "
            f"{err.msg}"
        ) from None
    except RecursionError:
        raise ReportError(f"report error: {path}: JSON nested too deeply") from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise ReportError(f"report error: {path}: unreadable JSON: {err}") from None


def _check_numbers(path: Path, where: str, data: Any, keys: Sequence[str]) -> None:
    if not isinstance(data, dict):
        raise ReportError(f"report error: {path}: {where} must be an object")
    for key in keys:
        if key not in data:
            raise ReportError(f"report error: {path}: {where} has no key {key!r}")
        if not _is_number(data[key]):
            raise ReportError(
                f"report error: {path}: {where}.{key} must be a number, got {data[key]!r}"
            )


def _validate(path: Path, data: Any) -> None:
    """Raise :class:`ReportError` unless ``data`` has what the report reads."""
    if not isinstance(data, dict):
        raise ReportError(f"report error: {path}: the top level must be a JSON object")
    for key, kind in _REQUIRED.items():
        if key not in data:
            raise ReportError(f"report error: {path}: missing required key {key!r}")
        if not isinstance(data[key], kind):
            expected = "an object" if kind is dict else "a list"
            raise ReportError(f"report error: {path}: {key!r} must be {expected}")
    _check_numbers(path, "totals", data["totals"], _RUN_TOTAL_KEYS)
    for tier, tier_totals in data["totals_by_tier"].items():
        _check_numbers(path, f"totals_by_tier[{tier!r}]", tier_totals, _TOTAL_KEYS)
    _check_rounds(path, "rounds", data["rounds"])
    _check_initial(path, "initial", data.get("initial"))
    algorithm = data["config"].get("algorithm")
    if not isinstance(algorithm, dict) or not isinstance(algorithm.get("name"), str):
        raise ReportError(f"report error: {path}: config.algorithm.name is missing")
    baseline = data.get("baseline")
    if baseline is not None:
        if not isinstance(baseline, dict):
            raise ReportError(f"report error: {path}: 'baseline' must be an object")
        for key in ("final", "totals", "totals_by_tier"):
            if not isinstance(baseline.get(key), dict):
                raise ReportError(f"report error: {path}: baseline has no object {key!r}")
        _check_numbers(path, "baseline.totals", baseline["totals"], _RUN_TOTAL_KEYS)
        if "rounds" in baseline:
            if not isinstance(baseline["rounds"], list):
                raise ReportError(f"report error: {path}: 'baseline.rounds' must be a list")
            _check_rounds(path, "baseline.rounds", baseline["rounds"])
        _check_initial(path, "baseline.initial", baseline.get("initial"))
    for key in ("savings", "savings_at_accuracy"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise ReportError(f"report error: {path}: {key!r} must be an object")


def _check_rounds(path: Path, where: str, rounds: list[Any]) -> None:
    for i, row in enumerate(rounds):
        _check_numbers(path, f"{where}[{i}]", row, _ROUND_KEYS)
        for key in ("test_accuracy", "test_loss"):  # null: undefined (a NaN written as null)
            if row.get(key) is not None and not _is_number(row[key]):
                raise ReportError(
                    f"report error: {path}: {where}[{i}].{key} must be a number or null, got "
                    f"{row[key]!r}"
                )


def _check_initial(path: Path, where: str, initial: Any) -> None:
    if initial is None:
        return
    if not isinstance(initial, dict):
        raise ReportError(f"report error: {path}: {where!r} must be an object")
    for key in ("test_accuracy", "test_loss"):
        if initial.get(key) is not None and not _is_number(initial[key]):
            raise ReportError(
                f"report error: {path}: {where}.{key} must be a number or null, got "
                f"{initial[key]!r}"
            )


#: ``[fleet]`` keys that give clients device profiles (and so a simulated clock)
_DEVICE_SOURCES = ("devices", "file", "trace")


@dataclass
class Run:
    """One finished run, as read from its folder by :func:`load_run`.

    Attributes:
        path: the run folder.
        results: the whole parsed ``results.json``.
        ledger: the parsed ``ledger.json`` rows, or ``None`` when the folder has none.
    """

    path: Path
    results: dict[str, Any]
    ledger: list[dict[str, Any]] | None = None

    @property
    def name(self) -> str:
        """The run folder's name."""
        return self.path.resolve().name or str(self.path)

    @property
    def algorithm(self) -> str:
        """``config.algorithm.name``."""
        return str(self.results["config"]["algorithm"]["name"])

    @property
    def config(self) -> dict[str, Any]:
        """The run's config (``results.json`` ``config``)."""
        return self.results["config"]

    @property
    def seed(self) -> Any:
        """``config.seed`` (``None`` when absent)."""
        return self.config.get("seed")

    @property
    def final(self) -> dict[str, float]:
        """The last evaluation (``test_accuracy``, ``test_loss``)."""
        return self.results["final"]

    @property
    def initial(self) -> dict[str, float] | None:
        """The evaluation before round 0 (``test_accuracy``, ...), or ``None`` for a run
        written before radbo recorded it."""
        return self.results.get("initial")

    @property
    def totals(self) -> dict[str, float]:
        """Run totals (FLOPs, bytes, simulated time, communication rounds, ...)."""
        return self.results["totals"]

    @property
    def totals_by_tier(self) -> dict[str, dict[str, float]]:
        """Totals per device tier."""
        return self.results["totals_by_tier"]

    @property
    def rounds(self) -> list[dict[str, Any]]:
        """Per-round records."""
        return self.results["rounds"]

    @property
    def baseline(self) -> dict[str, Any] | None:
        """The paired baseline's ``config``, ``final``, ``totals``, ``totals_by_tier`` (and
        ``rounds`` and ``initial`` where recorded), or None."""
        return self.results.get("baseline")

    @property
    def savings(self) -> dict[str, float] | None:
        """Compute, bytes and time as fractions of the baseline's, or None."""
        return self.results.get("savings")

    @property
    def savings_at_accuracy(self) -> dict[str, Any] | None:
        """What the run and its baseline spent to first reach the worse one's final accuracy
        (:func:`radbo.cost.savings_at_accuracy`), or None."""
        return self.results.get("savings_at_accuracy")

    @property
    def has_devices(self) -> bool:
        """Whether clients had device profiles (``[fleet]`` devices, file or trace), so a
        simulated clock; read from the data (a clock past 0) when the config does not say."""
        fleet = self.config.get("fleet")
        if isinstance(fleet, dict) and any(k in fleet for k in _DEVICE_SOURCES):
            return any(fleet.get(k) is not None for k in _DEVICE_SOURCES)
        return any(row["sim_clock_s"] > 0 for row in self.rounds)

    def baseline_run(self) -> Run | None:
        """The paired baseline as a :class:`Run` of its own (same folder), when
        ``results.json`` holds its per-round records; else None."""
        base = self.baseline
        if base is None or not isinstance(base.get("rounds"), list):
            return None
        results = {
            "config": base.get("config") if isinstance(base.get("config"), dict) else {},
            **{k: base[k] for k in ("final", "totals", "totals_by_tier", "rounds")},
        }
        if base.get("initial") is not None:
            results["initial"] = base["initial"]
        return Run(path=self.path, results=results)

    def curve(self, *, with_initial: bool = False) -> dict[str, list[Any]]:
        """Per round (all of them, in order): ``round`` (1-based: rounds completed),
        ``sim_clock_s`` (the virtual clock at the end of the round, already cumulative;
        ``None`` for a run without device profiles, which has no clock),
        ``cumulative_communication_rounds``, ``cumulative_flops`` and ``cumulative_bytes``
        (sums of ``communication_rounds`` / ``cost_flops`` / ``cost_bytes`` up to and including
        the round), ``cumulative_energy_j`` (sum of ``cost_energy_j``, joules; ``None`` from
        the first round without it, as in runs written before energy was accounted, and
        everywhere when the run priced no energy at all) and ``test_accuracy`` / ``test_loss``
        (``None`` on rounds not evaluated).

        ``with_initial``: put round 0 first, the initial evaluation at zero cost, when the run
        has one (:attr:`initial`)."""
        out: dict[str, list[Any]] = {
            "round": [],
            "sim_clock_s": [],
            "cumulative_communication_rounds": [],
            "cumulative_flops": [],
            "cumulative_bytes": [],
            "cumulative_energy_j": [],
            "test_accuracy": [],
            "test_loss": [],
        }
        clock = self.has_devices
        comm: float = 0
        flops: float = 0
        nbytes: float = 0
        energy: float | None = None if _energy(self.totals)["energy_j"] is None else 0
        initial = self.initial
        if with_initial and initial is not None and _is_number(initial.get("test_accuracy")):
            for key, value in (
                ("round", 0),
                ("sim_clock_s", 0.0 if clock else None),
                ("cumulative_communication_rounds", 0),
                ("cumulative_flops", 0),
                ("cumulative_bytes", 0),
                ("cumulative_energy_j", energy),
                ("test_accuracy", initial["test_accuracy"]),
                ("test_loss", initial.get("test_loss")),
            ):
                out[key].append(value)
        for row in self.rounds:
            comm += row["communication_rounds"]
            flops += row["cost_flops"]
            nbytes += row["cost_bytes"]
            step: Any = row.get("cost_energy_j")
            energy = energy + step if energy is not None and _is_number(step) else None
            out["round"].append(int(row["round"]) + 1)
            out["sim_clock_s"].append(row["sim_clock_s"] if clock else None)
            out["cumulative_communication_rounds"].append(comm)
            out["cumulative_flops"].append(flops)
            out["cumulative_bytes"].append(nbytes)
            out["cumulative_energy_j"].append(energy)
            out["test_accuracy"].append(row.get("test_accuracy"))
            out["test_loss"].append(row.get("test_loss"))
        return out


def load_run(path: str | Path) -> Run:
    """Read a run folder written by ``radbo run`` (``results.json``, and ``ledger.json`` when
    present). Only JSON is parsed.

    Raises:
        ReportError: the folder or ``results.json`` is missing, a file is not valid JSON, or
            ``results.json`` lacks a key the report needs (``config``, ``final``, ``totals``,
            ``totals_by_tier``, ``rounds``, and in each round ``round``, ``sim_clock_s``,
            ``cost_flops``, ``cost_bytes``, ``communication_rounds``).
    """
    folder = Path(path)
    if not folder.exists():
        raise ReportError(f"report error: {folder}: no such run folder")
    if not folder.is_dir():
        raise ReportError(f"report error: {folder}: not a folder (pass a `radbo run` output)")
    results_path = folder / "results.json"
    if not results_path.is_file():
        raise ReportError(
            f"report error: {results_path}: not found (is {folder} a `radbo run` output folder?)"
        )
    data = _read_json(results_path)
    _validate(results_path, data)
    ledger = None
    ledger_path = folder / "ledger.json"
    if ledger_path.is_file():
        rows = _read_json(ledger_path)
        if not isinstance(rows, list) or not all(
            isinstance(r, dict) and "client" in r and "tier" in r for r in rows
        ):
            raise ReportError(
                f"report error: {ledger_path}: must be a list of rows with 'client' and 'tier'"
            )
        ledger = rows
    return Run(path=folder, results=data, ledger=ledger)


# ---------------------------------------------------------------------------- seeds


def seed_folders(path: str | Path) -> list[Path]:
    """The run folders behind ``path``: ``path`` itself when it holds ``results.json``; the
    ``seed-<s>`` folders that ``radbo run --seeds`` writes (in seed order) when ``path`` is
    such an output folder; otherwise ``[path]`` (and :func:`load_run` says what is wrong)."""
    folder = Path(path)
    if (folder / "results.json").is_file() or not folder.is_dir():
        return [folder]
    seeds = []
    for child in folder.iterdir():
        suffix = child.name.removeprefix("seed-")
        if child.name.startswith("seed-") and suffix.lstrip("-").isdigit() and child.is_dir():
            seeds.append((int(suffix), child))
    return [child for _, child in sorted(seeds)] or [folder]


#: config keys that do not make runs different experiments: runs that differ only in these
#: are seeds of one group
_NOT_GROUPING = ("seed", "output_dir", "checkpoint_every", "logging")


def _group_key(run: Run) -> str:
    return json.dumps(
        {k: v for k, v in run.config.items() if k not in _NOT_GROUPING},
        sort_keys=True,
        allow_nan=True,
    )


def group_runs(runs: Sequence[Run]) -> list[list[int]]:
    """Indices of ``runs`` grouped by config: runs whose configs are equal except ``seed``
    (and ``output_dir``, ``checkpoint_every``, ``[logging]``) are one group, in the order of
    their first run. A group holds each seed once: a second run of a seed already in its
    group (the same run twice) starts a group of its own.

    >>> cfg = lambda seed, lr: {"seed": seed, "output_dir": f"o{seed}", "algorithm": {"lr": lr}}
    >>> runs = [Run(Path(f"r{i}"), {"config": cfg(s, lr)})
    ...         for i, (s, lr) in enumerate([(0, 1), (1, 1), (0, 2), (2, 1), (0, 1)])]
    >>> group_runs(runs)
    [[0, 1, 3], [2], [4]]
    """
    groups: list[tuple[str, list[int]]] = []
    for i, run in enumerate(runs):
        key = _group_key(run)
        for other_key, members in groups:
            if other_key == key and all(runs[j].seed != run.seed for j in members):
                members.append(i)
                break
        else:
            groups.append((key, [i]))
    return [members for _, members in groups]


def mean_ci95(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean of ``values`` and the half-width of its 95 % confidence interval,
    ``t(0.975, n - 1) * s / sqrt(n)`` with the sample standard deviation ``s`` (Student's t,
    :func:`scipy.stats.t.ppf`); the half-width is ``None`` for fewer than 2 values.

    >>> mean, half = mean_ci95([1.0, 2.0, 3.0])  # s = 1, t(0.975, 2) = 4.302652...
    >>> mean, round(half, 6)
    (2.0, 2.484138)
    >>> mean_ci95([0.5])
    (0.5, None)
    """
    if not values:
        raise ValueError("mean_ci95 needs at least one value")
    n = len(values)
    if n == 1:
        return values[0], None
    from scipy import stats  # type: ignore[import-untyped]

    mean = statistics.fmean(values)
    half = float(stats.t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return mean, half


@dataclass
class RunGroup:
    """Runs that differ only by seed (:func:`group_runs`), drawn as one curve.

    Attributes:
        label: the group's label in the plots and tables.
        runs: its runs, in the order given.
        labels: each run's own label (its tier table's title).
    """

    label: str
    runs: list[Run]
    labels: list[str]

    @property
    def n(self) -> int:
        """How many seeds (runs) the group holds."""
        return len(self.runs)

    @property
    def seeds(self) -> list[Any]:
        """The runs' seeds."""
        return [run.seed for run in self.runs]


# ---------------------------------------------------------------------------- comparing runs

#: File name (PNG; other formats change the suffix), x-axis key of :meth:`Run.curve`, x-axis
#: label and scale of each comparison plot.
PLOTS: dict[str, tuple[str, str, float]] = {
    "accuracy_vs_round.png": ("round", "iterations (rounds)", 1.0),
    "accuracy_vs_communication_rounds.png": (
        "cumulative_communication_rounds",
        "communication rounds",
        1.0,
    ),
    "accuracy_vs_time.png": ("sim_clock_s", "simulated time (s)", 1.0),
    "accuracy_vs_bytes.png": ("cumulative_bytes", "bytes sent and received (MB)", 1e-6),
    "accuracy_vs_flops.png": ("cumulative_flops", "compute (GFLOP)", 1e-9),
    "accuracy_vs_energy.png": ("cumulative_energy_j", "energy, compute + radio (J)", 1.0),
}

#: Energy keys of ``totals`` copied into the summary and tier rows (``None`` when absent).
_ENERGY_KEYS = (
    "energy_j",
    "energy_compute_j",
    "energy_radio_j",
    "energy_unpriced_flops",
    "energy_unpriced_bytes",
)


def _energy(totals: Mapping[str, Any]) -> dict[str, Any]:
    """The energy totals of ``totals``, each ``None`` when absent or not a number; joules are
    ``None`` too (unknown, not 0 J) when nothing was priced: 0 J with unpriced work."""
    out = {k: totals[k] if _is_number(totals.get(k)) else None for k in _ENERGY_KEYS}
    if out["energy_compute_j"] == 0 and out["energy_unpriced_flops"]:
        out["energy_compute_j"] = None
    if out["energy_radio_j"] == 0 and out["energy_unpriced_bytes"]:
        out["energy_radio_j"] = None
    if out["energy_compute_j"] is None and out["energy_radio_j"] is None:
        out["energy_j"] = None
    return out


def _partial(row: Mapping[str, Any]) -> bool:
    return bool(row["energy_unpriced_flops"] or row["energy_unpriced_bytes"])


def _energy_cell(row: Mapping[str, Any], spec: str = ".3g") -> str:
    """``row["energy_j"]`` formatted, ``>=`` in front when part of the work was unpriced."""
    text = _fmt(row["energy_j"], spec)
    if text != "-" and _partial(row):
        text = ">=" + text
    return text


@dataclass
class ReportResult:
    """What :func:`compare` wrote.

    Attributes:
        out_dir: the output folder.
        runs: the compared runs, in the order given.
        labels: the label of each run in the tables (its group's label, and its seed when the
            group holds several).
        summary: one row per run (the main table's numbers, unrounded).
        tiers: per run label, one row per device tier (from ``totals_by_tier``).
        plots: the figure files written (a plot no run has data for is not written).
        markdown: ``report.md``; ``json``: ``report.json``.
        table: the main table as Markdown (what ``radbo report`` prints).
        groups: the runs grouped by config (:func:`group_runs`), one curve and one table row
            each.
        notes: one line per plot not written or line not drawn, saying why.
    """

    out_dir: Path
    runs: list[Run]
    labels: list[str]
    summary: list[dict[str, Any]]
    tiers: dict[str, list[dict[str, Any]]]
    plots: list[Path]
    markdown: Path
    json: Path
    table: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    groups: list[RunGroup] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_labels(runs: Sequence[Run]) -> list[str]:
    """One distinct label per run: the algorithm names when they are all different, else the
    folder names when those are, else the paths as given (numbered if still equal)."""
    for candidates in (
        [r.algorithm for r in runs],
        [r.name for r in runs],
        [str(r.path) for r in runs],
    ):
        if len(set(candidates)) == len(candidates):
            return candidates
    return [f"{r.path} #{i + 1}" for i, r in enumerate(runs)]


def _group_name(runs: Sequence[Run]) -> str:
    """A group's name: its run's folder name; for several seeds the folder names' common
    start without a trailing "seed" (``a-seed0``, ``a-seed1`` -> ``a``), else their common
    parent folder's name (``out/seed-0``, ``out/seed-1`` -> ``out``)."""
    if len(runs) == 1:
        return runs[0].name
    prefix = os.path.commonprefix([r.name for r in runs])
    prefix = re.sub(r"[-_. ]*seed[-_. ]*$", "", prefix, flags=re.IGNORECASE).rstrip("-_. ")
    if prefix:
        return prefix
    parents = {r.path.resolve().parent for r in runs}
    if len(parents) == 1:
        return parents.pop().name or runs[0].name
    return runs[0].name


def _group_labels(groups: Sequence[Sequence[Run]]) -> list[str]:
    """One distinct label per group, as :func:`run_labels` gives runs: algorithm names, else
    group names (:func:`_group_name`), else paths, else numbered paths."""
    for candidates in (
        [g[0].algorithm for g in groups],
        [_group_name(g) for g in groups],
        [str(g[0].path) if len(g) == 1 else str(g[0].path.parent) for g in groups],
    ):
        if len(set(candidates)) == len(candidates):
            return candidates
    return [f"{g[0].path} #{i + 1}" for i, g in enumerate(groups)]


def _summary_row(run: Run, label: str) -> dict[str, Any]:
    totals = run.totals
    row: dict[str, Any] = {
        "label": label,
        "name": run.name,
        "path": str(run.path),
        "algorithm": run.algorithm,
        "seed": run.seed,
        "radbo_version": run.results.get("radbo_version"),
        "has_devices": run.has_devices,
        "initial_test_accuracy": (run.initial or {}).get("test_accuracy"),
        "final_test_accuracy": run.final.get("test_accuracy"),
        "final_test_loss": run.final.get("test_loss"),
        "rounds": len(run.rounds),
        "communication_rounds": totals["communication_rounds"],
        "flops": totals["flops"],
        "bytes": totals["bytes"],
        "bytes_down": totals["bytes_down"],
        "bytes_up": totals["bytes_up"],
        "sim_time_s": totals["sim_time_s"] if run.has_devices else None,
        **_energy(totals),
        "baseline_test_accuracy": None,
        "savings": run.savings,
        "savings_at_accuracy": run.savings_at_accuracy,
    }
    if run.baseline is not None:
        row["baseline_test_accuracy"] = run.baseline["final"].get("test_accuracy")
    return row


def _tier_rows(run: Run) -> list[dict[str, Any]]:
    clients: dict[str, set[Any]] = {}
    for entry in run.ledger or []:
        clients.setdefault(str(entry["tier"]), set()).add(entry["client"])
    rows = []
    run_j = _energy(run.totals)["energy_j"]
    for tier, t in run.totals_by_tier.items():
        energy = _energy(t)
        rows.append(
            {
                "tier": tier,
                "clients": len(clients[tier])
                if run.ledger is not None and tier in clients
                else None,
                "flops": t["flops"],
                "bytes": t["bytes"],
                "bytes_down": t["bytes_down"],
                "bytes_up": t["bytes_up"],
                "compute_s": t["compute_s"],
                "comm_s": t["comm_s"],
                **energy,
                "flops_share": t["flops"] / run.totals["flops"] if run.totals["flops"] else None,
                "bytes_share": t["bytes"] / run.totals["bytes"] if run.totals["bytes"] else None,
                "energy_share": (
                    energy["energy_j"] / run_j if energy["energy_j"] is not None and run_j else None
                ),
            }
        )
    return rows


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value * scale, spec)


def _valid(values: Sequence[Any]) -> list[float]:
    return [v for v in values if _is_number(v) and not math.isnan(v)]


def _stat(values: Sequence[Any]) -> dict[str, Any] | None:
    """Mean, 95 % CI half-width (:func:`mean_ci95`; ``None`` for one value), n and the values
    of the numbers among ``values``; ``None`` when there are none."""
    valid = _valid(values)
    if not valid:
        return None
    mean, half = mean_ci95(valid)
    return {"mean": mean, "ci95": half, "n": len(valid), "values": valid}


def _stat_cell(values: Sequence[Any], spec: str, scale: float = 1.0) -> str:
    """One value formatted as before grouping existed; several as ``mean ± CI``."""
    if len(values) == 1:
        return _fmt(values[0], spec, scale)
    stat = _stat(values)
    if stat is None:
        return "-"
    text = _fmt(stat["mean"], spec, scale)
    if stat["ci95"] is not None:
        text += " ± " + _fmt(stat["ci95"], spec, scale)
    return text


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    align = ["---" if i == 0 else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


#: savings fractions shown in the main table (at equal rounds) and the equal-accuracy table
_FRACTIONS = ("compute_fraction", "bytes_fraction", "time_fraction", "energy_fraction")


def _main_table(groups: Sequence[tuple[str, list[dict[str, Any]]]]) -> str:
    """One row per group (label, its runs' summary rows): one run's numbers as they are,
    several seeds' as mean ± 95 % CI."""
    seeds = any(len(rows) > 1 for _, rows in groups)
    header = ["run", "algorithm", *(["seeds"] if seeds else []), "final acc", "rounds"]
    header += ["comm rounds", "GFLOP", "MB", "sim time (s)", "energy (J)"]
    with_baseline = any(row["savings"] is not None for _, rows in groups for row in rows)
    if with_baseline:
        header += [
            "baseline acc",
            "compute vs base",
            "bytes vs base",
            "time vs base",
            "energy vs base",
        ]
    table = []
    for label, rows in groups:
        first = rows[0]

        def col(key: str, spec: str, scale: float = 1.0, rows: list = rows) -> str:
            return _stat_cell([r[key] for r in rows], spec, scale)

        rounds = {r["rounds"] for r in rows}
        energy = col("energy_j", ".3g")
        if energy != "-" and any(_partial(r) for r in rows):
            energy = ">=" + energy
        cells = [label, first["algorithm"], *([str(len(rows))] if seeds else [])]
        cells += [
            col("final_test_accuracy", ".4f"),
            str(first["rounds"]) if len(rounds) == 1 else col("rounds", ".1f"),
            col("communication_rounds", ".0f"),
            col("flops", ".3f", 1e-9),
            col("bytes", ".3f", 1e-6),
            col("sim_time_s", ".2f"),
            energy,
        ]
        if with_baseline:
            cells.append(col("baseline_test_accuracy", ".4f"))
            for key in _FRACTIONS:
                values = [(r["savings"] or {}).get(key) for r in rows]
                cells.append(_stat_cell(values, ".1%"))
        table.append(cells)
    return _markdown_table(header, table)


def _accuracy_savings_table(groups: Sequence[tuple[str, list[dict[str, Any]]]]) -> str | None:
    """Savings at equal accuracy, one row per group whose runs have them (``None`` when no
    run has): the target accuracy, the rounds each needed and the run's compute, bytes, time
    and energy as fractions of the baseline's; "not reached" when one of them never did."""
    header = ["run", "target acc", "rounds (run / base)", "compute vs base", "bytes vs base"]
    header += ["time vs base", "energy vs base"]
    table = []
    for label, rows in groups:
        found = [r["savings_at_accuracy"] for r in rows if r["savings_at_accuracy"] is not None]
        if len(found) != len(rows):
            continue
        unreached = [who for who in ("run", "baseline") if any(sv[who] is None for sv in found)]
        cells = [label, _stat_cell([sv["target_accuracy"] for sv in found], ".4f")]
        if unreached:
            cells.append(f"not reached by the {' and the '.join(unreached)}")
            cells += ["-"] * len(_FRACTIONS)
        else:
            mine = _stat_cell([sv["run"]["rounds"] for sv in found], ".0f")
            base = _stat_cell([sv["baseline"]["rounds"] for sv in found], ".0f")
            cells.append(f"{mine} / {base}")
            cells += [_stat_cell([sv[k] for sv in found], ".1%") for k in _FRACTIONS]
        table.append(cells)
    return _markdown_table(header, table) if table else None


def _tier_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = [
        "tier",
        "clients",
        "GFLOP",
        "MB down",
        "MB up",
        "compute (s)",
        "comm (s)",
        "energy (J)",
        "compute (J)",
        "radio (J)",
        "FLOP share",
        "bytes share",
        "energy share",
    ]
    cells = [
        [
            str(r["tier"]) or "-",
            "-" if r["clients"] is None else str(r["clients"]),
            _fmt(r["flops"], ".3f", 1e-9),
            _fmt(r["bytes_down"], ".3f", 1e-6),
            _fmt(r["bytes_up"], ".3f", 1e-6),
            _fmt(r["compute_s"], ".3f"),
            _fmt(r["comm_s"], ".3f"),
            _energy_cell(r),
            _fmt(r["energy_compute_j"], ".3g"),
            _fmt(r["energy_radio_j"], ".3g"),
            _fmt(r["flops_share"], ".1%"),
            _fmt(r["bytes_share"], ".1%"),
            _fmt(r["energy_share"], ".1%"),
        ]
        for r in rows
    ]
    return _markdown_table(header, cells)


# ---------------------------------------------------------------------------- figures


def _series(curves: Sequence[Mapping[str, list[Any]]], key: str, scale: float) -> dict[str, Any]:
    """The points of one curve (``x``, ``y``, ``ci95``: ``None`` for one run): a run's
    evaluations where the x-axis has a value; for several seeds, at the rounds every seed
    evaluated, the mean x, the mean accuracy and the half-width of its 95 % CI."""
    per_run = []
    for curve in curves:
        points = {}
        for r, x, acc in zip(curve["round"], curve[key], curve["test_accuracy"], strict=True):
            if x is not None and acc is not None:
                points[r] = (x * scale, acc)
        per_run.append(points)
    common = sorted(set.intersection(*(set(p) for p in per_run)))
    if len(per_run) == 1:
        return {
            "x": [per_run[0][r][0] for r in common],
            "y": [per_run[0][r][1] for r in common],
            "ci95": None,
        }
    xs, ys, cis = [], [], []
    for r in common:
        xs.append(statistics.fmean(p[r][0] for p in per_run))
        mean, half = mean_ci95([p[r][1] for p in per_run])
        ys.append(mean)
        cis.append(half)
    return {"x": xs, "y": ys, "ci95": cis}


_NO_DEVICES = "no device profiles ([fleet] devices, file or trace)"


def _no_data(run: Run, key: str) -> str:
    """Why ``run`` draws no line against ``key``."""
    if key == "sim_clock_s" and not run.has_devices:
        return f"{_NO_DEVICES}: no simulated clock"
    if key == "cumulative_energy_j":
        return f"{_NO_DEVICES}: no energy" if not run.has_devices else "no energy figures"
    return "no evaluation"


def _figure_data(groups: Sequence[RunGroup]) -> list[dict[str, Any]]:
    """What each plot of :data:`PLOTS` draws: per group its curve and, where every run of
    the group has its baseline's rounds, the baseline's; which groups draw no line and why;
    the fitted y-axis; ``drawn`` false when no group has a point (then the plot is not
    written, ``reason`` says why)."""
    figures = []
    for filename, (key, xlabel, scale) in PLOTS.items():
        series: list[dict[str, Any]] = []
        missing: dict[str, str] = {}
        for index, group in enumerate(groups):
            suffix = f" (n = {group.n})" if group.n > 1 else ""
            found = _series([r.curve(with_initial=True) for r in group.runs], key, scale)
            if not found["x"]:
                missing[group.label] = _no_data(group.runs[0], key)
                continue
            label = group.label + suffix
            series.append({"label": label, "group": index, "baseline": False, **found})
            bases = [r.baseline_run() for r in group.runs]
            if all(b is not None for b in bases):
                curves = [b.curve(with_initial=True) for b in bases if b is not None]
                base = _series(curves, key, scale)
                if base["x"]:
                    label = f"{group.label}: full-model baseline{suffix}"
                    series.append({"label": label, "group": index, "baseline": True, **base})
        drawn: list[float] = []
        for s in series:
            drawn += s["y"]
            if s["ci95"] is not None:
                drawn += [y + c for y, c in zip(s["y"], s["ci95"], strict=True) if c is not None]
                drawn += [y - c for y, c in zip(s["y"], s["ci95"], strict=True) if c is not None]
        reasons = sorted(set(missing.values()))
        reason = None
        if not series:
            reason = reasons[0] if len(reasons) == 1 else "; ".join(reasons)
            reason = f"no run has data ({reason})"
        figures.append(
            {
                "name": filename.removesuffix(".png"),
                "x": key,
                "xlabel": xlabel,
                "drawn": bool(series),
                "reason": reason,
                "missing": missing,
                "ylim": list(fit_accuracy_limits(drawn)),
                "series": series,
            }
        )
    return figures


def _notes(figures: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per plot not written and per line not drawn, saying why."""
    notes = []
    for fig in figures:
        if not fig["drawn"]:
            notes.append(f"{fig['name']}: not drawn: {fig['reason']}")
            continue
        for label, why in fig["missing"].items():
            notes.append(f"{fig['name']}: no line for {label}: {why}")
    return notes


def plot_comparison(
    groups: Sequence[RunGroup], out_dir: str | Path, *, formats: Sequence[str] = ("png",)
) -> list[Path]:
    """The comparison figures of :data:`PLOTS` in ``out_dir``, one file per format of
    ``formats`` (written atomically): test accuracy at every evaluation (round 0 first when
    the runs have it) against iterations, communication rounds, the simulated clock,
    cumulative MB, GFLOP and joules (compute + radio); one line per group, with a 95 % CI
    band for several seeds, and its baseline's dashed beside it where recorded. A group
    without data for an axis draws no line; a plot no group has data for is not written.
    Returns the paths written."""
    return _draw(_figure_data(groups), Path(out_dir), _formats(formats))


#: x-axes that count whole rounds (integer ticks)
_COUNTED = ("round", "cumulative_communication_rounds")


def _draw(figures: Sequence[Mapping[str, Any]], out: Path, formats: Sequence[str]) -> list[Path]:
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    paths = []
    for record in figures:
        if not record["drawn"]:
            continue
        fig, ax = plt.subplots(figsize=(6, 4), dpi=150)
        for s in record["series"]:
            color = colors[s["group"] % len(colors)]
            style = "--" if s["baseline"] else "-"
            ax.plot(s["x"], s["y"], style, color=color, marker="o", markersize=3, label=s["label"])
            if s["ci95"] is not None:
                low = [y - (c or 0) for y, c in zip(s["y"], s["ci95"], strict=True)]
                high = [y + (c or 0) for y, c in zip(s["y"], s["ci95"], strict=True)]
                alpha = 0.1 if s["baseline"] else 0.2
                ax.fill_between(s["x"], low, high, color=color, alpha=alpha, linewidth=0)
        if record["x"] in _COUNTED:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(record["xlabel"])
        ax.set_ylabel("test accuracy")
        ax.set_ylim(*record["ylim"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        files = [(out / f"{record['name']}.{fmt}", fmt) for fmt in formats]
        paths += _save_figure(fig, files)
    return paths


def _formats(formats: str | Sequence[str]) -> list[str]:
    """``"png,pdf"`` or ``["png", "pdf"]`` checked against :data:`FORMATS`, duplicates
    dropped, order kept."""
    items = formats.split(",") if isinstance(formats, str) else list(formats)
    out: list[str] = []
    for item in (str(i).strip().lower() for i in items):
        if item not in FORMATS:
            raise ReportError(
                f"report error: format {item!r} is not one radbo writes; choose from "
                f"{', '.join(FORMATS)} (e.g. --format png,pdf)"
            )
        if item not in out:
            out.append(item)
    if not out:
        raise ReportError(f"report error: no figure format given; choose from {', '.join(FORMATS)}")
    return out


def _markdown_image(name: str, formats: Sequence[str]) -> str:
    """The figure as an image (PNG, else SVG), or a link to its PDF."""
    for fmt in ("png", "svg"):
        if fmt in formats:
            return f"![{name}.{fmt}]({name}.{fmt})"
    return f"[{name}.pdf]({name}.pdf)"


def compare(
    runs: Sequence[Run | str | Path],
    out_dir: str | Path = "radbo-report",
    *,
    labels: Sequence[str] | None = None,
    formats: str | Sequence[str] = ("png",),
    group: bool = True,
) -> ReportResult:
    """Compare finished runs: write the figures of :data:`PLOTS` (those with data) in each of
    ``formats``, ``report.md`` and ``report.json`` to ``out_dir`` (created if needed; files
    written atomically).

    Args:
        runs: :class:`Run` objects or run folders (read with :func:`load_run`); the output
            folder of ``radbo run --seeds`` stands for its ``seed-<s>`` folders.
        out_dir: the output folder.
        labels: one label per run; default :func:`run_labels` (for groups of seeds, a label
            per group, see :func:`_group_labels`). With ``labels``, a group takes its first
            run's label.
        formats: figure formats among :data:`FORMATS`, a list or ``"png,pdf,svg"``.
        group: group runs that differ only by seed (:func:`group_runs`): one curve with a
            95 % CI band and one table row (mean ± CI) per group; ``False``: one per run.

    ``report.json`` holds, per run, the numbers of the main table unrounded and exactly as in
    its ``results.json`` (``initial``, ``final``, ``totals``, ``totals_by_tier``,
    ``baseline``, ``savings``, ``savings_at_accuracy`` copied whole), its per-tier rows and
    its curve (:meth:`Run.curve`); per group the mean, CI half-width, n and values of each
    number (``groups``); per figure what it draws (``figures``), the files written
    (``plots``) and why a plot or line is missing (``notes``).

    Raises:
        ReportError: a run folder cannot be read, a format or the labels are wrong, or the
            output cannot be written. Nothing is written then.
    """
    loaded = _load_runs(runs, labels)
    fmts = _formats(formats)
    indices, groups, names = _group(loaded, labels, group)
    out = Path(out_dir)
    summary = [_summary_row(run, label) for run, label in zip(loaded, names, strict=True)]
    tiers = {label: _tier_rows(run) for run, label in zip(loaded, names, strict=True)}
    grouped = [(grp.label, [summary[i] for i in g]) for g, grp in zip(indices, groups, strict=True)]
    table = _main_table(grouped)
    accuracy_table = _accuracy_savings_table(grouped)
    figures = _figure_data(groups)
    notes = _notes(figures)
    markdown = _report_markdown(
        loaded,
        names,
        several_seeds=any(len(g) > 1 for g in indices),
        table=table,
        accuracy_table=accuracy_table,
        tiers=tiers,
        figures=figures,
        notes=notes,
        fmts=fmts,
    )
    data = _report_data(loaded, summary, tiers, indices, groups, figures, notes, fmts)
    plots, md_path, json_path = _write_report(out, figures, fmts, markdown, data)
    return ReportResult(
        out_dir=out,
        runs=loaded,
        labels=names,
        summary=summary,
        tiers=tiers,
        plots=plots,
        markdown=md_path,
        json=json_path,
        table=table,
        data=data,
        groups=groups,
        notes=notes,
    )


def _load_runs(runs: Sequence[Run | str | Path], labels: Sequence[str] | None) -> list[Run]:
    """The runs :func:`compare` is given, folders read (a ``--seeds`` output folder stands for
    its ``seed-<s>`` folders); :class:`ReportError` when there are none or ``labels`` is not
    one distinct label per run."""
    loaded: list[Run] = []
    for r in runs:
        if isinstance(r, Run):
            loaded.append(r)
        else:
            loaded.extend(load_run(folder) for folder in seed_folders(r))
    if not loaded:
        raise ReportError("report error: no run folders given")
    if labels is not None and (len(labels) != len(loaded) or len(set(labels)) != len(labels)):
        raise ReportError(
            f"report error: need {len(loaded)} distinct labels, got {len(labels)}: {list(labels)}"
        )
    return loaded


def _group(
    loaded: Sequence[Run], labels: Sequence[str] | None, group: bool
) -> tuple[list[list[int]], list[RunGroup], list[str]]:
    """The groups of :func:`compare` (runs differing only by seed with ``group``, else one per
    run): each group's run indices, the groups, and one distinct label per run (``labels``
    when given, else the group's label, with the seed for a group of several; ``#i`` added
    when two would be equal)."""
    indices = group_runs(loaded) if group else [[i] for i in range(len(loaded))]
    members = [[loaded[i] for i in g] for g in indices]
    if labels is not None:
        group_labels = [labels[g[0]] for g in indices]
    else:
        group_labels = _group_labels(members)
    groups = []
    for g, label, runs_of in zip(indices, group_labels, members, strict=True):
        if labels is not None:
            own = [labels[i] for i in g]
        elif len(g) == 1:
            own = [label]
        else:
            own = [f"{label} (seed {r.seed})" for r in runs_of]
        groups.append(RunGroup(label=label, runs=runs_of, labels=own))
    names: list[str] = [""] * len(loaded)
    for g, grp in zip(indices, groups, strict=True):
        for i, mine in zip(g, grp.labels, strict=True):
            names[i] = mine
    if len(set(names)) != len(names):  # e.g. two groups of one seed each
        names = [f"{n} #{i + 1}" for i, n in enumerate(names)]
        for g, grp in zip(indices, groups, strict=True):
            grp.labels = [names[i] for i in g]
    return indices, groups, names


def _report_markdown(
    loaded: Sequence[Run],
    names: Sequence[str],
    *,
    several_seeds: bool,
    table: str,
    accuracy_table: str | None,
    tiers: Mapping[str, list[dict[str, Any]]],
    figures: Sequence[Mapping[str, Any]],
    notes: Sequence[str],
    fmts: Sequence[str],
) -> str:
    """The text of ``report.md``: the main table (with a note on the CI when a row is several
    seeds), the savings at equal accuracy, the cost per tier of each run, and the plots."""
    lines = ["# radbo report", "", table, ""]
    if several_seeds:
        lines += [
            "Rows of several seeds show mean ± the half-width of the 95 % confidence interval "
            "of the mean (Student's t, n - 1 degrees of freedom).",
            "",
        ]
    if accuracy_table is not None:
        lines += [
            "## Savings at equal accuracy",
            "",
            "What the run and its baseline each spent to first reach the final test accuracy "
            "of the worse of the two (the table above compares them at the last round).",
            "",
            accuracy_table,
            "",
        ]
    lines += ["## Cost per device tier", ""]
    for run, label in zip(loaded, names, strict=True):
        lines += [f"### {label}", "", f"`{run.path}`", "", _tier_table(tiers[label]), ""]
    lines += ["## Plots", ""]
    lines += [_markdown_image(f["name"], fmts) for f in figures if f["drawn"]]
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def _report_data(
    loaded: Sequence[Run],
    summary: Sequence[dict[str, Any]],
    tiers: Mapping[str, list[dict[str, Any]]],
    indices: Sequence[Sequence[int]],
    groups: Sequence[RunGroup],
    figures: list[dict[str, Any]],
    notes: list[str],
    fmts: Sequence[str],
) -> dict[str, Any]:
    """The content of ``report.json`` (see :func:`compare`): per run, per group, the files
    the figures are written to, the figures and the notes."""
    runs_json = []
    for run, row in zip(loaded, summary, strict=True):
        runs_json.append(
            {
                **row,
                "initial": run.initial,
                "final": run.final,
                "totals": run.totals,
                "totals_by_tier": run.totals_by_tier,
                "baseline": (
                    None
                    if run.baseline is None
                    else {k: run.baseline[k] for k in ("final", "totals", "totals_by_tier")}
                ),
                "tiers": tiers[row["label"]],
                "curve": run.curve(),
            }
        )
    groups_json = [
        {
            "label": grp.label,
            "runs": [summary[i]["label"] for i in g],
            "paths": [str(r.path) for r in grp.runs],
            "seeds": grp.seeds,
            "n": grp.n,
            "stats": _group_stats([summary[i] for i in g]),
        }
        for g, grp in zip(indices, groups, strict=True)
    ]
    written = [f"{f['name']}.{fmt}" for f in figures if f["drawn"] for fmt in fmts]
    return {
        "runs": runs_json,
        "groups": groups_json,
        "plots": written,
        "figures": figures,
        "notes": notes,
    }


def _write_report(
    out: Path,
    figures: Sequence[Mapping[str, Any]],
    fmts: Sequence[str],
    markdown: str,
    data: Mapping[str, Any],
) -> tuple[list[Path], Path, Path]:
    """Write the figures, ``report.md`` and ``report.json`` to ``out`` (made if missing, each
    file atomically); returns the figure paths and those of the two files. An ``OSError`` is
    one :class:`ReportError` line naming the file or folder."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        plots = _draw(figures, out, fmts)
        md_path, json_path = out / "report.md", out / "report.json"
        atomic_write_text(md_path, markdown)
        atomic_write_text(json_path, json_dumps(data, indent=2) + "\n")
    except OSError as err:
        where = err.filename or out
        raise ReportError(f"report error: {where}: cannot write: {err.strerror or err}") from None
    return plots, md_path, json_path


#: per-run numbers aggregated over a group's seeds in ``report.json``
_GROUP_STATS = (
    "initial_test_accuracy",
    "final_test_accuracy",
    "final_test_loss",
    "rounds",
    "communication_rounds",
    "flops",
    "bytes",
    "bytes_down",
    "bytes_up",
    "sim_time_s",
    "energy_j",
    "baseline_test_accuracy",
)


def _group_stats(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """:func:`_stat` of each number of :data:`_GROUP_STATS` and of the savings fractions
    (``savings.<fraction>``, ``savings_at_accuracy.<fraction>`` and ``.target_accuracy``)
    over a group's summary rows."""
    stats: dict[str, Any] = {key: _stat([r[key] for r in rows]) for key in _GROUP_STATS}
    for key in _FRACTIONS:
        stats[f"savings.{key}"] = _stat([(r["savings"] or {}).get(key) for r in rows])
        stats[f"savings_at_accuracy.{key}"] = _stat(
            [(r["savings_at_accuracy"] or {}).get(key) for r in rows]
        )
    stats["savings_at_accuracy.target_accuracy"] = _stat(
        [(r["savings_at_accuracy"] or {}).get("target_accuracy") for r in rows]
    )
    return stats
