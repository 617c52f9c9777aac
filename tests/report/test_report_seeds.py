"""``radbo report`` over several seeds of one config (issue 27): runs that differ only by seed
form one group, drawn as one curve with a 95 % confidence band and shown as mean ± CI in the
tables (Student's t, n - 1 degrees of freedom)."""

import json
import math
from pathlib import Path

import pytest

from radbo.cli import main
from radbo.report import Run, compare, fit_accuracy_limits, group_runs, mean_ci95
from tests.report.test_report_plots import make_results, write_run

#: t_{0.975, 2}, the 97.5 % quantile of Student's t with 2 degrees of freedom (tables: 4.303),
#: in closed form: for 2 degrees of freedom t_p = (2p - 1) sqrt(2 / (4 p (1 - p)))
T_975_2 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))
#: t_{0.975, 1} (12.706): for 1 degree of freedom (Cauchy) t_p = tan(pi (p - 1/2))
T_975_1 = math.tan(math.pi * 0.475)


def test_mean_ci95_is_the_t_interval_of_the_mean() -> None:
    # s = 1 for (1, 2, 3): half-width t_{0.975,2} / sqrt(3). Float64 on three numbers: a few
    # roundings of 1e-16 each, so 1e-12 is far above them.
    mean, half = mean_ci95([1.0, 2.0, 3.0])
    assert mean == 2.0
    assert half == pytest.approx(T_975_2 / math.sqrt(3), rel=1e-12)
    # n = 2: s of (0, 1) = sqrt(1/2)
    _, half2 = mean_ci95([0.0, 1.0])
    assert half2 == pytest.approx(T_975_1 * math.sqrt(0.5) / math.sqrt(2), rel=1e-12)
    assert mean_ci95([0.25]) == (0.25, None)


def _run(seed: int, lr: float = 0.1, output: str | None = None) -> Run:
    results = make_results([0.5], seed=seed, lr=lr)
    if output is not None:
        results["config"]["output_dir"] = output
    return Run(path=Path(f"r{seed}"), results=results)


def test_runs_differing_only_by_seed_and_output_dir_are_one_group() -> None:
    runs = [
        _run(0),
        _run(1, output="elsewhere"),
        _run(0, lr=0.2),  # another config
        _run(2),
        _run(0),  # seed 0 again: the same run twice is not two seeds
    ]

    assert group_runs(runs) == [[0, 1, 3], [2], [4]]


@pytest.fixture
def seeds(tmp_path: Path) -> list[Path]:
    """out/seed-<s> for three seeds: final accuracy 0.7, 0.8, 0.9; each seed's FLOPs differ."""
    return [
        write_run(
            tmp_path / "out" / f"seed-{s}",
            make_results([0.4 + 0.1 * s, 0.7 + 0.1 * s], seed=s, flops=10 * (s + 1)),
        )
        for s in range(3)
    ]


