"""Per-round logs (issue 27): ``metrics.csv`` beside ``results.json`` and TensorBoard scalars
with ``[logging] tensorboard = true`` (radbo[tensorboard]); a clear error when the extra is
missing."""

import csv
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from radbo.cli import main
from radbo.config import ConfigError
from radbo.experiment import run
from radbo.experiment.logs import metrics_csv, metrics_rows
from tests.configs import DEMO, small_config


def read_csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


def test_metrics_rows_by_hand() -> None:
    rounds = [
        {
            "round": 0,
            "clients": [0, 1],
            "communication_rounds": 2,
            "wall_time_s": 0.3,
            "sim_clock_s": 1.5,
            "outer_loss": 0.5,
            "coverage_x_histogram": [0, 2],
            "cost_flops": 10,
            "cost_bytes_down": 3,
            "cost_bytes_up": 1,
            "cost_bytes": 4,
            "cost_energy_j": 0.25,
        },
        {
            "round": 1,
            "clients": [1],
            "communication_rounds": 2,
            "wall_time_s": 0.2,
            "sim_clock_s": 2.0,
            "outer_loss": 0.25,
            "cost_flops": 6,
            "cost_bytes_down": 2,
            "cost_bytes_up": 2,
            "cost_bytes": 4,
            "cost_energy_j": 0.5,
            "test_accuracy": 0.75,
        },
    ]

    rows = metrics_rows(rounds, initial={"test_accuracy": 0.125})
    text = metrics_csv(rows)

    assert text.splitlines() == [
        "round,outer_loss,test_accuracy,cumulative_communication_rounds,cumulative_flops,"
        "cumulative_bytes_down,cumulative_bytes_up,cumulative_bytes,cumulative_energy_j,"
        "sim_clock_s",
        "0,,0.125,0,0,0,0,0,,0.0",
        "1,0.5,,2,10,3,1,4,0.25,1.5",
        "2,0.25,0.75,4,16,5,3,8,0.75,2.0",
    ]
    # without a clock (no device profiles) and without energy: no such columns
    bare = metrics_rows(
        [{k: v for k, v in r.items() if k != "cost_energy_j"} for r in rounds], clock=False
    )
    assert "sim_clock_s" not in metrics_csv(bare) and "energy" not in metrics_csv(bare)


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-round run (evaluated every 2 rounds and after the last) with TensorBoard on."""
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("logged") / "run"
    config = small_config(rounds=3, eval_every=2, logging={"tensorboard": True})
    run(config, progress=False, output_dir=out)
    return out


def test_metrics_csv_has_one_row_per_round_equal_to_results_json(logged: Path) -> None:
    results = json.loads((logged / "results.json").read_text())
    rows = read_csv(logged / "metrics.csv")

    assert [int(r["round"]) for r in rows] == [0, 1, 2, 3]  # row 0: the initial evaluation
    assert float(rows[0]["test_accuracy"]) == results["initial"]["test_accuracy"]
    assert rows[0]["outer_loss"] == "" and rows[0]["cumulative_flops"] == "0"
    flops = 0
    for row, record in zip(rows[1:], results["rounds"], strict=True):
        flops += record["cost_flops"]
        assert int(row["cumulative_flops"]) == flops
        assert float(row["outer_loss"]) == record["outer_loss"]  # repr: exact round trip
        assert float(row["sim_clock_s"]) == record["sim_clock_s"]
        if "test_accuracy" in record:
            assert float(row["test_accuracy"]) == record["test_accuracy"]
        else:
            assert row["test_accuracy"] == ""  # not evaluated in this round
    assert [r["test_accuracy"] != "" for r in rows] == [True, False, True, True]
    last = rows[-1]
    assert int(last["cumulative_bytes"]) == results["totals"]["bytes"]
    assert int(last["cumulative_communication_rounds"]) == results["totals"]["communication_rounds"]
    assert float(last["cumulative_energy_j"]) == pytest.approx(
        results["totals"]["energy_j"], rel=1e-12
    )  # the same joules summed per round vs per ledger entry: float64, ~10 roundings
    assert "coverage_x_histogram" not in rows[0] and "wall_time_s" not in rows[0]
    assert not list(logged.glob(".*"))  # atomic writes leave no temporary files


def test_tensorboard_scalars_are_the_csv_values(logged: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged / "tensorboard" / "run"))
    events.Reload()
    rows = read_csv(logged / "metrics.csv")

    tags = set(events.Tags()["scalars"])
    assert tags == {c for c in rows[0] if c != "round"}
    for tag in tags:
        expected = {int(r["round"]): float(r[tag]) for r in rows if r[tag] != ""}
        logged_values = {e.step: e.value for e in events.Scalars(tag)}
        # TensorBoard stores float32: each value is the CSV's rounded once to float32
        assert logged_values == {k: float(np.float32(v)) for k, v in expected.items()}, tag


def test_logging_is_left_out_of_results_json_when_default(tmp_path: Path) -> None:
    # configs without [logging] dump as before it existed: checkpoints still resume
    assert "logging" not in small_config().model_dump(mode="json")
    assert small_config(logging={"tensorboard": True}).model_dump()["logging"] == {
        "tensorboard": True
    }
    with pytest.raises(ConfigError, match="logging.tensorbord"):
        small_config(logging={"tensorbord": True})


def _block_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import torch.utils.tensorboard`` fail as it does without the package."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_tensorboard_without_the_extra_is_a_config_error_before_round_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _block_tensorboard(monkeypatch)

    with pytest.raises(ConfigError) as info:
        run(
            small_config(rounds=1, logging={"tensorboard": True}),
            progress=False,
            output_dir=tmp_path / "out" / "run",
        )

    assert "pip install 'radbo[tensorboard]'" in str(info.value)
    assert not (tmp_path / "out").exists()  # the folders made for the run are removed again


def test_cli_tensorboard_without_the_extra_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _block_tensorboard(monkeypatch)
    config = tmp_path / "demo.toml"
    config.write_text(DEMO.read_text() + "\n[logging]\ntensorboard = true\n")

    code = main(["run", str(config), "--rounds", "1", "--quiet", "--output-dir", str(tmp_path)])

    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert err.startswith("config error: logging.tensorboard = true needs the tensorboard")


def test_a_resumed_run_logs_what_an_uninterrupted_one_logs(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = small_config(rounds=2, eval_every=1, checkpoint_every=1, logging={"tensorboard": True})
    run(config, progress=False, output_dir=tmp_path / "resumed")
    longer = config.model_copy(update={"rounds": 3})
    run(longer, progress=False, output_dir=tmp_path / "resumed", resume=True)
    run(longer, progress=False, output_dir=tmp_path / "straight")

    # metrics.csv: the same text, the cumulative counters restored from the checkpoint
    resumed = (tmp_path / "resumed" / "metrics.csv").read_text()
    assert resumed == (tmp_path / "straight" / "metrics.csv").read_text()
    # TensorBoard: every step once, with the uninterrupted run's values
    events = EventAccumulator(str(tmp_path / "resumed" / "tensorboard" / "run"))
    events.Reload()
    straight = EventAccumulator(str(tmp_path / "straight" / "tensorboard" / "run"))
    straight.Reload()
    for tag in ("cumulative_flops", "outer_loss", "test_accuracy"):
        steps = [(e.step, e.value) for e in events.Scalars(tag)]
        assert steps == [(e.step, e.value) for e in straight.Scalars(tag)], tag
    assert [e.step for e in events.Scalars("cumulative_flops")] == [0, 1, 2, 3]


def test_a_run_written_over_another_shows_only_its_own_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    for seed in (0, 1):  # the second run writes over the first (Python API: overwrite=True)
        config = small_config(rounds=1, eval_every=1, seed=seed, logging={"tensorboard": True})
        run(config, progress=False, output_dir=out)

    events = EventAccumulator(str(out / "tensorboard" / "run"))
    events.Reload()
    rows = read_csv(out / "metrics.csv")  # the second run's
    assert len(list((out / "tensorboard" / "run").iterdir())) == 1  # the first's removed
    logged = [(e.step, e.value) for e in events.Scalars("cumulative_flops")]
    assert logged == [(int(r["round"]), float(r["cumulative_flops"])) for r in rows]
