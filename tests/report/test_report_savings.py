"""Savings at equal accuracy (issue 27): what a run and its baseline each spend to first reach
the final accuracy of the worse of the two, beside the savings at equal rounds, in
``radbo run``'s summary, ``results.json`` and ``radbo report``."""

import json
import math
from pathlib import Path
from typing import Any

from radbo.cost import first_reaching, savings_at_accuracy
from radbo.experiment import RunResult, run
from radbo.experiment.summary import summary_lines
from radbo.report import compare
from tests.configs import small_config
from tests.report.test_report_plots import make_results, write_run


def rows(accuracies: list[float | None], flops: int, nbytes: int, clock: float) -> list[dict]:
    return [
        {
            "round": i,
            "communication_rounds": 2,
            "cost_flops": flops,
            "cost_bytes": nbytes,
            "cost_energy_j": 0.5,
            "sim_clock_s": clock * (i + 1),
            **({} if a is None else {"test_accuracy": a}),
        }
        for i, a in enumerate(accuracies)
    ]


#: RABO ends better (0.8) than its oscillating baseline (0.9 in round 2, then 0.7): equal
#: rounds compare them at round 4 only
RUN = rows([0.5, None, 0.75, 0.8], flops=10, nbytes=100, clock=1.0)
BASE = rows([0.6, 0.9, None, 0.7], flops=40, nbytes=200, clock=4.0)


def test_first_reaching_sums_the_cost_up_to_the_first_evaluation_at_the_target() -> None:
    assert first_reaching(RUN, 0.7) == {
        "rounds": 3,
        "communication_rounds": 6,
        "flops": 30,
        "bytes": 300,
        "sim_time_s": 3.0,
        "energy_j": 1.5,
    }
    assert first_reaching(BASE, 0.7)["rounds"] == 2  # 0.9 at round 2, before it fell
    assert first_reaching(RUN, 0.81) is None  # never evaluated that high
    # an initial evaluation at the target already: nothing spent
    assert first_reaching(RUN, 0.4, initial={"test_accuracy": 0.45})["flops"] == 0


def test_savings_at_accuracy_against_an_oscillating_baseline() -> None:
    sv = savings_at_accuracy(RUN, {"test_accuracy": 0.8}, BASE, {"test_accuracy": 0.7})

    # target = the worse final, 0.7; RABO first reaches it at round 3 (30 FLOPs, 300 bytes,
    # 3 s), the baseline at round 2 (80 FLOPs, 400 bytes, 8 s): exact ratios of integers
    assert sv["target_accuracy"] == 0.7
    assert sv["run"]["rounds"] == 3 and sv["baseline"]["rounds"] == 2
    assert sv["compute_fraction"] == 30 / 80
    assert sv["bytes_fraction"] == 300 / 400
    assert sv["time_fraction"] == 3.0 / 8.0
    assert sv["energy_fraction"] == 1.5 / 1.0


def test_not_reached_gives_none_and_nan_fractions() -> None:
    # a final accuracy no evaluation in the rows reaches (e.g. an evaluation cut off)
    sv = savings_at_accuracy(RUN, {"test_accuracy": 0.95}, BASE, {"test_accuracy": 0.95})

    assert sv["run"] is None and sv["baseline"] is None
    assert all(math.isnan(sv[k]) for k in ("compute_fraction", "bytes_fraction", "time_fraction"))
    assert savings_at_accuracy(RUN, {}, BASE, {"test_accuracy": 0.7}) is None


def _result(at_accuracy: dict[str, Any] | None, devices: bool = True) -> RunResult:
    fleet = {} if devices else {"devices": None, "capacities": [1.0]}
    config = small_config(baseline={"enabled": True}, fleet=fleet)
    base = RunResult(config=config, rounds=[], final={"test_accuracy": 0.7}, state=None)
    return RunResult(
        config=config,
        rounds=[{}] * 4,
        final={"test_accuracy": 0.8, "test_loss": 0.5},
        state=None,
        totals={"communication_rounds": 8, "flops": 2e9, "bytes": 3e6, "sim_time_s": 2.5},
        baseline=base,
        savings={"compute_fraction": 0.5, "bytes_fraction": 0.25, "time_fraction": 0.125},
        savings_at_accuracy=at_accuracy,
    )