def test_report_groups_seeds_with_mean_and_ci_in_tables_and_plots(
    seeds: list[Path], tmp_path: Path
) -> None:
    # Act
    report = compare(seeds, tmp_path / "report")

    # Assert: one group (labelled by its algorithm, as one run would be), three seeds
    (group,) = report.data["groups"]
    assert group["label"] == "rabo" and group["n"] == 3 and group["seeds"] == [0, 1, 2]
    assert report.labels == ["rabo (seed 0)", "rabo (seed 1)", "rabo (seed 2)"]
    stat = group["stats"]["final_test_accuracy"]
    assert stat["mean"] == pytest.approx(0.8, abs=1e-12)
    assert stat["ci95"] == pytest.approx(T_975_2 * 0.1 / math.sqrt(3), rel=1e-9)
    finals = [json.loads((f / "results.json").read_text())["final"]["test_accuracy"] for f in seeds]
    assert stat["values"] == finals  # as in each results.json, unrounded

    # the table: one row, a seeds column, mean ± CI
    header, _, cells = (
        [c.strip() for c in line.strip("|").split("|")] for line in report.table.splitlines()
    )
    assert cells[header.index("seeds")] == "3"
    assert cells[header.index("final acc")] == "0.8000 ± 0.2484"
    # GFLOP: 20, 40, 60 FLOPs -> mean 4e-8 GFLOP, shown to 3 decimals
    assert cells[header.index("GFLOP")] == "0.000 ± 0.000"
    assert "95 % confidence interval" in report.markdown.read_text()

    # the plot: one curve, the mean per round, a band of the CI
    (series,) = next(f for f in report.data["figures"] if f["name"] == "accuracy_vs_round")[
        "series"
    ]
    assert series["label"] == "rabo (n = 3)"
    assert series["x"] == [1, 2]
    assert series["y"] == pytest.approx([0.5, 0.8], abs=1e-12)
    assert series["ci95"] == pytest.approx([T_975_2 * 0.1 / math.sqrt(3)] * 2, rel=1e-9)
    # on a cost axis a round sits at the seeds' mean cost: FLOPs 10, 20, 30 per round
    (flops,) = next(f for f in report.data["figures"] if f["name"] == "accuracy_vs_flops")["series"]
    assert flops["x"] == pytest.approx([20e-9, 40e-9], rel=1e-12)
    # the fitted y-axis holds the band (its upper edge, 1.048, is kept at accuracy 1)
    low, high = next(f for f in report.data["figures"] if f["name"] == "accuracy_vs_round")["ylim"]
    edges = [
        y + sign * c for y, c in zip(series["y"], series["ci95"], strict=True) for sign in (-1, 1)
    ]
    assert (low, high) == fit_accuracy_limits([*series["y"], *edges])
    assert low < 0.5 - series["ci95"][0] and high == 1.0


def test_no_group_keeps_one_row_and_curve_per_run(seeds: list[Path], tmp_path: Path) -> None:
    report = compare(seeds, tmp_path / "report", group=False)

    assert len(report.data["groups"]) == 3
    assert report.table.splitlines()[0].startswith("| run | algorithm | final acc |")  # no seeds
    assert report.labels == ["seed-0", "seed-1", "seed-2"]
    series = next(f for f in report.data["figures"] if f["name"] == "accuracy_vs_round")["series"]
    assert [s["ci95"] for s in series] == [None, None, None]


def test_two_configs_with_three_seeds_each_are_two_curves(tmp_path: Path) -> None:
    folders = [
        write_run(tmp_path / f"{name}-seed{s}", make_results([0.5 + s / 10], seed=s, name=name))
        for name in ("rabo", "fedmbo")
        for s in range(3)
    ]
    # the same algorithm with two step sizes: labelled by the folders' common names
    same = [
        write_run(tmp_path / lr / f"seed-{s}", make_results([0.5], seed=s, lr=float(lr)))
        for lr in ("0.1", "0.2")
        for s in range(2)
    ]

    report = compare(folders, tmp_path / "report")
    by_folder = compare(same, tmp_path / "report-lr")

    assert [g["label"] for g in report.data["groups"]] == ["rabo", "fedmbo"]
    assert [g["label"] for g in by_folder.data["groups"]] == ["0.1", "0.2"]
    assert [g["n"] for g in report.data["groups"]] == [3, 3]
    rows = report.table.splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["rabo", "fedmbo"]


def test_cli_report_over_seed_folders_prints_mean_and_ci(
    seeds: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["report", *map(str, seeds), "--output", str(tmp_path / "report")])

    out = capsys.readouterr().out
    assert code == 0
    assert "| rabo | rabo | 3 | 0.8000 ± 0.2484 |" in out
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["groups"][0]["n"] == 3


def test_the_output_folder_of_seeds_stands_for_its_seed_folders(
    seeds: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `radbo run --seeds 0 1 2 --output out` writes out/seed-<s>; `radbo report out` reads them
    # (seed-10 after seed-2: in seed order, not name order)
    ten = write_run(tmp_path / "out" / "seed-10", make_results([0.5, 0.8], seed=10, flops=10))
    (tmp_path / "out" / "seed-notes").mkdir()  # not a seed folder: left out

    code = main(["report", str(tmp_path / "out"), "--output", str(tmp_path / "report")])

    assert code == 0
    assert "| rabo | rabo | 4 |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["groups"][0]["seeds"] == [0, 1, 2, 10]
    assert [Path(r["path"]) for r in saved["runs"]] == [*seeds, ten]
