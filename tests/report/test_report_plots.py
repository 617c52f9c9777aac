"""``radbo report``'s figures (issue 27): no line or plot without data (runs without device
profiles), PDF/SVG as well as PNG, a y-axis fitted to the data, round 0 on the curves, the
baseline's curve beside the run's, and an x-axis in communication rounds.

Most cases are hand-written ``results.json`` files whose curves are known exactly; one tiny
real run of ``examples/shrofbo.toml`` (no device profiles) checks the whole path."""

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from radbo.cli import main
from radbo.config import parse_config
from radbo.experiment import build, run
from radbo.report import PLOTS, ReportError, compare, fit_accuracy_limits, load_run
from tests.configs import ROOT, small_config

PNG = b"\x89PNG\r\n\x1a\n"


def make_results(
    accuracies: list[float | None],
    *,
    seed: int = 0,
    devices: bool = True,
    flops: int = 10,
    nbytes: int = 100,
    comm: int = 2,
    clock: float = 1.5,
    joules: float = 0.5,
    initial: float | None = None,
    baseline: list[float | None] | None = None,
    lr: float = 0.1,
    name: str = "rabo",
) -> dict[str, Any]:
    """A ``results.json`` of ``len(accuracies)`` rounds (``None``: not evaluated), each
    costing ``flops`` FLOPs, ``nbytes`` bytes (half down, half up), ``comm`` communication
    rounds, ``clock`` simulated seconds and ``joules`` (with device profiles; without, no
    clock and every FLOP and byte unpriced, as radbo writes them)."""
    rounds = []
    for i, acc in enumerate(accuracies):
        row: dict[str, Any] = {
            "round": i,
            "clients": [0, 1],
            "communication_rounds": comm,
            "wall_time_s": 0.01,
            "sim_round_time_s": clock if devices else 0.0,
            "sim_clock_s": clock * (i + 1) if devices else 0.0,
            "outer_loss": 1.0 / (i + 1),
            "cost_flops": flops,
            "cost_bytes_down": nbytes // 2,
            "cost_bytes_up": nbytes // 2,
            "cost_bytes": nbytes,
            "cost_energy_j": joules if devices else 0.0,
            "cost_energy_unpriced_flops": 0 if devices else flops,
            "cost_energy_unpriced_bytes": 0 if devices else nbytes,
        }
        if acc is not None:
            row.update(test_accuracy=acc, test_loss=1.0 - acc)
        rounds.append(row)
    n = len(accuracies)
    totals = {
        "flops": flops * n,
        "bytes": nbytes * n,
        "bytes_down": nbytes // 2 * n,
        "bytes_up": nbytes // 2 * n,
        "compute_s": 0.1 * n if devices else 0.0,
        "comm_s": 0.2 * n if devices else 0.0,
        "energy_j": joules * n if devices else 0.0,
        "energy_compute_j": joules * n if devices else 0.0,
        "energy_radio_j": 0.0,
        "energy_unpriced_flops": 0 if devices else flops * n,
        "energy_unpriced_bytes": 0 if devices else nbytes * n,
        "communication_rounds": comm * n,
        "sim_time_s": clock * n if devices else 0.0,
    }
    last = [a for a in accuracies if a is not None][-1]
    fleet = {"devices": {"laptop": 1.0} if devices else None, "file": None, "trace": None}
    config = {
        "seed": seed,
        "output_dir": f"runs/seed-{seed}",
        "fleet": fleet,
        "algorithm": {"name": name, "inner_lr": lr},
    }
    results: dict[str, Any] = {
        "config": config,
        "final": {"test_accuracy": last, "test_loss": 1.0 - last},
        "totals": totals,
        "totals_by_tier": {"laptop": {k: v for k, v in totals.items() if k != "sim_time_s"}},
        "rounds": rounds,
    }
    if initial is not None:
        results["initial"] = {"test_accuracy": initial, "test_loss": 1.0 - initial}
    if baseline is not None:
        base = make_results(baseline, seed=seed, devices=devices, flops=2 * flops, comm=comm)
        results["baseline"] = {k: base[k] for k in ("config", "final", "totals", "totals_by_tier")}
        results["baseline"]["rounds"] = base["rounds"]
        results["savings"] = {"compute_fraction": 0.5, "bytes_fraction": 1.0}
    return results


