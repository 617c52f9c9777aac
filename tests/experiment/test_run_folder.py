"""The run folder (issue 28): paths the system refuses are one line and exit code 2, found
before round 0; one writer per folder (``radbo.lock``: a second run is refused naming the
first's PID, a stale lock of a dead process is taken over); results that cannot be written
(disk full, a read-only folder) are one line, exit code 2."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import radbo
import radbo.experiment.runner as runner
from radbo.cli import main
from radbo.experiment import RunFolderBusyError, RunFolderError, run_folder_contents
from radbo.experiment.lock import LOCK_FILE, lock_holder, lock_run_folder
from tests.configs import DEMO, small_config

TINY = (
    'rounds = 1\neval_every = 1\n[fleet]\nnum_clients = 3\n[model]\nname = "mlp"\nhidden = [16]\n'
)
RADBO = Path(sys.executable).with_name("radbo")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


@pytest.fixture
def no_rounds(monkeypatch):
    """Fail the test if the run gets as far as building and running: each refusal below must
    come before round 0 (it used to come after the last round or at the first checkpoint)."""

    def started(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "_run", started)


# -- paths the system refuses ----------------------------------------------------------------
LONG = "a" * 300  # a file name over the 255 bytes of most file systems


def test_an_output_folder_name_too_long_is_one_line(tiny, tmp_path, capsys, no_rounds):
    out = tmp_path / LONG
    assert main(["run", str(tiny), "--quiet", "--output-dir", str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(out) in line and "File name too long" in line


def test_an_output_dir_too_long_in_the_config_is_one_line(tiny, tmp_path, capsys, no_rounds):
    """The same path from the config (not the command line): refused by the runner."""
    out = tmp_path / LONG / "run"
    assert main(["run", str(tiny), "--quiet", f'output_dir="{out}"']) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("config error: output_dir = ") and str(out) in line
    assert "File name too long" in line


@pytest.mark.parametrize("where", ["--output-dir", "config"])
def test_an_output_dir_with_a_nul_character_is_one_line(tiny, tmp_path, capsys, no_rounds, where):
    out = f"{tmp_path}/x\0y"
    if where == "config":
        argv = ["run", str(tiny), "--quiet", f'output_dir="{tmp_path}/x\\u0000y"']
    else:
        argv = ["run", str(tiny), "--quiet", "--output-dir", out]
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err)
    assert repr(out) in line and "NUL" in line
    assert "\0" not in line  # shown escaped, not as a raw byte


def test_the_python_api_refuses_such_paths_alike(tmp_path, no_rounds):
    cfg = small_config(rounds=1)
    with pytest.raises(RunFolderError, match="File name too long"):
        radbo.run(cfg, output_dir=tmp_path / LONG, progress=False)
    with pytest.raises(RunFolderError, match="NUL"):
        radbo.run(cfg, output_dir=f"{tmp_path}/x\0y", progress=False)


# what a run writes, occupied by the other kind: a folder for a file, a file for a folder
SQUATTERS = {
    "results.json as a folder": ("results.json", "dir"),
    "ledger.json as a folder": ("ledger.json", "dir"),
    "checkpoints as a file": ("checkpoints", "file"),
    "checkpoints/run as a file": ("checkpoints/run", "file"),
    "the lock file as a folder": (LOCK_FILE, "dir"),
}


@pytest.mark.parametrize("flag", ["--overwrite", "--resume", None])
@pytest.mark.parametrize("case", list(SQUATTERS))
def test_a_folder_for_a_file_or_a_file_for_a_folder_is_refused_before_round_0(
    tiny, tmp_path, capsys, no_rounds, case, flag
):
    """The run used to finish its work and then crash on results.json (losing the results),
    or crash at its first checkpoint."""
    name, kind = SQUATTERS[case]
    out = tmp_path / "out"
    path = out / name
    path.parent.mkdir(parents=True)
    if kind == "dir":
        path.mkdir()
    else:
        path.write_text("not radbo's")
    argv = ["run", str(tiny), "--quiet", "--output-dir", str(out)]
    assert main(argv if flag is None else [*argv, flag]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(path) in line, line
    assert path.exists()  # nothing of the user's is removed


def test_report_and_export_paths_are_one_line(tmp_path, capsys):
    out = f"{tmp_path}/x\0y"
    for argv in (
        ["report", str(tmp_path), "--output", out],
        ["report", str(tmp_path / LONG)],
        ["export", str(tmp_path / LONG)],
        ["export", str(tmp_path), "--checkpoint", str(tmp_path / LONG)],
        ["fleet", str(tmp_path / LONG)],
    ):
        assert main(argv) == 2, argv
        line = one_line(capsys.readouterr().err)
        assert (repr(out) if "\0" in argv[-1] else LONG) in line


# -- results that cannot be written -------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_results_that_cannot_be_written_are_one_line(tiny, tmp_path, capsys, monkeypatch, code):
    """Disk full or a folder turned read-only at the end of the run (simulated: the tests may
    run as root, whom a read-only mode does not stop)."""

    def full(result, out):
        raise OSError(code, os.strerror(code), str(out / "results.json"))

    monkeypatch.setattr(runner, "save_results", full)
    out = tmp_path / "out"
    assert main(["run", str(tiny), "--quiet", "--output-dir", str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert str(out / "results.json") in line and os.strerror(code) in line
    assert not (out / LOCK_FILE).exists()  # released on the error too


def test_a_bug_in_radbo_stays_a_traceback(tiny, tmp_path, monkeypatch):
    """Not every ValueError is a path problem: one raised by radbo's own code is not turned
    into a one-line user error."""

    def bug(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(runner, "_run", bug)
    with pytest.raises(ValueError, match="a bug"):
        main(["run", str(tiny), "--quiet", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()  # the lock released, the empty folder removed


# -- one writer per run folder ------------------------------------------------------------------
def test_a_held_lock_refuses_a_second_run_naming_the_pid(tiny, tmp_path, capsys, no_rounds):
    """The lock is a flock: a second open of the file in this very process conflicts too."""
    out = tmp_path / "out"
    out.mkdir()
    with lock_run_folder(out):
        assert lock_holder(out)["pid"] == os.getpid()
        for flag in ("--overwrite", "--resume"):
            assert main(["run", str(tiny), "--quiet", "--output-dir", str(out), flag]) == 2
            line = one_line(capsys.readouterr().err)
            assert f"PID {os.getpid()} on {socket.gethostname()}" in line and str(out) in line
        with pytest.raises(RunFolderBusyError, match=f"PID {os.getpid()}"):
            radbo.run(small_config(rounds=1), output_dir=out, progress=False)
    assert not (out / LOCK_FILE).exists()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_a_stale_lock_of_a_dead_process_is_taken_over(tiny, tmp_path, capsys):
    """A lock file left by a run that was killed (kill -9): its PID is gone; the next run
    takes the folder over, and a folder holding only a lock holds no run (no --overwrite)."""
    out = tmp_path / "out"
    out.mkdir()
    stale = {"pid": dead_pid(), "host": socket.gethostname(), "started": 0.0}
    (out / LOCK_FILE).write_text(json.dumps(stale))
    assert run_folder_contents(out) == []
    assert main(["run", str(tiny), "--quiet", "--output-dir", str(out)]) == 0
    assert (out / "results.json").is_file()
    assert not (out / LOCK_FILE).exists()  # released at the end


def test_a_malformed_lock_file_without_a_holder_is_taken_over(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_bytes(b"\x00garbage")
    with lock_run_folder(out) as lock:
        assert lock_holder(out)["pid"] == os.getpid()
        assert lock.path == out / LOCK_FILE


def test_the_lock_does_not_break_overwrite_resume_or_the_folder_checks(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    run = ["run", str(tiny), "--quiet", "--output-dir", str(out)]
    assert main([*run, "--checkpoint-every", "1"]) == 0
    assert run_folder_contents(out) == ["results.json", "checkpoints/run"]
    assert main(run) == 2  # holds a run: refused without --overwrite, as before
    assert "already holds a run" in one_line(capsys.readouterr().err)
    assert main([*run, "--overwrite"]) == 0
    assert main([*run, "--rounds", "2", "--checkpoint-every", "1", "--resume"]) == 0
    assert not (out / LOCK_FILE).exists()


def wait_for(condition, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the first run ended early ({proc.returncode}): {err}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_two_concurrent_runs_into_one_folder_the_second_is_refused(tmp_path, capsys):
    """A real `radbo run` in a subprocess (the demo: many seconds) holds the folder; a second
    `radbo run` (and `--resume`) into it, here in this process, is refused with one line
    naming the first's PID. Killed (kill -9), the first leaves its lock file behind, stale:
    the next run takes it over."""
    out = tmp_path / "out"
    first = subprocess.Popen(
        [str(RADBO), "run", str(DEMO), "--quiet", "--output-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: (lock_holder(out) or {}).get("pid") == first.pid, 120, first)
        for flag in ("--overwrite", "--resume"):
            assert main(["run", str(DEMO), "--quiet", "--output-dir", str(out), flag]) == 2
            line = one_line(capsys.readouterr().err)
            assert f"PID {first.pid}" in line and str(out) in line
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    assert lock_holder(out)["pid"] == first.pid  # left behind
    with lock_run_folder(out):
        assert lock_holder(out)["pid"] == os.getpid()


class NoFlock:
    """fcntl on a file system without flock (some network mounts): every flock fails."""

    LOCK_EX, LOCK_NB = 2, 4

    @staticmethod
    def flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_without_flock_the_pid_decides(tmp_path, monkeypatch):
    import radbo.experiment.lock as lock_module

    monkeypatch.setattr(lock_module, "fcntl", NoFlock)
    out = tmp_path / "out"
    out.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        holder = {"pid": alive.pid, "host": socket.gethostname(), "started": 0.0}
        (out / LOCK_FILE).write_text(json.dumps(holder))
        with pytest.raises(RunFolderBusyError, match=f"PID {alive.pid}"):
            lock_run_folder(out)
    finally:
        alive.kill()
        alive.wait(timeout=60)
    (out / LOCK_FILE).write_text(json.dumps({**holder, "pid": dead_pid()}))
    with lock_run_folder(out):
        assert lock_holder(out)["pid"] == os.getpid()
    assert not (out / LOCK_FILE).exists()


def test_the_lock_doctest_holds():
    import doctest

    import radbo.experiment.lock

    assert doctest.testmod(radbo.experiment.lock).failed == 0
