"""``radbo report``: comparing finished runs (plots, report.md, report.json, CLI exit codes)."""

import json
from pathlib import Path

import pytest

from radbo.cli import main
from radbo.experiment import run
from radbo.report import PLOTS, ReportError, Run, compare, load_run, run_labels
from tests.configs import small_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMED = ("flops", "bytes", "bytes_down", "bytes_up")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two tiny real runs: RABO with masks, and the full model with its baseline."""
    root = tmp_path_factory.mktemp("runs")
    masked = small_config(rounds=2, eval_every=1, baseline={"enabled": False})
    full = small_config(rounds=2, eval_every=1, mask={"policy": "none"}, baseline={"enabled": True})
    run(masked, progress=False, output_dir=root / "rabo-masked")
    run(full, progress=False, output_dir=root / "rabo-full")
    return [root / "rabo-masked", root / "rabo-full"]


@pytest.fixture(scope="module")
def report(runs: list[Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("report")
    compare(runs, out)
    return json.loads((out / "report.json").read_text())


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_report_json_numbers_equal_each_results_json(runs: list[Path], report: dict) -> None:
    # Arrange
    entries = report["runs"]

    # Assert
    assert [e["name"] for e in entries] == ["rabo-masked", "rabo-full"]
    assert [e["label"] for e in entries] == ["rabo-masked", "rabo-full"]  # both are "rabo"
    for folder, entry in zip(runs, entries, strict=True):
        results = _results(folder)
        assert entry["totals"] == results["totals"]
        assert entry["totals_by_tier"] == results["totals_by_tier"]
        assert entry["final"] == results["final"]
        assert entry["final_test_accuracy"] == results["final"]["test_accuracy"]
        assert entry["rounds"] == len(results["rounds"]) == 2
        assert entry["communication_rounds"] == results["totals"]["communication_rounds"]
        assert entry["flops"] == results["totals"]["flops"]
        assert entry["bytes"] == results["totals"]["bytes"]
        assert entry["sim_time_s"] == results["totals"]["sim_time_s"]
        assert entry["savings"] == results.get("savings")
        curve = entry["curve"]
        assert curve["round"] == [1, 2]
        assert curve["cumulative_bytes"][-1] == results["totals"]["bytes"]
        assert curve["cumulative_flops"][-1] == results["totals"]["flops"]
        assert curve["sim_clock_s"][-1] == results["totals"]["sim_time_s"]
        assert curve["test_accuracy"] == [r["test_accuracy"] for r in results["rounds"]]
    masked, full = entries
    assert masked["baseline"] is None and masked["savings"] is None
    assert full["baseline"]["totals"] == _results(runs[1])["baseline"]["totals"]
    assert full["baseline_test_accuracy"] == _results(runs[1])["baseline"]["final"]["test_accuracy"]
    assert full["savings"]["bytes_fraction"] > 0


def test_tier_tables_sum_to_the_run_totals(runs: list[Path], report: dict) -> None:
    for folder, entry in zip(runs, report["runs"], strict=True):
        ledger = json.loads((folder / "ledger.json").read_text())
        tiers = entry["tiers"]
        assert {t["tier"] for t in tiers} == set(entry["totals_by_tier"])
        for key in SUMMED:
            assert sum(t[key] for t in tiers) == entry["totals"][key], key
        # compute_s and comm_s are Python float64 sums of positive per-entry times (integer
        # FLOPs and bytes over device rates: no torch kernel involved, the same on every CPU);
        # summed per tier and overall in another order they differ by at most γ_35 = 3.9e-15
        # of the sum (36 ledger entries; measured 3.7e-16), so rel 1e-12 is 250x above it
        for key in ("compute_s", "comm_s"):
            assert sum(t[key] for t in tiers) == pytest.approx(entry["totals"][key], rel=1e-12)
        # integer FLOPs over an integer total, a few tiers: rounding ~1e-16, approx's 1e-6
        assert sum(t["flops_share"] for t in tiers) == pytest.approx(1.0)
        assert sum(t["clients"] for t in tiers) == len({row["client"] for row in ledger})


def test_report_writes_valid_pngs_and_markdown(runs: list[Path], tmp_path: Path) -> None:
    # Act
    result = compare([load_run(r) for r in runs], tmp_path / "out")

    # Assert
    assert sorted(p.name for p in result.plots) == sorted(PLOTS)
    for path in result.plots:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    markdown = result.markdown.read_text()
    assert result.table in markdown
    assert markdown.count("### ") == 2  # one tier table per run
    assert "rabo-masked" in result.table and "rabo-full" in result.table
    assert not list((tmp_path / "out").glob(".*"))  # no temporary files left behind


def test_cli_report_prints_the_table_and_exits_0(
    runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Act
    code = main(["report", *map(str, runs), "--output", str(tmp_path / "rep")])

    # Assert
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("| run | algorithm | final acc |")
    assert (tmp_path / "rep" / "report.json").is_file()
    assert all((tmp_path / "rep" / name).is_file() for name in PLOTS)


def test_cli_missing_folder_is_one_line_and_exit_2(
    runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"

    code = main(["report", str(runs[0]), str(missing), "--output", str(tmp_path / "rep")])

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and str(missing) in err
    assert not (tmp_path / "rep").exists()  # nothing written when an input is bad


def test_cli_broken_json_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "results.json").write_text('{"config": {"algorithm": ')

    code = main(["report", str(broken), "--output", str(tmp_path / "rep")])

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert str(broken / "results.json") in err and "malformed JSON" in err


def test_folder_without_results_and_missing_keys_are_clear_errors(
    runs: list[Path], tmp_path: Path
) -> None:
    # a folder that is not a run
    with pytest.raises(ReportError, match=r"results\.json: not found"):
        load_run(tmp_path)
    # a results.json without totals
    data = _results(runs[0])
    del data["totals"]
    (tmp_path / "results.json").write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"results\.json: missing required key 'totals'"):
        load_run(tmp_path)
    # a round without its cost
    data = _results(runs[0])
    del data["rounds"][1]["cost_bytes"]
    (tmp_path / "results.json").write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"rounds\[1\] has no key 'cost_bytes'"):
        load_run(tmp_path)


def test_labels_are_algorithm_names_when_unique_else_folder_names() -> None:
    def fake(path: str, algorithm: str) -> Run:
        return Run(Path(path), {"config": {"algorithm": {"name": algorithm}}})

    assert run_labels([fake("a/x", "rabo"), fake("b/y", "simfbo")]) == ["rabo", "simfbo"]
    assert run_labels([fake("a/x", "rabo"), fake("b/y", "rabo")]) == ["x", "y"]
    assert run_labels([fake("a/x", "rabo"), fake("b/x", "rabo")]) == ["a/x", "b/x"]


def test_a_results_json_nested_too_deeply_is_one_report_error(tmp_path: Path):
    (tmp_path / "results.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ReportError, match=r"results\.json: JSON nested too deeply$"):
        load_run(tmp_path)