def write_run(folder: Path, results: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def figure(report: Any, name: str) -> dict[str, Any]:
    return next(f for f in report.data["figures"] if f["name"] == name)


# ---------------------------------------------------------------- no device profiles


def test_a_run_without_device_profiles_writes_no_time_or_energy_plot(tmp_path: Path) -> None:
    # Arrange: before issue 27 every point of accuracy_vs_time sat at x = 0 and an empty
    # accuracy_vs_energy.png was written and listed
    folder = write_run(tmp_path / "shrofbo", make_results([0.5, 0.6], devices=False))

    # Act
    report = compare([folder], tmp_path / "out")

    # Assert: not written, not listed, said once why
    written = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert written == sorted(
        n for n in PLOTS if n not in ("accuracy_vs_time.png", "accuracy_vs_energy.png")
    )
    assert sorted(p.name for p in report.plots) == written == sorted(report.data["plots"])
    markdown = report.markdown.read_text()
    assert "accuracy_vs_time.png" not in markdown and "accuracy_vs_energy.png" not in markdown
    assert report.notes == [
        "accuracy_vs_time: not drawn: no run has data (no device profiles ([fleet] devices, "
        "file or trace): no simulated clock)",
        "accuracy_vs_energy: not drawn: no run has data (no device profiles ([fleet] devices, "
        "file or trace): no energy)",
    ]
    for note in report.notes:
        assert f"- {note}" in markdown
    # the table shows no simulated time rather than 0.00, and report.json no clock
    header, _, cells = (
        [c.strip() for c in line.strip("|").split("|")] for line in report.table.splitlines()
    )
    assert cells[header.index("sim time (s)")] == "-"
    entry = report.data["runs"][0]
    assert entry["sim_time_s"] is None and entry["curve"]["sim_clock_s"] == [None, None]


def test_with_and_without_device_profiles_only_the_run_with_them_draws_against_time(
    tmp_path: Path,
) -> None:
    with_devices = write_run(tmp_path / "a", make_results([0.5, 0.6], name="rabo"))
    without = write_run(tmp_path / "b", make_results([0.4, 0.7], devices=False, name="shrofbo"))

    report = compare([with_devices, without], tmp_path / "out")

    time = figure(report, "accuracy_vs_time")
    assert [s["label"] for s in time["series"]] == ["rabo"]
    assert time["series"][0]["x"] == [1.5, 3.0]
    assert time["missing"] == {
        "shrofbo": "no device profiles ([fleet] devices, file or trace): no simulated clock"
    }
    assert (tmp_path / "out" / "accuracy_vs_time.png").read_bytes()[:8] == PNG
    assert "accuracy_vs_time: no line for shrofbo: no device profiles" in "\n".join(report.notes)


def test_cli_report_says_once_why_a_plot_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_run(tmp_path / "run", make_results([0.5, 0.6], devices=False))

    code = main(["report", str(folder), "--output", str(tmp_path / "out")])

    out = capsys.readouterr().out
    assert code == 0
    assert out.count("accuracy_vs_time: not drawn") == 1
    assert out.count("accuracy_vs_energy: not drawn") == 1
    plots_line = next(line for line in out.splitlines() if line.startswith("plots:"))
    assert "accuracy_vs_time" not in plots_line and "accuracy_vs_round.png" in plots_line


@pytest.fixture(scope="module")
def shrofbo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/shrofbo.toml (no device profiles), 2 rounds, evaluated every round."""
    data = tomllib.loads((ROOT / "examples" / "shrofbo.toml").read_text())
    data.update(rounds=2, eval_every=1)
    out = tmp_path_factory.mktemp("shrofbo") / "run"
    run(parse_config(data), progress=False, output_dir=out)
    return out


def test_example_without_devices_end_to_end(shrofbo_run: Path, tmp_path: Path) -> None:
    # Act
    report = compare([shrofbo_run], tmp_path / "out")

    # Assert: the run records round 0, the report draws it and leaves out time and energy
    results = json.loads((shrofbo_run / "results.json").read_text())
    assert set(results["initial"]) >= {"test_accuracy", "test_loss"}
    rounds = figure(report, "accuracy_vs_round")["series"][0]
    assert rounds["x"] == [0, 1, 2]
    assert rounds["y"] == [
        results["initial"]["test_accuracy"],
        *(r["test_accuracy"] for r in results["rounds"]),
    ]
    assert not (tmp_path / "out" / "accuracy_vs_time.png").exists()
    assert not (tmp_path / "out" / "accuracy_vs_energy.png").exists()


# ---------------------------------------------------------------- paper-ready figures


def test_formats_png_pdf_svg_write_each_plot_in_each(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run", make_results([0.5, 0.6]))

    report = compare([folder], tmp_path / "out", formats="png,pdf,svg")

    assert len(report.plots) == 3 * len(PLOTS)
    for stem in (n.removesuffix(".png") for n in PLOTS):
        out = tmp_path / "out"
        assert (out / f"{stem}.png").read_bytes()[:8] == PNG
        assert (out / f"{stem}.pdf").read_bytes()[:5] == b"%PDF-"
        assert b"<svg" in (out / f"{stem}.svg").read_bytes()[:2000]
    assert "![accuracy_vs_round.png](accuracy_vs_round.png)" in report.markdown.read_text()
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left


def test_a_second_pdf_or_svg_of_the_same_report_is_byte_identical(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "run", make_results([0.5, 0.6]))

    compare([folder], tmp_path / "a", formats=["pdf", "svg"])
    compare([folder], tmp_path / "b", formats=["pdf", "svg"])

    for name in ("accuracy_vs_bytes.pdf", "accuracy_vs_bytes.svg"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_an_unknown_format_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_run(tmp_path / "run", make_results([0.5]))

    with pytest.raises(ReportError, match=r"format 'jpg' is not one radbo writes"):
        compare([folder], tmp_path / "out", formats="png,jpg")
    code = main(["report", str(folder), "--output", str(tmp_path / "out"), "--format", "gif"])

    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "'gif'" in err and "png, pdf, svg" in err
    assert not (tmp_path / "out").exists()


def test_the_y_axis_is_fitted_to_the_data(tmp_path: Path) -> None:
    # before issue 27 every plot spanned 0-1 whatever the data
    folder = write_run(tmp_path / "run", make_results([0.7, 0.8, 0.9]))

    report = compare([folder], tmp_path / "out")

    # 0.7..0.9 with 5 % of the range on each side: float64 arithmetic on three numbers
    low, high = figure(report, "accuracy_vs_round")["ylim"]
    assert low == pytest.approx(0.69, abs=1e-12) and high == pytest.approx(0.91, abs=1e-12)
    assert fit_accuracy_limits([0.5, 0.5]) == (0.48, 0.52)
    assert fit_accuracy_limits([0.0, 1.0]) == (0.0, 1.0)  # kept within [0, 1]
    assert fit_accuracy_limits([]) == (0.0, 1.0)


def test_round_0_starts_every_curve_when_the_run_has_it(tmp_path: Path) -> None:
    with_initial = write_run(tmp_path / "a", make_results([0.5, None, 0.7], initial=0.1))
    without = write_run(tmp_path / "b", make_results([0.5, None, 0.7]))

    report = compare([with_initial], tmp_path / "out")
    old = compare([without], tmp_path / "old")

    expected_x = {
        "accuracy_vs_round": [0, 1, 3],
        "accuracy_vs_communication_rounds": [0, 2, 6],
        "accuracy_vs_time": [0.0, 1.5, 4.5],
        "accuracy_vs_bytes": [0.0, 100e-6, 300e-6],
        "accuracy_vs_flops": [0.0, 10e-9, 30e-9],
        "accuracy_vs_energy": [0, 0.5, 1.5],
    }
    for name, xs in expected_x.items():
        (series,) = figure(report, name)["series"]
        assert series["x"] == pytest.approx(xs, rel=1e-12), name  # x * 1e-6 / 1e-9 scales
        assert series["y"] == [0.1, 0.5, 0.7], name
        (series,) = figure(old, name)["series"]
        assert series["y"] == [0.5, 0.7], name  # no initial evaluation recorded: from round 1
    assert report.data["runs"][0]["initial"] == {"test_accuracy": 0.1, "test_loss": 0.9}
    assert report.data["runs"][0]["curve"]["round"] == [1, 2, 3]  # report.json: per round


def test_the_baseline_curve_is_drawn_beside_the_run(tmp_path: Path) -> None:
    results = make_results([0.5, 0.8], baseline=[0.6, 0.7], name="rabo")
    folder = write_run(tmp_path / "run", results)
    old = dict(results, baseline={k: v for k, v in results["baseline"].items() if k != "rounds"})
    old_folder = write_run(tmp_path / "old", old)

    report = compare([folder], tmp_path / "out")
    without = compare([old_folder], tmp_path / "out-old")

    run_series, base_series = figure(report, "accuracy_vs_flops")["series"]
    assert run_series["label"] == "rabo" and not run_series["baseline"]
    assert base_series["label"] == "rabo: full-model baseline" and base_series["baseline"]
    assert base_series["y"] == [0.6, 0.7]
    assert base_series["x"] == pytest.approx([20e-9, 40e-9], rel=1e-12)  # its own FLOPs
    # a results.json written before the baseline's rounds were recorded: the run's line only
    assert len(figure(without, "accuracy_vs_flops")["series"]) == 1


def test_communication_rounds_axis_counts_every_communication_round(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", make_results([0.5, 0.6, 0.7], comm=2, name="rabo"))
    b = write_run(tmp_path / "b", make_results([0.5, 0.6, 0.7], comm=5, name="fedmbo"))

    report = compare([a, b], tmp_path / "out")

    fig = figure(report, "accuracy_vs_communication_rounds")
    assert [s["x"] for s in fig["series"]] == [[2, 4, 6], [5, 10, 15]]
    assert fig["xlabel"] == "communication rounds"
    assert figure(report, "accuracy_vs_round")["xlabel"] == "iterations (rounds)"
    assert (tmp_path / "out" / "accuracy_vs_communication_rounds.png").read_bytes()[:8] == PNG


# ---------------------------------------------------------------- what radbo run records


@pytest.fixture(scope="module")
def paired(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    config = small_config(rounds=2, eval_every=1, baseline={"enabled": True})
    out = tmp_path_factory.mktemp("paired") / "run"
    return run(config, progress=False, output_dir=out), out


def test_run_records_the_initial_evaluation_and_the_baselines_rounds(paired) -> None:
    result, out = paired
    results = json.loads((out / "results.json").read_text())

    # the initial evaluation is the evaluator's on the initial state, exactly
    exp = build(result.config)
    expected = exp.simulation.evaluate(exp.simulation.algorithm.model_state(exp.initial_state))
    assert results["initial"] == {f"test_{k}": v for k, v in expected.items()}
    assert result.initial == results["initial"]
    # the baseline's rows, as the baseline run made them
    assert results["baseline"]["rounds"] == result.baseline.rounds
    assert len(results["baseline"]["rounds"]) == 2
    assert (
        results["baseline"]["final"]["test_accuracy"]
        == (results["baseline"]["rounds"][-1]["test_accuracy"])
    )
    assert load_run(out).baseline_run() is not None
    assert (out / "accuracy.png").read_bytes()[:8] == PNG
