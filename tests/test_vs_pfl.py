"""benchmarks/vs_pfl.py without pfl: its synthetic data and the radbo side at a tiny size.

The radbo side runs in a child process (as the script runs it), so that the model kind it
registers (``pfl_simple_cnn``) stays out of this process's registry. No pfl environment is
made here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from radbo.config import parse_config
from radbo.data.readers import read_cifar10
from radbo.models import MODELS
from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "vs_pfl.py"


def load_script():
    return helpers.load_script(SCRIPT, "vs_pfl")


def test_the_synthetic_data_are_the_same_for_pfl_and_radbo(tmp_path):
    vs_pfl = load_script()
    assert "pfl_simple_cnn" not in MODELS  # importing the script registers nothing
    folder = vs_pfl.write_data(tmp_path, clients=6, seed=3)
    images, labels = np.load(folder / "images.npy"), np.load(folder / "labels.npy")
    assert images.shape == (300, 32, 32, 3) and images.dtype == np.uint8
    assert labels.shape == (300,) and set(np.unique(labels)) <= set(range(10))
    binary, binary_labels = read_cifar10(folder, train=True)
    np.testing.assert_array_equal(binary, images.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(binary_labels, labels)
    test, _ = read_cifar10(folder, train=False)
    assert test.shape == (vs_pfl.TEST_IMAGES, 3, 32, 32)
    again = vs_pfl.write_data(tmp_path / "again", clients=6, seed=3)
    np.testing.assert_array_equal(np.load(again / "images.npy"), images)  # from the seed


def test_the_model_is_pfls_simple_cnn_without_dropout():
    vs_pfl = load_script()
    model = vs_pfl.PflSimpleCNN()
    # pfl's simple_cnn on 32x32x3: 896 + 18,496 + 1,605,760 + 1,290 parameters
    assert sum(p.numel() for p in model.parameters()) == 1_626_442
    assert model.inner_param_names() == ["head.weight", "head.bias"]
    x = model.example_input(3).normal_()
    state = dict(model.state_dict())
    assert model.functional_forward(state, x).equal(model(x))


def test_the_radbo_side_reports_seconds_per_round_for_every_backend(tmp_path):
    vs_pfl = load_script()
    data = vs_pfl.write_data(tmp_path / "data", clients=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    command = [sys.executable, str(SCRIPT), "--side", "radbo", "--data", str(data)]
    command += ["--clients", "4", "--per-round", "2", "--rounds", "2", "--workers", "2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["backend"] for r in results] == ["sequential", "batched", "auto", "processes"]
    for r in results:
        assert r["side"] == "radbo" and r["device"] == "cpu" and r["threads"] == 1
        assert len(r["round_s"]) == 2 and r["s_per_round"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--per-round", "5", "--clients", "4"], "--per-round must be at most --clients"),
        (["--backends", "sequential,threads"], "--backends takes some of"),
        (["--backends", "sequential:nhwc"], "--backends takes some of"),
        (["--backends", "sequential:cuda_graphs"], "only batched takes :cuda_graphs"),
        (["--backends", "batched:cuda_graphs"], ":cuda_graphs needs --device cuda"),
        (["--rounds", "0"], "must be >= 1"),
    ],
)
def test_bad_flags_are_refused(flags, message, capsys):
    vs_pfl = load_script()
    with pytest.raises(SystemExit):
        vs_pfl.parse_args(flags)
    assert message in capsys.readouterr().err


def test_quick_is_tiny_and_flags_win():
    vs_pfl = load_script()
    quick = vs_pfl.parse_args(["--quick"])
    assert (quick.clients, quick.per_round, quick.rounds, quick.repeats) == (40, 4, 3, 1)
    assert vs_pfl.parse_args(["--quick", "--rounds", "5"]).rounds == 5
    full = vs_pfl.parse_args([])
    assert (full.clients, full.per_round, full.rounds, full.repeats) == (1000, 50, 6, 3)


def test_a_side_may_run_with_channels_last_images(tmp_path):
    """``backend:channels_last`` is that backend with ``[runtime] memory_format =
    "channels_last"``; the floor then is measured in both layouts and the table shows both."""
    vs_pfl = load_script()
    args = vs_pfl.parse_args(["--quick", "--backends", "sequential,sequential:channels_last"])
    assert [vs_pfl.side_parts(b) for b in args.backends] == [
        ("sequential", "contiguous", False),
        ("sequential", "channels_last", False),
    ]
    data = vs_pfl.write_data(tmp_path / "data", clients=4)
    config = vs_pfl.radbo_config(data, "sequential", 4, 2, 2, "cpu", 2, "channels_last")
    assert config["runtime"]["memory_format"] == "channels_last"
    assert (
        "memory_format" not in vs_pfl.radbo_config(data, "sequential", 4, 2, 2, "cpu", 2)["runtime"]
    )
    text = vs_pfl.table(
        [2.0], {"sequential": [1.5], "sequential:channels_last": [1.2]}, [1.0], "cpu", 2, [0.8]
    )
    assert "| radbo sequential, channels-last | 1.20 | 0.60x | 1.20x |" in text
    assert "| plain PyTorch floor, channels-last | 0.80 | | 0.80x |" in text


def test_a_batched_side_may_replay_its_steps_from_cuda_graphs(tmp_path):
    """``batched:cuda_graphs`` (and ``batched:channels_last:cuda_graphs``) is the batched
    backend with ``[runtime] cuda_graphs = true``, labelled in the table; the config is what
    a GPU run parses (``device = "cuda"``)."""
    vs_pfl = load_script()
    assert vs_pfl.side_parts("batched:cuda_graphs") == ("batched", "contiguous", True)
    assert vs_pfl.side_parts("batched:channels_last:cuda_graphs") == (
        "batched",
        "channels_last",
        True,
    )
    data = vs_pfl.write_data(tmp_path / "data", clients=4)
    config = vs_pfl.radbo_config(data, "batched", 4, 2, 2, "cuda", 2, "contiguous", True)
    vs_pfl.register_model()
    assert parse_config(config).runtime.cuda_graphs
    assert "cuda_graphs" not in vs_pfl.radbo_config(data, "batched", 4, 2, 2, "cpu", 2)["runtime"]
    text = vs_pfl.table([2.0], {"batched:cuda_graphs": [0.5]}, [1.0], "cpu", 2)
    assert "| radbo batched, CUDA graphs | 0.50 | 0.25x | 0.50x |" in text


@helpers.requires_compiler
def test_the_floor_may_be_measured_with_the_model_compiled():
    """``--floor-compiled``: the plain-PyTorch floor once more with ``torch.compile`` on the
    model, as its own row of the table, relative to the eager floor."""
    vs_pfl = load_script()
    assert vs_pfl.parse_args(["--quick", "--floor-compiled"]).floor_compiled
    assert not vs_pfl.parse_args(["--quick"]).floor_compiled
    threads = torch.get_num_threads()
    try:
        seconds = vs_pfl.floor_seconds(per_round=1, steps=5, compiled=True)
    finally:
        torch.set_num_threads(threads)  # floor_seconds sets one thread, as a side does
    assert 0 < seconds < float("inf")
    text = vs_pfl.table([2.0], {"sequential": [1.5]}, [1.0], "cpu", 2, (), [0.9, 1.1, 1.3])
    assert "| plain PyTorch floor, torch.compile | 1.10 (0.90-1.30) | | 1.10x |" in text
    assert "channels-last" not in text
    without_pfl = vs_pfl.table([], {"sequential": [1.5]}, [1.0], "cpu", 2)
    assert "| radbo sequential | 1.50 | | 1.50x |" in without_pfl


def test_profile_maps_a_sides_round_beside_the_floor(tmp_path, capsys):
    """``--profile TOP`` compares nothing: each side's last round under cProfile, its TOP
    functions by own time, with the floor measured before and after the side."""
    vs_pfl = load_script()
    args = vs_pfl.parse_args(
        ["--clients", "4", "--per-round", "2", "--rounds", "2", "--profile", "5"]
        + ["--backends", "sequential:channels_last", "--data", str(tmp_path / "data")]
    )
    vs_pfl.write_data(Path(args.data), args.clients)
    text = vs_pfl.profile_sides(Path(args.data), args)
    head = text.splitlines()[0]
    assert head.startswith("## radbo sequential:channels_last: ")
    assert "the last profiled), floor " in head and "(channels-last)" in head
    assert "Ordered by: internal time" in text and "due to restriction <5>" in text
    result = vs_pfl.radbo_side(
        Path(args.data), "sequential", clients=4, per_round=2, rounds=3, profile_top=3
    )
    assert len(result["round_s"]) == 3
    # the profiled last round is left out of the median of the steady rounds
    assert result["s_per_round"] == result["round_s"][1]
    assert "restriction <3>" in result["profile"]
    assert "profile" not in vs_pfl.radbo_side(
        Path(args.data), "sequential", clients=4, per_round=2, rounds=2
    )
    with pytest.raises(SystemExit):
        vs_pfl.parse_args(["--profile", "-1"])
    assert "--profile must be >= 0" in capsys.readouterr().err
