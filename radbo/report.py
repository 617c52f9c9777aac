"""Plots and comparisons of run results (matplotlib, Agg backend: no display needed).

:func:`plot_accuracy` draws one run's accuracy curve (``radbo run`` writes it as
``accuracy.png``). :func:`load_run` reads a finished run folder and :func:`compare` compares
several (``radbo report RUN_DIR ...``): test accuracy against rounds, simulated time, bytes,
FLOPs and energy (one PNG each, one line per run), a Markdown and a JSON summary of the final
accuracy, the totals (energy included) and the savings against a paired baseline, and the cost
of every device tier.

Energy is read where ``results.json`` has it (``energy_*`` totals, ``cost_energy_j`` per round);
a run written before radbo accounted energy shows ``-`` in the tables and no line in the energy
plot. A total marked ``>=`` is partial: some FLOPs or bytes ran on devices without energy
figures (``energy_unpriced_flops`` / ``energy_unpriced_bytes`` > 0).

Only JSON is read: nothing in a run folder is unpickled or executed. A folder that is not a
finished run (no ``results.json``, malformed JSON, missing keys) raises :class:`ReportError`
with one line naming the file and the problem.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radbo.checkpoint import atomic_write, atomic_write_text

__all__ = [
    "PLOTS",
    "ReportError",
    "ReportResult",
    "Run",
    "compare",
    "load_run",
    "plot_accuracy",
    "plot_comparison",
]


class ReportError(ValueError):
    """A run folder cannot be read (missing, not JSON, missing keys) or the report cannot be
    written. The message is one line naming the file and the problem."""


def _save_png(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` atomically (:func:`radbo.checkpoint.atomic_write`)."""
    import matplotlib.pyplot as plt

    try:
        atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return Path(path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(rounds: Sequence[dict[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Test accuracy vs round as a PNG (written atomically). Returns the path."""
    plt = _pyplot()
    points = [(r["round"] + 1, r["test_accuracy"]) for r in rounds if "test_accuracy" in r]
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return _save_png(fig, Path(path))


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
    for i, row in enumerate(data["rounds"]):
        _check_numbers(path, f"rounds[{i}]", row, _ROUND_KEYS)
        for key in ("test_accuracy", "test_loss"):
            if key in row and not _is_number(row[key]):
                raise ReportError(
                    f"report error: {path}: rounds[{i}].{key} must be a number, got {row[key]!r}"
                )
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
    savings = data.get("savings")
    if savings is not None and not isinstance(savings, dict):
        raise ReportError(f"report error: {path}: 'savings' must be an object")


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
    def final(self) -> dict[str, float]:
        """The last evaluation (``test_accuracy``, ``test_loss``)."""
        return self.results["final"]

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
        """The paired baseline's ``config``, ``final``, ``totals``, ``totals_by_tier``, or None."""
        return self.results.get("baseline")

    @property
    def savings(self) -> dict[str, float] | None:
        """Compute, bytes and time as fractions of the baseline's, or None."""
        return self.results.get("savings")

    def curve(self) -> dict[str, list[Any]]:
        """Per round (all of them, in order): ``round`` (1-based), ``sim_clock_s`` (the virtual
        clock at the end of the round, already cumulative), ``cumulative_flops`` and
        ``cumulative_bytes`` (sums of ``cost_flops`` / ``cost_bytes`` up to and including the
        round), ``cumulative_energy_j`` (sum of ``cost_energy_j``, joules; ``None`` from the
        first round without it, as in runs written before energy was accounted, and everywhere
        when the run priced no energy at all) and
        ``test_accuracy`` / ``test_loss`` (``None`` on rounds not evaluated)."""
        out: dict[str, list[Any]] = {
            "round": [],
            "sim_clock_s": [],
            "cumulative_flops": [],
            "cumulative_bytes": [],
            "cumulative_energy_j": [],
            "test_accuracy": [],
            "test_loss": [],
        }
        flops: float = 0
        nbytes: float = 0
        energy: float | None = None if _energy(self.totals)["energy_j"] is None else 0
        for row in self.rounds:
            flops += row["cost_flops"]
            nbytes += row["cost_bytes"]
            step: Any = row.get("cost_energy_j")
            energy = energy + step if energy is not None and _is_number(step) else None
            out["round"].append(int(row["round"]) + 1)
            out["sim_clock_s"].append(row["sim_clock_s"])
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


# ---------------------------------------------------------------------------- comparing runs

#: File name, x-axis key of :meth:`Run.curve`, x-axis label and scale of each comparison plot.
PLOTS: dict[str, tuple[str, str, float]] = {
    "accuracy_vs_round.png": ("round", "round", 1.0),
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


def _energy_cell(row: Mapping[str, Any], spec: str = ".3g") -> str:
    """``row["energy_j"]`` formatted, ``>=`` in front when part of the work was unpriced."""
    text = _fmt(row["energy_j"], spec)
    if text != "-" and (row["energy_unpriced_flops"] or row["energy_unpriced_bytes"]):
        text = ">=" + text
    return text


@dataclass
class ReportResult:
    """What :func:`compare` wrote.

    Attributes:
        out_dir: the output folder.
        runs: the compared runs, in the order given.
        labels: the label of each run in the plots and tables.
        summary: one row per run (the main table's numbers, unrounded).
        tiers: per run label, one row per device tier (from ``totals_by_tier``).
        plots: the PNG files written.
        markdown: ``report.md``; ``json``: ``report.json``.
        table: the main table as Markdown (what ``radbo report`` prints).
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


def _summary_row(run: Run, label: str) -> dict[str, Any]:
    totals = run.totals
    row: dict[str, Any] = {
        "label": label,
        "name": run.name,
        "path": str(run.path),
        "algorithm": run.algorithm,
        "radbo_version": run.results.get("radbo_version"),
        "final_test_accuracy": run.final.get("test_accuracy"),
        "final_test_loss": run.final.get("test_loss"),
        "rounds": len(run.rounds),
        "communication_rounds": totals["communication_rounds"],
        "flops": totals["flops"],
        "bytes": totals["bytes"],
        "bytes_down": totals["bytes_down"],
        "bytes_up": totals["bytes_up"],
        "sim_time_s": totals["sim_time_s"],
        **_energy(totals),
        "baseline_test_accuracy": None,
        "savings": run.savings,
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


def _markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    align = ["---" if i == 0 else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _main_table(summary: Sequence[Mapping[str, Any]]) -> str:
    header = [
        "run",
        "algorithm",
        "final acc",
        "rounds",
        "comm rounds",
        "GFLOP",
        "MB",
        "sim time (s)",
        "energy (J)",
    ]
    with_baseline = any(row["savings"] is not None for row in summary)
    if with_baseline:
        header += [
            "baseline acc",
            "compute vs base",
            "bytes vs base",
            "time vs base",
            "energy vs base",
        ]
    rows = []
    for row in summary:
        cells = [
            row["label"],
            row["algorithm"],
            _fmt(row["final_test_accuracy"], ".4f"),
            str(row["rounds"]),
            _fmt(row["communication_rounds"], ".0f"),
            _fmt(row["flops"], ".3f", 1e-9),
            _fmt(row["bytes"], ".3f", 1e-6),
            _fmt(row["sim_time_s"], ".2f"),
            _energy_cell(row),
        ]
        if with_baseline:
            sv = row["savings"] or {}
            cells += [
                _fmt(row["baseline_test_accuracy"], ".4f"),
                _fmt(sv.get("compute_fraction"), ".1%"),
                _fmt(sv.get("bytes_fraction"), ".1%"),
                _fmt(sv.get("time_fraction"), ".1%"),
                _fmt(sv.get("energy_fraction"), ".1%"),
            ]
        rows.append(cells)
    return _markdown_table(header, rows)


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


def plot_comparison(runs: Sequence[Run], labels: Sequence[str], out_dir: str | Path) -> list[Path]:
    """The comparison PNGs of :data:`PLOTS` in ``out_dir`` (written atomically): test
    accuracy at every evaluated round against the round, the simulated clock, cumulative MB,
    cumulative GFLOP and cumulative joules (compute + radio), one line per run (a run without
    energy figures draws no line in the energy plot). Returns the paths."""
    plt = _pyplot()
    curves = [run.curve() for run in runs]
    paths = []
    for filename, (key, xlabel, scale) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
        for curve, label in zip(curves, labels, strict=True):
            points = [
                (x * scale, acc)
                for x, acc in zip(curve[key], curve["test_accuracy"], strict=True)
                if acc is not None and x is not None
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no legend for a plot without lines
            ax.legend(fontsize="small")
        fig.tight_layout()
        paths.append(_save_png(fig, Path(out_dir) / filename))
    return paths


def compare(
    runs: Sequence[Run | str | Path],
    out_dir: str | Path = "radbo-report",
    *,
    labels: Sequence[str] | None = None,
) -> ReportResult:
    """Compare finished runs: write the plots of :data:`PLOTS`, ``report.md`` and
    ``report.json`` to ``out_dir`` (created if needed; files written atomically).

    Args:
        runs: :class:`Run` objects or run folders (read with :func:`load_run`).
        out_dir: the output folder.
        labels: one label per run; default :func:`run_labels`.

    ``report.json`` holds, per run, the numbers of the main table unrounded and exactly as in
    its ``results.json`` (``final``, ``totals``, ``totals_by_tier``, ``baseline``, ``savings``
    copied whole), its per-tier rows and its curve (:meth:`Run.curve`).

    Raises:
        ReportError: a run folder cannot be read, or the output cannot be written.
    """
    loaded = [r if isinstance(r, Run) else load_run(r) for r in runs]
    if not loaded:
        raise ReportError("report error: no run folders given")
    names = list(labels) if labels is not None else run_labels(loaded)
    if len(names) != len(loaded) or len(set(names)) != len(names):
        raise ReportError(
            f"report error: need {len(loaded)} distinct labels, got {len(names)}: {names}"
        )
    out = Path(out_dir)
    summary = [_summary_row(run, label) for run, label in zip(loaded, names, strict=True)]
    tiers = {label: _tier_rows(run) for run, label in zip(loaded, names, strict=True)}
    table = _main_table(summary)

    lines = ["# radbo report", "", table, "", "## Cost per device tier", ""]
    for run, label in zip(loaded, names, strict=True):
        lines += [f"### {label}", "", f"`{run.path}`", "", _tier_table(tiers[label]), ""]
    lines += ["## Plots", ""]
    lines += [f"![{name}]({name})" for name in PLOTS]
    markdown = "\n".join(lines) + "\n"

    runs_json = []
    for run, row in zip(loaded, summary, strict=True):
        runs_json.append(
            {
                **row,
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
    data = {"runs": runs_json, "plots": list(PLOTS)}

    try:
        out.mkdir(parents=True, exist_ok=True)
        plots = plot_comparison(loaded, names, out)
        md_path, json_path = out / "report.md", out / "report.json"
        atomic_write_text(md_path, markdown)
        atomic_write_text(json_path, json.dumps(data, indent=2, allow_nan=True) + "\n")
    except OSError as err:
        where = err.filename or out
        raise ReportError(f"report error: {where}: cannot write: {err.strerror or err}") from None
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
    )
