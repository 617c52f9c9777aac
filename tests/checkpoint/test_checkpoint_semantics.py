"""Checkpoints checked for meaning, not only integrity (issue 28, items 3, 5 and 7).

A checkpoint is a file a user can edit: SHA-256 proves it is the file that was written, not
that it makes sense. Each case here edits a checkpoint a real run wrote and re-signs every
hash, so that only the checks of its meaning can refuse it: shapes and dtypes against the
run's state, counters against the history, finite values where a number is expected, the
engine's state against the engine. A refused newest checkpoint falls back to the previous one
(a :class:`CheckpointWarning`) and the resumed run equals the uninterrupted one bitwise; with
no previous checkpoint, ``radbo run --resume`` prints one line and exits 2. Writes the system
refuses (a full disk, a read-only folder) are one line, and the checkpoints before stay.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import radbo.checkpoint as checkpoint
from radbo.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    save_checkpoint,
)
from radbo.cli import main
from radbo.config import parse_config
from radbo.experiment import run
from radbo.simulation import RUN_CHECKPOINT
from tests.checkpoint import test_checkpoint_integrity as integrity
from tests.helpers import time_limit

TINY = {
    "eval_every": 2,
    "checkpoint_every": 1,
    "fleet": {"num_clients": 3},
    "model": {"name": "mlp", "hidden": [16]},
}
ROUNDS = 6


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of ROUNDS rounds with a checkpoint after each (the newest after round 6,
    the previous after round 5)."""
    out = tmp_path_factory.mktemp("whole")
    run(parse_config({**TINY, "rounds": ROUNDS}), progress=False, output_dir=out)
    return out


@pytest.fixture
def cut(whole: Path, tmp_path: Path) -> Path:
    """A copy of the finished run, to damage."""
    out = tmp_path / "cut"
    shutil.copytree(whole, out)
    (out / "results.json").unlink()
    (out / "ledger.json").unlink()
    return out


def folder(out: Path) -> Path:
    return out / "checkpoints" / "run"


def resume(out: Path, rounds: int = ROUNDS) -> Any:
    return run(
        parse_config({**TINY, "rounds": rounds}), progress=False, output_dir=out, resume=True
    )


def results(out: Path) -> tuple[dict[str, Any], str | None]:
    """results.json without what differs between equal runs (the config's output folder,
    wall-clock times) and the fallback reason, which is returned beside it."""
    data = json.loads((out / "results.json").read_text())
    data.pop("config")
    fallback = data.pop("resumed_from_fallback", None)
    for row in data["rounds"]:
        row.pop("wall_time_s")
    return data, fallback


def sign_file(index: Path, kind: str) -> None:
    """Record the true SHA-256 of the ``kind`` file in ``index`` and re-sign the index."""
    data = json.loads(index.read_text())
    digest = hashlib.sha256((index.parent / data["files"][kind]["file"]).read_bytes()).hexdigest()
    integrity.rewrite_index(index, lambda d: d["files"][kind].update(sha256=digest))


def edit_index(out: Path, tamper: Callable[[dict], object], name: str = "checkpoint.json"):
    integrity.rewrite_index(folder(out) / name, tamper)


def edit_history(out: Path, tamper: Callable[[dict], object]) -> None:
    index = folder(out) / "checkpoint.json"
    path = folder(out) / json.loads(index.read_text())["files"]["history"]["file"]
    data = json.loads(path.read_text())
    tamper(data)
    path.write_text(json.dumps(data))
    sign_file(index, "history")


