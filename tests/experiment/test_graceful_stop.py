"""Graceful stop (issue 28): SIGINT / SIGTERM during `radbo run` finish the round in progress,
write a checkpoint (also without checkpoint_every) and the results so far, print one line and
exit with 130 / 143; `--resume` then gives what an uninterrupted run gives, bitwise. A second
signal stops at once. In this process (the signal raised from inside a round) and, marked
slow, as a real `radbo run` subprocess signalled from outside."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import radbo
from radbo.cli import main
from radbo.experiment import RunStopped, stop_on_signals
from radbo.experiment.lock import LOCK_FILE
from radbo.simulation import Simulation
from tests.configs import DEMO, small_config
from tests.helpers import comparable_results

RADBO = Path(sys.executable).with_name("radbo")
# the demo (a run and its baseline), short
SHORT = ["rounds=4", "eval_every=2"]


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def signal_at(monkeypatch, run: int, round_index: int, signum: int, times: int = 1) -> None:
    """Raise ``signum`` ``times`` times in this process while round ``round_index`` of the
    ``run``-th simulation (0: the main run, 1: its baseline) runs, once."""
    real_step = Simulation.step
    sims: list[int] = []
    fired = [False]

    def step(self, state, round, clock_s=0.0):
        if id(self) not in sims:
            sims.append(id(self))
        if not fired[0] and sims.index(id(self)) == run and round == round_index:
            fired[0] = True
            for _ in range(times):
                signal.raise_signal(signum)
        return real_step(self, state, round, clock_s)

    monkeypatch.setattr(Simulation, "step", step)


def final_tensors(out: Path) -> dict[str, torch.Tensor]:
    """The final state: checkpoints/final, or the last checkpoint with checkpoint_every."""
    folder = out / "checkpoints" / "final"
    if not folder.is_dir():
        folder = out / "checkpoints" / "run"
    index = json.loads((folder / "checkpoint.json").read_text())
    return load_file(folder / index["files"]["tensors"]["file"])


def assert_same_run(a: Path, b: Path) -> None:
    drop = ("config", "overrides")  # the config names the output folder
    ra, rb = comparable_results(a, drop=drop), comparable_results(b, drop=drop)
    assert ra["rounds"] == rb["rounds"]
    assert ra == rb
    assert (a / "ledger.json").read_text() == (b / "ledger.json").read_text()
    ta, tb = final_tensors(a), final_tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    assert main(["run", str(DEMO), *SHORT, "--quiet", "--output-dir", str(out)]) == 0
    return out


# -- in this process ----------------------------------------------------------------------
CASES = {
    # (signal, run, round index it comes in, extra words, rounds the results hold, where)
    "SIGTERM in the run": (signal.SIGTERM, 0, 1, [], 2, "after round 2 of 4"),
    "SIGINT in the run": (signal.SIGINT, 0, 0, [], 1, "after round 1 of 4"),
    "SIGTERM in the last round, before the baseline": (
        signal.SIGTERM,
        0,
        3,
        [],
        4,
        "after round 4 of 4, before the baseline",
    ),
    "SIGINT in the baseline": (signal.SIGINT, 1, 1, [], 4, "after round 2 of 4 of the baseline"),
    "SIGTERM with checkpoint_every": (
        signal.SIGTERM,
        0,
        2,
        ["--checkpoint-every", "2"],
        3,
        "after round 3 of 4",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_signal_stops_after_the_round_and_resume_is_bitwise(
    tmp_path, capsys, monkeypatch, uninterrupted, case
):
    signum, which, round_index, extra, rounds, where = CASES[case]
    out = tmp_path / "out"
    argv = ["run", str(DEMO), *SHORT, "--quiet", "--output-dir", str(out), *extra]
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal_at(monkeypatch, which, round_index, signum)

    assert main(argv) == 128 + signum
    captured = capsys.readouterr()
    line = one_line(captured.err)
    name = signal.Signals(signum).name
    assert line.startswith(f"radbo: stopped by {name} {where}: checkpoint in {out}")
    command = " ".join(["radbo run", str(DEMO), *SHORT, "--output-dir", str(out), *extra])
    assert line.endswith(f"; continue with {command} --quiet --resume")
    assert captured.out == ""
    assert {s: signal.getsignal(s) for s in before} == before  # restored
    assert not (out / LOCK_FILE).exists()
    results = json.loads((out / "results.json").read_text())
    assert results["stopped"] == f"{name} {where}"
    assert len(results["rounds"]) == rounds
    index = json.loads((out / "checkpoints" / "run" / "checkpoint.json").read_text())
    assert index["rounds_done"] == rounds
    if which == 1:
        assert len(results["baseline"]["rounds"]) == 2 and results["savings"] is None
    # the final state to export: only once the (main) run has done its last round
    assert (out / "checkpoints" / "final").exists() == (rounds == 4)

    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
    assert "stopped" not in json.loads((out / "results.json").read_text())
    assert_same_run(out, uninterrupted)


def test_a_second_signal_stops_at_once(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    signal_at(monkeypatch, 0, 1, signal.SIGTERM, times=2)
    assert main(["run", str(DEMO), *SHORT, "--quiet", "--output-dir", str(out)]) == 143
    line = one_line(capsys.readouterr().err)
    assert line.startswith("radbo: stopped at once by a second SIGTERM, mid-round")
    assert not (out / LOCK_FILE).exists()
    assert not (out / "results.json").exists()


def test_the_python_api_stops_under_stop_on_signals(tmp_path, monkeypatch):
    cfg = small_config(rounds=3, eval_every=1, baseline={"enabled": False})
    whole = radbo.run(cfg, output_dir=tmp_path / "whole", progress=False)
    signal_at(monkeypatch, 0, 0, signal.SIGTERM)
    with stop_on_signals(), pytest.raises(RunStopped) as stop:
        radbo.run(cfg, output_dir=tmp_path / "cut", progress=False)
    assert stop.value.signum == signal.SIGTERM and stop.value.output_dir == tmp_path / "cut"
    assert stop.value.result.stopped == "SIGTERM after round 1 of 3"
    assert len(stop.value.result.rounds) == 1
    monkeypatch.undo()
    resumed = radbo.run(cfg, output_dir=tmp_path / "cut", progress=False, resume=True)
    assert [r["round"] for r in resumed.rounds] == [0, 1, 2]
    assert resumed.final == whole.final and resumed.totals == whole.totals


def test_without_a_handler_nothing_changes(tmp_path, monkeypatch):
    """radbo.run installs no handler: outside stop_on_signals, SIGINT is the
    KeyboardInterrupt it always was."""
    cfg = small_config(rounds=2, baseline={"enabled": False})
    signal_at(monkeypatch, 0, 0, signal.SIGINT)
    # Python's own handler for the test: an in-process Flower run earlier in this process
    # (flwr's register_signal_handlers) may have left its handler installed, and then SIGINT
    # is not a KeyboardInterrupt whatever radbo does (seen once under pytest-xdist)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            radbo.run(cfg, output_dir=tmp_path / "out", progress=False)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not (tmp_path / "out" / LOCK_FILE).exists()


# -- a real radbo run, signalled from outside -----------------------------------------------
def run_until(argv: list[str], err_file: Path, seen: str, signum: int, timeout_s: float = 600):
    """Start ``radbo run ...``; once its stderr shows ``seen``, send ``signum``; wait for it."""
    with err_file.open("w") as err:
        proc = subprocess.Popen([str(RADBO), "run", *argv], stdout=subprocess.PIPE, stderr=err)
    try:
        deadline = time.monotonic() + timeout_s
        while seen not in err_file.read_text():
            assert proc.poll() is None, err_file.read_text()
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)
        proc.send_signal(signum)
        proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    return proc.returncode, err_file.read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "seen"),
    [(signal.SIGTERM, "radbo: round 4/20"), (signal.SIGINT, "baseline: round 4/20")],
    ids=["SIGTERM-in-the-run", "SIGINT-in-the-baseline"],
)
def test_a_signalled_radbo_run_resumes_to_the_uninterrupted_run(tmp_path, signum, seen):
    """`radbo run` (progress lines on stderr, not --quiet) is sent ``signum`` once round 4 of
    the run (or of its baseline) is done: exit 128 + signum, the progress lines and one line;
    `--resume` then equals an uninterrupted run: results.json, ledger, final state tensors."""
    args = [str(DEMO), "rounds=20", "eval_every=5"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    subprocess.run(
        [str(RADBO), "run", *args, "--quiet", "--output-dir", str(whole)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    code, err = run_until([*args, "--output-dir", str(cut)], tmp_path / "err", seen, signum)
    assert code == 128 + signum, err
    *progress, last = err.splitlines()
    assert all(p.startswith(("radbo: round", "baseline: round")) for p in progress), err
    name = signal.Signals(signum).name
    assert last.startswith(f"radbo: stopped by {name} after round ") and "--resume" in last
    assert not (cut / LOCK_FILE).exists()
    resumed = subprocess.run(
        [str(RADBO), "run", *args, "--quiet", "--output-dir", str(cut), "--resume"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(cut, whole)


def test_signals_reach_only_the_cli_handler_in_the_main_thread():
    """Outside the main thread stop_on_signals changes nothing (Python cannot install a
    handler there) instead of failing."""
    import threading

    seen = []

    def worker():
        with stop_on_signals():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    assert seen == [before]


def test_the_stop_doctest_holds():
    import doctest

    import radbo.experiment.stop

    assert doctest.testmod(radbo.experiment.stop).failed == 0


def test_a_process_forked_from_the_run_keeps_the_default_sigterm():
    """A ProcessBackend worker is forked from the run and inherits its handler: there a
    SIGTERM (the pool terminating a straggler) still ends the process."""
    import os

    read, write = os.pipe()
    with stop_on_signals():
        pid = os.fork()
        if pid == 0:  # the child: say it runs (a signal before that is lost), wait
            os.write(write, b"1")
            time.sleep(60)
            os._exit(0)
        assert os.read(read, 1) == b"1"
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    os.close(read)
    os.close(write)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def test_the_processes_backend_stops_and_resumes(tmp_path, capsys, monkeypatch):
    """Against an uninterrupted sequential run: the processes backend equals it bitwise (the
    default ``auto`` backend stacks the demo's families, equal to it to rounding only)."""
    sequential = tmp_path / "sequential"
    argv = ["run", str(DEMO), *SHORT, "runtime.backend=sequential", "--quiet"]
    assert main([*argv, "--output-dir", str(sequential)]) == 0
    out = tmp_path / "out"
    argv = ["run", str(DEMO), *SHORT, "runtime.backend=processes", "runtime.workers=2"]
    argv += ["--quiet", "--output-dir", str(out)]
    signal_at(monkeypatch, 0, 1, signal.SIGTERM)
    assert main(argv) == 143
    assert one_line(capsys.readouterr().err).startswith("radbo: stopped by SIGTERM after round 2")
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
    assert_same_run(out, sequential)