def test_summary_prints_savings_at_equal_rounds_and_at_equal_accuracy() -> None:
    at_accuracy = savings_at_accuracy(RUN, {"test_accuracy": 0.8}, BASE, {"test_accuracy": 0.7})

    lines = summary_lines(_result(at_accuracy))

    assert lines[3] == "compute: 2.000 GFLOP   bytes: 3.000 MB   simulated time: 2.5 s"
    assert lines[4] == (
        "vs full-model FedMBO-style baseline (test accuracy 0.7000), at equal rounds (4): "
        "compute 50.0%, bytes 25.0%, simulated time 12.5%"
    )
    assert lines[5] == (
        "at equal accuracy 0.7000 (the worse final): compute 37.5%, bytes 75.0%, "
        "simulated time 37.5%"
    )
    assert lines[6] == "  first reached after 3 rounds (rabo) and 2 rounds (baseline)"


def test_summary_says_not_reached() -> None:
    at_accuracy = savings_at_accuracy(RUN, {"test_accuracy": 0.8}, BASE, {"test_accuracy": 0.7})
    at_accuracy["baseline"] = None

    lines = summary_lines(_result(at_accuracy))

    assert lines[-1] == "at equal accuracy 0.7000 (the worse final): not reached by the baseline"


def test_summary_without_device_profiles_prints_no_simulated_time() -> None:
    # before issue 27: "simulated time: 0.0 s" for every run without device profiles
    lines = summary_lines(_result(None, devices=False))

    assert not any("simulated time" in line for line in lines)
    assert lines[3] == "compute: 2.000 GFLOP   bytes: 3.000 MB"
    assert sum("no device profiles" in line for line in lines) == 1
    assert lines[5].endswith("at equal rounds (4): compute 50.0%, bytes 25.0%")


def test_a_real_run_records_savings_at_accuracy_in_results_json(tmp_path: Path) -> None:
    # Act
    result = run(
        small_config(rounds=3, eval_every=1, baseline={"enabled": True}),
        progress=False,
        output_dir=tmp_path / "run",
    )

    # Assert: results.json's figures are savings_at_accuracy of its own rows
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    base = saved["baseline"]
    expected = savings_at_accuracy(
        saved["rounds"],
        saved["final"],
        base["rounds"],
        base["final"],
        run_initial=saved["initial"],
        baseline_initial=base["initial"],
    )
    assert saved["savings_at_accuracy"] == json.loads(json.dumps(expected))
    assert expected["target_accuracy"] == min(
        saved["final"]["test_accuracy"], base["final"]["test_accuracy"]
    )
    # the worse of the two reaches its own final accuracy at the latest in its last round
    assert expected["run"] is not None and expected["baseline"] is not None
    assert result.savings_at_accuracy == expected
    assert any(line.startswith("at equal accuracy") for line in summary_lines(result))

    # and radbo report shows them
    report = compare([tmp_path / "run"], tmp_path / "report")
    assert "## Savings at equal accuracy" in report.markdown.read_text()
    assert report.data["runs"][0]["savings_at_accuracy"] == saved["savings_at_accuracy"]


def test_report_table_of_savings_at_equal_accuracy(tmp_path: Path) -> None:
    results = make_results([0.5, 0.8], baseline=[0.6, 0.7])
    results["savings_at_accuracy"] = savings_at_accuracy(
        results["rounds"],
        results["final"],
        results["baseline"]["rounds"],
        results["baseline"]["final"],
    )
    folder = write_run(tmp_path / "run", results)

    report = compare([folder], tmp_path / "report")

    markdown = report.markdown.read_text()
    # target 0.7: the run and the baseline reach it in round 2, the run with 20 FLOPs, the
    # baseline with 40; bytes, clock and joules per round are the same for both
    assert "| rabo | 0.7000 | 2 / 2 | 50.0% | 100.0% | 100.0% | 100.0% |" in markdown


def test_summary_of_one_test_episode_prints_no_interval() -> None:
    # few-shot: the 95 % interval of a mean over one test episode is undefined (NaN): the
    # summary leaves it out instead of printing "± nan"
    result = _result(None)
    result.final = {"test_accuracy": 0.8, "test_loss": 0.5, "test_accuracy_ci95": math.nan}
    many = _result(None)
    many.final = {**result.final, "test_accuracy_ci95": 0.0125, "test_episodes": 300.0}

    assert summary_lines(result)[0] == "final test accuracy: 0.8000"
    assert summary_lines(many)[0] == ("final test accuracy: 0.8000 ± 0.0125 (95% CI, 300 episodes)")