def edit_tensors(out: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    index = folder(out) / "checkpoint.json"
    path = folder(out) / json.loads(index.read_text())["files"]["tensors"]["file"]
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    sign_file(index, "tensors")


def assert_falls_back_to_equal_run(whole: Path, cut: Path, reason: str) -> None:
    """The resume warns, continues from the previous checkpoint and ends as the
    uninterrupted run did, number for number."""
    with pytest.warns(CheckpointWarning, match="resuming from the previous checkpoint") as rec:
        result = resume(cut)
    message = str(rec[0].message)
    assert reason in message and "\n" not in message, message
    assert result.resumed_from_fallback is not None and reason in result.resumed_from_fallback
    saved, fallback = results(cut)
    assert fallback == result.resumed_from_fallback
    assert saved == results(whole)[0]
    assert (cut / "ledger.json").read_text() == (whole / "ledger.json").read_text()


# -- the examples: fall back to the previous checkpoint, the same results ----------

FALLBACKS: dict[str, tuple[Callable[[Path], object], str]] = {
    # rounds_done set back from 6 to 4: used to resume and write rounds [0,1,2,3,4,5,4,5]
    "rounds_done set back": (
        lambda out: edit_index(out, lambda d: d.update(rounds_done=4)),
        "says 4 rounds are done, but its history history-000006.json holds 6",
    ),
    "rounds_done set forward": (
        lambda out: edit_index(out, lambda d: d.update(rounds_done=9)),
        "says 9 rounds are done",
    ),
    # used to be accepted
    "clock far in the past": (
        lambda out: edit_index(out, lambda d: d.update(clock_s=-1e300)),
        "clock_s = -1e+300, but the clock after round 5 is 0.0",
    ),
    "clock ahead of the rows": (
        lambda out: edit_index(out, lambda d: d.update(clock_s=12.5)),
        "clock_s = 12.5, but the clock after round 5 is 0.0",
    ),
    # used to be carried into results.json
    "NaN accuracy in the history": (
        lambda out: edit_history(out, lambda d: d["rows"][3].update(test_accuracy=float("nan"))),
        "rows[3]: test_accuracy = nan is not a finite number",
    ),
    "infinite cost in the history": (
        lambda out: edit_history(out, lambda d: d["rows"][0].update(cost_flops=float("inf"))),
        "rows[0]: cost_flops = inf is not a finite number >= 0",
    ),
    "NaN compute time in the ledger": (
        lambda out: edit_history(out, lambda d: d["ledger"][2].update(compute_s=float("nan"))),
        "ledger[2].compute_s = nan: Input should be a finite number",
    ),
    "negative wall time": (
        lambda out: edit_history(out, lambda d: d["rows"][1].update(wall_time_s=-1.0)),
        "rows[1].wall_time_s = -1.0: Input should be greater than or equal to 0",
    ),
    "rows renumbered": (
        lambda out: edit_history(out, lambda d: d["rows"][4].update(round=3)),
        "rows[4] is of round 3, not 4",
    ),
    "a row duplicated": (
        lambda out: edit_history(out, lambda d: d["rows"].insert(2, dict(d["rows"][2]))),
        "holds 7",
    ),
    "a ledger row of a round not done": (
        lambda out: edit_history(out, lambda d: d["ledger"][-1].update(round=6)),
        "is of round 6, but 6 rounds are done",
    ),
    "a ledger row of a client not sampled": (
        lambda out: edit_history(out, lambda d: d["ledger"][0].update(client=7)),
        "charges client 7, which round 0 did not sample",
    ),
    "a rejected count that is not its list's": (
        lambda out: edit_history(out, lambda d: d["rows"][2].update(rejected_updates=2)),
        "rejected_updates = 2, but the round lists 0 such clients",
    ),
    # used to be refused outright although the previous checkpoint was intact
    "a format tag one version back": (
        lambda out: edit_index(out, lambda d: d.update(format="radbo-checkpoint/1")),
        "is a radbo-checkpoint/1 checkpoint",
    ),
    # used to load and crash a later round
    "a coverage mask of the wrong shape": (
        lambda out: edit_tensors(
            out, lambda t: t.update({"sim/coverage/x/body.0.weight": torch.ones(3, 3).bool()})
        ),
        "tensor 'coverage/x/body.0.weight' is torch.bool (3, 3), this run's mask of "
        "'body.0.weight' is torch.bool (16, 64)",
    ),
    "a coverage mask of the wrong dtype": (
        lambda out: edit_tensors(
            out,
            lambda t: t.update({"sim/coverage/y/head.bias": torch.ones(10, dtype=torch.uint8)}),
        ),
        "is torch.uint8 (10,)",
    ),
    "a coverage mask missing": (
        lambda out: edit_tensors(out, lambda t: t.pop("sim/coverage/y/head.bias")),
        "the never-trained masks of block 'y' are of ['head.weight']",
    ),
    "a coverage history a round short": (
        lambda out: edit_index(out, lambda d: d["simulation"]["coverage"]["x"]["history"].pop()),
        "the coverage history of 'x' has 5 rounds",
    ),
    "a coverage block dropped": (
        lambda out: edit_index(out, lambda d: d["simulation"]["coverage"].pop("y")),
        "the engine tracks coverage of ['x'], the rounds report ['x', 'y']",
    ),
    "an engine tensor this run does not have": (
        lambda out: edit_tensors(out, lambda t: t.update({"sim/extra": torch.zeros(2)})),
        "the engine state holds tensors this run does not: ['extra']",
    ),
    "the guard's previous state of the wrong shape": (
        lambda out: edit_tensors(
            out, lambda t: t.update({"sim/divergence_previous/y/head.bias": torch.zeros(11)})
        ),
        "checkpoint tensor 'y/head.bias' is torch.float32 (11,), this run has torch.float32 (10,)",
    ),
    "the guard's last good round after the rounds done": (
        lambda out: edit_index(out, lambda d: d["simulation"]["divergence"].update(good_rounds=9)),
        "the divergence guard's good_rounds is 9, but the rounds give 6",
    ),
    "the guard's rollbacks not those of the rounds": (
        lambda out: edit_index(out, lambda d: d["simulation"]["divergence"].update(rollbacks=2)),
        "the divergence guard's rollbacks is 2, but the rounds give 0",
    ),
    "the guard diverging after a round that passed": (
        lambda out: edit_index(out, lambda d: d["simulation"]["divergence"].update(diverging=True)),
        "the divergence guard's diverging is True, but the rounds give False",
    ),
    "a ledger row's FLOPs not in its round's costs": (
        lambda out: edit_history(out, lambda d: d["ledger"][1].update(flops=1)),
        "round 0's cost_energy_unpriced_flops, cost_flops are not the sums of its ledger rows",
    ),
    "a ledger row deleted": (
        lambda out: edit_history(out, lambda d: d["ledger"].pop(4)),
        "are not the sums of its ledger rows",
    ),
    "a round's coverage not its history's": (
        lambda out: edit_history(out, lambda d: d["rows"][2].update(coverage_x_min=1.0)),
        "round 2 reports coverage_x_min = 1.0, its coverage history 3.0",
    ),
    "a coverage history's running C* wrong": (
        lambda out: edit_index(
            out,
            lambda d: d["simulation"]["coverage"]["y"]["history"][4].update(min_coverage_so_far=1),
        ),
        "the coverage history of 'y' has C* so far 1 in its round 4, not 3",
    ),
    "a coverage history of another model size": (
        lambda out: edit_index(
            out,
            lambda d: [e.update(numel=99) for e in d["simulation"]["coverage"]["x"]["history"]],
        ),
        "the coverage history of block 'x' counts other than this run's 1040 entries",
    ),
    "a never-trained mask that is not the history's": (
        lambda out: edit_tensors(
            out, lambda t: t["sim/coverage/x/body.0.bias"].view(-1)[:4].fill_(False)
        ),
        "hold 4 of 1040 entries never trained, not the fraction its coverage history ends with",
    ),
    "a state scalar set to null": (
        lambda out: edit_index(out, lambda d: d["state_scalars"].update(round=None)),
        "state field 'round' is None in the checkpoint, not of this run's type (int)",
    ),
    "the FLOP meter's state deleted": (
        lambda out: edit_index(out, lambda d: d["simulation"].pop("flop_meter")),
        "the engine state has no FLOP meter state; this run's FLOP meter is on",
    ),
    "a FLOP meter with more cache than measurements": (
        lambda out: edit_index(out, lambda d: d["simulation"]["flop_meter"].update(measurements=1)),
        "the FLOP meter made 1 measurements but caches 2",
    ),
    "a state tensor of another dtype": (
        lambda out: edit_tensors(
            out, lambda t: t.update({"x/body.0.bias": torch.zeros(16).double()})
        ),
        "checkpoint tensor 'x/body.0.bias' is torch.float64 (16,), this run has torch.float32 (16,)",
    ),
    "a state tensor of another shape": (
        lambda out: edit_tensors(out, lambda t: t.update({"y/head.weight": torch.zeros(16, 10)})),
        "'y/head.weight' is torch.float32 (16, 10), this run has torch.float32 (10, 16)",
    ),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_a_checkpoint_that_makes_no_sense_falls_back_to_the_previous(whole, cut, case):
    damage, reason = FALLBACKS[case]
    damage(cut)
    assert_falls_back_to_equal_run(whole, cut, reason)


def test_an_index_over_its_size_cap_is_refused_from_its_size(whole, cut):
    """A 30 GiB index (sparse: no disk used) is refused from its size on disk, before a byte
    is read: it used to raise MemoryError, with no fallback."""
    index = folder(cut) / "checkpoint.json"
    os.truncate(index, 30 << 30)
    with time_limit(60):
        assert_falls_back_to_equal_run(whole, cut, "checkpoint.json is 32,212,254,720 bytes")


def test_a_tensor_file_larger_than_the_state_is_refused_from_its_size(whole, cut):
    index = json.loads((folder(cut) / "checkpoint.json").read_text())
    tensors = folder(cut) / index["files"]["tensors"]["file"]
    os.truncate(tensors, 10 << 30)
    with time_limit(60):
        assert_falls_back_to_equal_run(whole, cut, f"{tensors.name} is 10,737,418,240 bytes")


def test_a_fifo_in_place_of_a_checkpoint_file_does_not_block(whole, cut):
    index = json.loads((folder(cut) / "checkpoint.json").read_text())
    tensors = folder(cut) / index["files"]["tensors"]["file"]
    tensors.unlink()
    os.mkfifo(tensors)
    with time_limit(60):
        assert_falls_back_to_equal_run(whole, cut, f"{tensors} is not a regular file")


def test_an_index_that_is_a_folder_falls_back_then_cannot_be_replaced(cut):
    """The previous checkpoint is resumed from; the next save cannot put its index where the
    folder is: one line naming it (radbo deletes no folder it did not make)."""
    index = folder(cut) / "checkpoint.json"
    index.unlink()
    index.mkdir()
    with pytest.warns(
        CheckpointWarning, match=f"{index} is not a regular file; resuming from the previous"
    ):
        with pytest.raises(CheckpointError) as err:
            resume(cut)
    assert str(err.value) == (
        f"cannot write the checkpoint file {index}: Is a directory; the checkpoints written "
        "before are kept"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_an_unreadable_index_falls_back(whole, cut):
    index = folder(cut) / "checkpoint.json"
    index.chmod(0)
    assert_falls_back_to_equal_run(whole, cut, f"cannot read {index}: Permission denied")


def test_both_checkpoints_unusable_is_one_error_naming_both(cut):
    edit_index(cut, lambda d: d.update(rounds_done=4))
    edit_index(cut, lambda d: d.update(clock_s=-1.0), name="checkpoint-prev.json")
    with pytest.raises(CheckpointCorruptError) as err:
        resume(cut)
    message = str(err.value)
    assert "\n" not in message
    assert "says 4 rounds are done" in message
    assert "the previous checkpoint is refused too" in message and "clock_s = -1.0" in message


def test_a_different_config_is_still_refused_without_fallback(cut):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError) as err:
            run(
                parse_config({**TINY, "rounds": ROUNDS, "seed": 3}),
                progress=False,
                output_dir=cut,
                resume=True,
            )
    assert not isinstance(err.value, CheckpointCorruptError)
    assert "different config (seed: 0 then, 3 now)" in str(err.value)


def test_a_checkpoint_without_a_guard_state_starts_the_guard_afresh(whole, cut):
    """An engine state written before the divergence guard existed has none: the guard starts
    at the resumed round (here no round trips it, so the run is the uninterrupted one)."""
    edit_index(cut, lambda d: d["simulation"].pop("divergence"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        result = resume(cut)
    assert result.resumed_from_fallback is None
    assert results(cut)[0] == results(whole)[0]


def test_divergences_without_a_guard_state_are_refused(whole, cut):
    def tamper(d: dict) -> None:
        d["rows"][2]["divergence"] = {"round": 2, "reason": "x", "action": "warn"}

    edit_history(cut, tamper)
    edit_index(cut, lambda d: d["simulation"].pop("divergence"))
    assert_falls_back_to_equal_run(
        whole, cut, "rounds record divergences, but the engine state has no divergence guard"
    )


def test_nan_in_an_algorithm_metric_means_nothing_measured_and_loads(whole, cut):
    """A NaN round metric of the algorithm (its mean over no client results) is what a run
    writes for a phase no result reached: it is not refused."""
    edit_history(cut, lambda d: d["rows"][1].update(outer_loss=float("nan")))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        result = resume(cut)
    assert result.resumed_from_fallback is None
    assert result.rounds[1]["outer_loss"] != result.rounds[1]["outer_loss"]


# -- no previous checkpoint: one line, exit code 2 -------------------------------------------

CLI_CASES: dict[str, tuple[Callable[[Path], object], str]] = {
    "rounds_done set back": FALLBACKS["rounds_done set back"],
    "clock far in the past": FALLBACKS["clock far in the past"],
    "NaN accuracy in the history": FALLBACKS["NaN accuracy in the history"],
    "a coverage mask of the wrong shape": FALLBACKS["a coverage mask of the wrong shape"],
    "a format tag one version back": FALLBACKS["a format tag one version back"],
    "an index of 30 GiB": (
        lambda out: os.truncate(folder(out) / "checkpoint.json", 30 << 30),
        "checkpoint.json is 32,212,254,720 bytes, more than the",
    ),
}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished run of ROUNDS rounds made by ``radbo run`` with one checkpoint, after the
    last round (nothing to fall back to); its config file and output folder."""
    base = tmp_path_factory.mktemp("cli")
    config = base / "run.toml"
    config.write_text(
        f"rounds = {ROUNDS}\neval_every = 2\n[fleet]\nnum_clients = 3\n[model]\n"
        'name = "mlp"\nhidden = [16]\n'
    )
    out = base / "out"
    assert main(cli_args(config, out)) == 0
    assert not (folder(out) / "checkpoint-prev.json").exists()
    return config, out


def cli_args(config: Path, out: Path) -> list[str]:
    return ["run", str(config), "--quiet", "--output-dir", str(out), "--checkpoint-every", "6"]


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_without_a_previous_checkpoint_resume_is_one_line_and_exit_2(
    cli_run, tmp_path, capsys, case
):
    config, whole_out = cli_run
    out = tmp_path / "out"
    shutil.copytree(whole_out, out)
    damage, reason = CLI_CASES[case]
    damage(out)
    capsys.readouterr()
    with time_limit(120):
        assert main([*cli_args(config, out), "--resume", "--rounds", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and reason in err, err


# -- leftover temporary files ----------------------------------------------------------------

LEFTOVERS = (
    ".state-000004.safetensors.k2j4h1.tmp",
    ".history-000006.json.abc_12.tmp",
    ".checkpoint.json.x9y8z7.tmp",
    ".checkpoint-prev.json.q1w2e3.tmp",
)


def test_leftover_temporary_files_are_removed_on_resume(whole, cut):
    for name in LEFTOVERS:
        (folder(cut) / name).write_bytes(b"half a file")
    (folder(cut) / ".notes.tmp").write_text("not radbo's")  # not a checkpoint's: kept
    (folder(cut) / "keep.txt").write_text("not radbo's")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        resume(cut)
    left = sorted(p.name for p in folder(cut).iterdir())
    assert not set(LEFTOVERS) & set(left)
    assert ".notes.tmp" in left and "keep.txt" in left
    assert results(cut)[0] == results(whole)[0]


def test_leftover_temporary_files_are_removed_on_save(tmp_path):
    integrity.save(tmp_path, 1)
    for name in LEFTOVERS:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / ".state-000009.safetensors.dir.tmp").mkdir()  # not a file: kept
    integrity.save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".state-000009.safetensors.dir.tmp",
        "checkpoint-prev.json",
        "checkpoint.json",
        "history-000001.json",
        "history-000002.json",
        "state-000001.safetensors",
        "state-000002.safetensors",
    ]


# -- a write the system refuses: one line, the checkpoints before intact ---------------------


@pytest.mark.parametrize(
    ("failing", "file"),
    [
        (1, "state-000002.safetensors"),
        (2, "history-000002.json"),
        (3, "checkpoint-prev.json"),
        (4, "checkpoint.json"),
    ],
)
def test_disk_full_during_a_save_is_one_line_and_keeps_the_checkpoint(
    tmp_path, monkeypatch, failing, file
):
    """The n-th file of a save fails to reach the disk (ENOSPC from fsync): one
    CheckpointError naming it, no temporary file, none of the save's files left, and the
    checkpoint before loads as it was."""
    integrity.save(tmp_path, 1)
    before = sorted(p.name for p in tmp_path.iterdir())
    real_fsync = os.fsync
    calls = [0]

    def fsync(fd: int) -> None:
        calls[0] += 1
        if calls[0] == failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    with pytest.raises(CheckpointError) as err:
        integrity.save(tmp_path, 2)
    monkeypatch.undo()
    assert str(err.value) == (
        f"cannot write the checkpoint file {tmp_path / file}: No space left on device; the "
        "checkpoints written before are kept"
    )
    left = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in left if n.endswith(".tmp")]
    # the previous index is a copy of the current one once written (failing == 4)
    assert [n for n in left if n != "checkpoint-prev.json"] == before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt = integrity.load(tmp_path)
    assert ckpt.rounds_done == 1 and integrity.same_state(ckpt.state, integrity.state(1))


def test_a_failed_tensor_write_removes_its_temporary_file(tmp_path, monkeypatch):
    integrity.save(tmp_path, 1)

    def broken(tensors: dict, path: str) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(CheckpointError, match=r"state-000002\.safetensors: No space left"):
        integrity.save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.json",
        "history-000001.json",
        "state-000001.safetensors",
    ]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes whatever the permissions")
def test_a_read_only_folder_is_one_line_and_keeps_the_checkpoint(tmp_path):
    integrity.save(tmp_path, 1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(CheckpointError) as err:
            integrity.save(tmp_path, 2)
    finally:
        tmp_path.chmod(0o755)
    assert "\n" not in str(err.value) and "Permission denied" in str(err.value)
    assert str(tmp_path) in str(err.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert integrity.load(tmp_path).rounds_done == 1


def test_disk_full_during_a_run_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    config = tmp_path / "run.toml"
    config.write_text(
        'rounds = 3\n[fleet]\nnum_clients = 3\n[model]\nname = "mlp"\nhidden = [16]\n'
    )
    out = tmp_path / "out"
    args = ["run", str(config), "--quiet", "--output-dir", str(out), "--checkpoint-every", "1"]
    real_save = checkpoint.save_file
    saves = [0]

    def save_file(tensors: dict, path: str) -> None:
        saves[0] += 1
        if saves[0] == 2:  # the checkpoint after round 2
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "state-000002.safetensors: No space left on device" in err
    monkeypatch.undo()
    index = json.loads((folder(out) / "checkpoint.json").read_text())
    assert index["rounds_done"] == 1
    assert not [p for p in folder(out).iterdir() if p.name.endswith(".tmp")]
    assert main([*args, "--resume"]) == 0  # continues from round 1


def test_unit_checks_of_counters(tmp_path):
    """load_checkpoint's counter checks without a run (the state of test_checkpoint_integrity)."""
    save_checkpoint(
        tmp_path,
        contents=RUN_CHECKPOINT,
        config={"seed": 0},
        state=integrity.state(2),
        rounds_done=2,
        clock_s=3.0,
        rows=[{**integrity.ROW, "round": r, "sim_clock_s": 1.5 * (2 - r)} for r in range(2)],
        ledger=[],
        sim_tensors={},
        sim_meta={"coverage": {}, "flop_meter": None},
    )
    with pytest.raises(CheckpointCorruptError, match=r"rows\[1\]\.sim_clock_s = 1\.5 is before"):
        load_checkpoint(tmp_path, template=integrity.state(0), contents=RUN_CHECKPOINT)
