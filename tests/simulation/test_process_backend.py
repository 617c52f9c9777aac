"""ProcessBackend (``[runtime] backend = "processes"``): a phase's clients run in parallel
single-threaded worker processes, and a run's results equal the sequential run's bitwise
(results.json rounds, ledger, totals and final state), the caller's torch thread count is
kept, and no worker process outlives a run -- also when it fails or is interrupted."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re

import psutil
import pytest
import torch

import radbo.experiment.runner as runner
from radbo.client import ClientBudget, ClientResult, ClientTask, CostRecord
from radbo.config import ConfigError, parse_config
from radbo.experiment import build, run
from radbo.problem import ClientData
from radbo.simulation import ClientWorkerError, ProcessBackend, SequentialBackend, processes
from radbo.simulation.processes import usable_cpus
from tests.configs import small_config
from tests.helpers import (
    assert_same_state,
    run_script,
    state_tensors,
    time_limit,
    unclocked_rows,
)

NO_BASELINE = {"enabled": False}

#: name -> overrides of the demo config (a few rounds, no baseline)
CASES: dict[str, dict] = {
    "fedavg": dict(algorithm={"name": "fedavg", "local_steps": 3}),
    "shrofbo": dict(
        algorithm={"name": "shrofbo"},
        fleet={"local_steps": "uniform", "local_steps_range": [1, 3]},
    ),
    "fedmbo-float64": dict(
        algorithm={"name": "fedmbo", "inner_steps": 2, "neumann_terms": 3, "clients_per_phase": 3},
        estimator={"name": "autograd"},
        mask={"policy": "none"},
        fleet={"capacities": [1.0]},
        runtime={"dtype": "float64"},
    ),
}


def children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def with_backend(overrides: dict, **runtime: object) -> dict:
    return {**overrides, "runtime": {**overrides.get("runtime", {}), **runtime}}


def rounds_json(rows: list[dict]) -> str:
    """Per-round rows as results.json writes them (so NaN metrics compare equal), without the
    measured wall time."""
    return json.dumps(unclocked_rows(rows))


# ------------------------------------------------------------------- equality with sequential
@pytest.mark.float_sensitive
def test_demo_run_equals_the_sequential_run_bitwise(tmp_path):
    """The demo config (RABO + CG, masks, device fleet, paired baseline), two rounds: the
    files a run writes and its final state are those of the sequential run."""
    before = torch.get_num_threads()
    out = {}
    for backend in ("sequential", "processes"):
        cfg = small_config(rounds=2, eval_every=1, runtime={"backend": backend, "workers": 2})
        result = run(cfg, progress=False, output_dir=tmp_path / backend)
        saved = json.loads((tmp_path / backend / "results.json").read_text())
        ledger = (tmp_path / backend / "ledger.json").read_text()
        out[backend] = (result, saved, ledger)
        assert torch.get_num_threads() == before
        assert children() == []
    (seq, seq_saved, seq_ledger), (par, par_saved, par_ledger) = out.values()
    assert rounds_json(seq_saved["rounds"]) == rounds_json(par_saved["rounds"])
    assert json.dumps(seq_saved["final"]) == json.dumps(par_saved["final"])
    assert seq_saved["totals"] == par_saved["totals"]
    assert seq_saved["baseline"]["totals"] == par_saved["baseline"]["totals"]
    assert seq_saved["savings"] == par_saved["savings"]
    assert seq_ledger == par_ledger
    assert_same_state(seq.state, par.state, tensors_only=True)
    assert seq.baseline is not None and par.baseline is not None
    assert_same_state(seq.baseline.state, par.baseline.state, tensors_only=True)


@pytest.mark.float_sensitive
@pytest.mark.parametrize("name", list(CASES))
def test_algorithm_run_equals_the_sequential_run_bitwise(name):
    overrides = dict(CASES[name], rounds=2, eval_every=2, baseline=NO_BASELINE)
    seq = run(
        small_config(**with_backend(overrides, backend="sequential")), progress=False, save=False
    )
    par = run(
        small_config(**with_backend(overrides, backend="processes", workers=2)),
        progress=False,
        save=False,
    )
    assert rounds_json(seq.rounds) == rounds_json(par.rounds)
    assert seq.ledger == par.ledger
    assert seq.totals == par.totals
    assert_same_state(seq.state, par.state, tensors_only=True)
    assert children() == []


@pytest.mark.float_sensitive
def test_simulation_driven_directly_equals_sequential_in_float64():
    """Driving a Simulation round by round, the backend as a context manager that stops the
    workers on leaving it."""
    cfg = small_config(rounds=2, baseline=NO_BASELINE, runtime={"dtype": "float64"})
    reference = build(cfg)
    want = list(reference.simulation.iterate(reference.initial_state, 2))
    exp = build(cfg)
    with ProcessBackend(2) as backend:
        exp.simulation.backend = backend
        got = list(exp.simulation.iterate(exp.initial_state, 2))
        assert len(backend.pids()) == 2 and len(children()) == 2
    assert not backend.running and children() == []
    for (sa, ra), (sb, rb) in zip(want, got, strict=True):
        assert_same_state(sa, sb, tensors_only=True)
        assert ra.ledger == rb.ledger
        assert json.dumps(ra.metrics) == json.dumps(rb.metrics)


def test_the_server_aggregates_on_the_workers_cpus(monkeypatch):
    """While the server aggregates, the workers are idle: the engine lets
    coverage_weighted_mean use their CPUs (ProcessBackend.server_threads; results do not depend
    on the count, tests/test_aggregation.py) where a tensor is big enough to be split (an MLP
    64-600-10: 38,400 weights in its first layer), and the sequential backend's server keeps
    the process's own count, as does the demo's MLP (no tensor of 32,768 elements); the count
    is back after every phase."""
    import radbo.aggregation as aggregation

    seen: list[int] = []
    real = aggregation._weighted_mean

    def spy(*args):
        shapes = args[2]
        big = any(math.prod(shape) >= 32768 for shape in shapes.values())
        seen.append(torch.get_num_threads() if big else -torch.get_num_threads())
        return real(*args)

    monkeypatch.setattr(aggregation, "_weighted_mean", spy)
    before = torch.get_num_threads()
    wide = {"name": "mlp", "hidden": [600]}
    # the thread counts seen, negative for aggregations of small tensors only
    for backend, model, threads in [
        (SequentialBackend(), wide, {before, -before}),
        (ProcessBackend(2), wide, {max(min(2, usable_cpus()), before), -before}),
        (ProcessBackend(2), None, {-before}),
    ]:
        seen.clear()
        exp = build(
            small_config(rounds=1, baseline=NO_BASELINE, **({"model": model} if model else {}))
        )
        exp.simulation.backend = backend
        list(exp.simulation.iterate(exp.initial_state, 1))
        if isinstance(backend, ProcessBackend):
            assert backend.server_threads == min(2, usable_cpus())
            backend.close()
        assert set(seen) == threads
        assert torch.get_num_threads() == before
    assert ProcessBackend(1).server_threads == 1
    assert ProcessBackend(64).server_threads == usable_cpus()  # no more than the CPUs


# ------------------------------------------------------------------- the pool's lifetime
def test_one_worker_runs_in_process():
    cfg = small_config(rounds=1, baseline=NO_BASELINE)
    exp = build(
        small_config(rounds=1, baseline=NO_BASELINE, runtime={"backend": "processes", "workers": 1})
    )
    assert isinstance(exp.simulation.backend, ProcessBackend)
    list(exp.simulation.iterate(exp.initial_state, 1))
    assert not exp.simulation.backend.running and children() == []
    assert build(cfg).simulation.backend.__class__ is SequentialBackend


def test_an_interrupted_run_leaves_no_worker(monkeypatch):
    """Ctrl-C (KeyboardInterrupt) between rounds: the runner closes the backend."""
    real_build = runner.build

    def interrupting(config):
        exp = real_build(config)
        evaluate = exp.simulation.evaluate
        calls = []

        def stop(state):
            # the first evaluation is the initial state's, before round 0
            calls.append(evaluate(state))
            if len(calls) == 2:
                assert len(children()) == 2  # the workers ran round 0
                raise KeyboardInterrupt
            return calls[-1]

        exp.simulation.evaluate = stop
        return exp

    monkeypatch.setattr(runner, "build", interrupting)
    before = torch.get_num_threads()
    cfg = small_config(
        rounds=2, eval_every=1, baseline=NO_BASELINE, runtime={"backend": "processes", "workers": 2}
    )
    with pytest.raises(KeyboardInterrupt):
        run(cfg, progress=False, save=False)
    assert children() == []
    assert torch.get_num_threads() == before


# plain client work for the mechanics tests: runs in a forked worker
PARENT = os.getpid()


def echo(runtime, task: ClientTask) -> ClientResult:
    """Doubles the received tensor; fails for clients 3 and 8; a worker dies on client 5."""
    if task.client in (3, 8):
        raise ValueError(f"client {task.client} cannot train")
    if task.client == 5 and os.getpid() != PARENT:
        os._exit(7)
    return ClientResult(task.client, {"w": 2 * task.params["w"]}, CostRecord(n_grad=1))


def threads(runtime, task: ClientTask) -> ClientResult:
    """Reports the worker's torch intra-op thread count."""
    return ClientResult(task.client, {}, CostRecord(), {"threads": torch.get_num_threads()})


def tasks(clients: list[int]) -> list[ClientTask]:
    return [
        ClientTask(
            client=c,
            round=0,
            phase="train",
            params={"w": torch.full((c + 1,), float(c))},  # bigger clients go out first
            index_set={"w": (None,)},
            data=ClientData(inner=torch.arange(2), outer=torch.arange(2)),
            seed=c,
            budget=ClientBudget(),
        )
        for c in clients
    ]


def test_results_come_back_in_task_order():
    with ProcessBackend(2) as backend:
        results = backend.run(echo, None, None, tasks([4, 0, 2, 1, 6]))  # type: ignore[arg-type]
    assert [r.client for r in results] == [4, 0, 2, 1, 6]
    for r in results:
        assert torch.equal(r.update["w"], torch.full((r.client + 1,), 2.0 * r.client))
    assert children() == []


def double(runtime, task: ClientTask) -> ClientResult:
    return echo(runtime, task)


def test_new_work_is_sent_to_the_workers_or_they_are_forked_anew():
    """A picklable work reaches the running workers; one that does not pickle (a closure)
    restarts them, so that the new workers inherit it."""
    runtime = object()  # stands for a ClientRuntime: inherited by the workers, never pickled
    with ProcessBackend(2) as backend:
        backend.run(echo, runtime, None, tasks([0, 1]))  # type: ignore[arg-type]
        first = backend.pids()
        backend.run(double, runtime, None, tasks([2, 1]))  # type: ignore[arg-type]
        assert backend.pids() == first  # the same workers, taught the new work

        def closure(rt, task):
            return echo(rt, task)

        results = backend.run(closure, runtime, None, tasks([4, 2]))  # type: ignore[arg-type]
        assert set(backend.pids()).isdisjoint(first)  # forked anew
        assert [r.client for r in results] == [4, 2]
        backend.run(echo, runtime, None, tasks([1]))  # type: ignore[arg-type]
        backend.run(double, runtime, None, tasks([1]))  # type: ignore[arg-type]
        backend.run(closure, runtime, None, tasks([1]))  # type: ignore[arg-type]
    assert children() == []


def test_a_run_starts_its_workers_once(monkeypatch):
    """RABO has two phases with different client work: one pool serves both."""
    starts = []
    real = processes._Pool.__init__

    def spy(self, *args):
        starts.append(args)
        real(self, *args)

    monkeypatch.setattr(processes._Pool, "__init__", spy)
    runtime = {"backend": "processes", "workers": 2}
    run(small_config(rounds=2, baseline=NO_BASELINE, runtime=runtime), progress=False, save=False)
    assert len(starts) == 1


def identity(runtime, task: ClientTask) -> ClientResult:
    """Sends the received tensors back."""
    return ClientResult(task.client, dict(task.params), CostRecord())


@pytest.mark.parametrize(
    "wire", ["shared memory", "pipe", "shared memory, small slots"], ids=lambda w: w
)
def test_tensors_cross_exactly_with_their_shapes_and_strides(wire, monkeypatch):
    """Both ways, on each wire: shared memory (the default), the pipe, and shared memory with
    slots of 256 bytes, where the bigger tensors of a message go in the pipe beside it."""
    if wire.endswith("small slots"):
        monkeypatch.setattr(processes, "_SLOT_BYTES", 256)
    base = torch.randn(40, 30, dtype=torch.float64)
    shared = torch.randn(3, 3)
    sent = {
        "block": base[3:7, 5:9],
        "transposed": base.t()[2:5],
        "column": base[:, 3],
        "expanded": torch.randn(4, 1).expand(4, 6),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "flags": torch.tensor([True, False, True]),
        "indices": torch.arange(1000)[500:510],
        "half": torch.randn(5).half(),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "twice": shared,
        "again": shared,
    }
    task = dataclasses.replace(tasks([0])[0], params=sent)
    with ProcessBackend(2, shared_memory=wire != "pipe") as backend:
        (result,) = backend.run(identity, None, None, [task])  # type: ignore[arg-type]
        arenas = backend._pool.arenas  # type: ignore[union-attr]
    assert all((a is None) == (wire == "pipe") for a in arenas)
    for name, t in sent.items():
        got = result.update[name]
        assert (got.dtype, got.shape, got.stride()) == (t.dtype, t.shape, t.stride()), name
        assert torch.equal(got, t), name
    assert result.update["twice"] is result.update["again"]  # one tensor sent twice is one back


def test_a_message_puts_its_tensors_in_the_next_slot_and_the_rest_in_the_pipe():
    """Messages take the arena's slots in turn; what does not fit in a slot goes in the pipe;
    a reader copies each tensor out, so a later message in the same slot leaves it intact."""
    arena = processes._Arena(slot_bytes=1024)
    small, big = torch.arange(10.0), torch.arange(300.0)  # 40 bytes, 1200 bytes: too big
    first = processes._pack({"small": small, "big": big}, arena)
    second = processes._pack({"small": -small}, arena)
    assert arena.written == 2
    assert len(first) > big.numel() * 4 > len(second)  # big travelled in the message itself
    read = processes._unpack(first, arena)
    assert torch.equal(read["small"], small) and torch.equal(read["big"], big)
    assert torch.equal(processes._unpack(second, arena)["small"], -small)  # the other slot
    third = processes._pack({"small": small + 100}, arena)  # slot 0 again: first's place
    assert torch.equal(read["small"], small)  # a copy: untouched by the slot's reuse
    assert torch.equal(processes._unpack(third, arena)["small"], small + 100)
    with pytest.raises(pickle.UnpicklingError, match="shared memory this pipe lacks"):
        processes._unpack(third, None)


def test_without_shared_memory_every_message_goes_in_the_pipe(monkeypatch):
    """Where no shared mapping can be made (an OSError from mmap), the pool runs on pipes."""

    def refuse(*args, **kwargs):
        raise OSError("no shared memory here")

    monkeypatch.setattr(processes.mmap, "mmap", refuse)
    assert processes._Arena.pair(1 << 20) is None
    with ProcessBackend(2) as backend:
        results = backend.run(echo, None, None, tasks([4, 0, 2]))  # type: ignore[arg-type]
        assert backend._pool.arenas == [None, None]  # type: ignore[union-attr]
    assert [r.client for r in results] == [4, 0, 2]
    assert all(
        torch.equal(r.update["w"], 2 * torch.full((r.client + 1,), float(r.client)))
        for r in results
    )


def test_workers_run_with_one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ProcessBackend(2) as backend:
            results = backend.run(threads, None, None, tasks([0, 1, 2]))  # type: ignore[arg-type]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert [r.metrics["threads"] for r in results] == [1.0, 1.0, 1.0]


def test_an_error_in_client_work_is_raised_with_the_workers_traceback():
    """Client 8 goes out first and fails, but client 3 comes first in task order: its error is
    the one raised, as in a sequential run."""
    with ProcessBackend(2) as backend, pytest.raises(ValueError, match="client 3 ") as info:
        backend.run(echo, None, None, tasks([0, 3, 8, 1]))  # type: ignore[arg-type]
    assert any("client 3's 'train' task" in note for note in info.value.__notes__)
    assert children() == []


def test_a_worker_that_dies_is_a_clear_error_not_a_hang():
    backend = ProcessBackend(2)
    with pytest.raises(ClientWorkerError, match=r"died with exit code 7 while running client 5"):
        backend.run(echo, None, None, tasks([0, 5, 1, 2]))  # type: ignore[arg-type]
    assert not backend.running and children() == []
    results = backend.run(echo, None, None, tasks([0, 1]))  # type: ignore[arg-type]
    assert [r.client for r in results] == [0, 1]  # a fresh pool after the failure
    backend.close()
    backend.close()  # idempotent
    assert children() == []


# ------------------------------------------------------------------- configuration
def test_workers_default_to_the_usable_cpus():
    cfg = small_config(runtime={"backend": "processes"})
    assert cfg.runtime.workers is None
    assert ProcessBackend().workers == usable_cpus() == len(os.sched_getaffinity(0))
    assert ProcessBackend(cfg.runtime.workers).workers == usable_cpus()


def test_unset_workers_stay_out_of_the_stored_config():
    """Configs stored before ``workers`` existed (checkpoints, results.json) still match."""
    default, set_ = small_config(), small_config(runtime={"backend": "processes", "workers": 2})
    assert "workers" not in default.model_dump(mode="json")["runtime"]
    assert set_.model_dump(mode="json")["runtime"]["workers"] == 2
    for cfg in (default, set_):
        assert parse_config(cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize("workers", [0, -2])
def test_bad_workers_is_a_config_error(workers):
    with pytest.raises(ConfigError, match=r"runtime\.workers = -?\d+: Input should be greater"):
        small_config(runtime={"backend": "processes", "workers": workers})
    with pytest.raises(ValueError, match="ProcessBackend.workers must be an integer >= 1"):
        ProcessBackend(workers)


# ------------------------------------------------------- messages larger than a pipe holds
def kill_workers() -> None:
    for child in children():
        child.kill()


def deadline(seconds: float):
    """A hang fails the test, it does not stop the suite: after ``seconds`` the worker
    processes are killed (so the backend's clean-up cannot block on them) and TimeoutError
    is raised (:func:`tests.helpers.time_limit`)."""
    return time_limit(seconds, on_expiry=kill_workers)


def grow(runtime, task: ClientTask) -> ClientResult:
    """Sends back three times the received tensor's numbers: results larger than tasks."""
    w = task.params["w"]
    return ClientResult(task.client, {"w": w, "more": torch.cat([w, -w])}, CostRecord())


def test_tasks_and_results_larger_than_a_pipe_holds_cross_both_ways():
    """Tasks of 4 MB (1M float32 numbers) and results of 12 MB, six of them on two workers, so
    that each worker holds a second task (the parent sends it while the worker sends its
    result): a pipe holds a few hundred kB, and before each worker read on a thread of its
    own, both sides blocked in sending for ever."""
    big = [
        dataclasses.replace(t, params={"w": torch.randn(1_000_000, generator=g)})
        for g in [torch.Generator().manual_seed(0)]
        for t in tasks([0, 1, 2, 4, 6, 7])
    ]
    with deadline(60), ProcessBackend(2) as backend:
        results = backend.run(grow, None, None, big)  # type: ignore[arg-type]
    assert [r.client for r in results] == [0, 1, 2, 4, 6, 7]
    for task, r in zip(big, results, strict=True):
        w = task.params["w"]
        assert torch.equal(r.update["w"], w) and torch.equal(r.update["more"], torch.cat([w, -w]))
    assert children() == []


def test_slots_are_reused_only_once_read_many_tasks_in_flight():
    """Forty tasks of different sizes on two workers that each hold a second task: every
    slot of both arenas is written many times, while the other is being read; each result
    must still be its own task's (a slot overwritten too early would mix them up)."""
    g = torch.Generator().manual_seed(1)
    many = [
        dataclasses.replace(t, params={"w": torch.randn(1000 * (1 + t.client % 7), generator=g)})
        for t in tasks(list(range(40)))
    ]
    with deadline(60), ProcessBackend(2) as backend:
        results = backend.run(grow, None, None, many)  # type: ignore[arg-type]
        written = [a[0].written for a in backend._pool.arenas]  # type: ignore[union-attr, index]
    assert sum(written) == 40 and min(written) > 2
    for task, r in zip(many, results, strict=True):
        w = task.params["w"]
        assert torch.equal(r.update["w"], w) and torch.equal(r.update["more"], torch.cat([w, -w]))
    assert children() == []


@pytest.mark.float_sensitive
def test_a_model_of_a_million_parameters_runs_and_equals_sequential():
    """The digits MLP with two hidden layers of 1024 (1.12M parameters, 4.5 MB per task and
    per update), FedAvg, 10 clients on 2 workers: the issue's hang (hidden = [1024] never
    finished round 0) gone, and the run bitwise the sequential one."""
    overrides = dict(
        CASES["fedavg"],
        model={"name": "mlp", "hidden": [1024, 1024]},
        rounds=1,
        eval_every=1,
        baseline=NO_BASELINE,
    )
    seq = run(
        small_config(**with_backend(overrides, backend="sequential")), progress=False, save=False
    )
    numbers = sum(t.numel() for t in state_tensors(seq.state).values())
    assert numbers > 1_000_000
    with deadline(300):
        par = run(
            small_config(**with_backend(overrides, backend="processes", workers=2)),
            progress=False,
            save=False,
        )
    assert rounds_json(seq.rounds) == rounds_json(par.rounds)
    assert seq.ledger == par.ledger
    assert_same_state(seq.state, par.state, tensors_only=True)
    assert children() == []


# ------------------------------------------------------------------- the benchmark scripts
def test_the_transfer_and_worker_benchmarks_run_both_wires():
    """``benchmarks/pipe_transfer.py`` and ``benchmarks/workers.py --wires shared pipe
    --one-thread-server`` at their smallest: both wires and both server thread counts
    measured, with the aggregation's time per round, the runs' states bitwise equal."""
    out = run_script("benchmarks/pipe_transfer.py", "--floats", "1000", "--repeats", "1")
    assert re.search(r"pipe *: +[\d.]+ ms", out) and re.search(r"shared: +[\d.]+ ms", out)
    out = run_script(
        "benchmarks/workers.py", "--rounds", "1", "--wires", "shared", "pipe", "--one-thread-server"
    )
    assert "speed-up, 2 workers vs 1 worker" in out
    assert "speed-up, 2 workers, tensors in the pipe vs 1 worker" in out
    assert "speed-up, 2 workers, aggregation on 1 thread vs 1 worker" in out
    assert re.search(r"2 workers: client phases [\d.]+ ms, aggregation [\d.]+ ms per round", out)
    assert re.search(r"1 worker: .*\(this process [\d.]+ ms, worker processes 0\.0 ms\)", out)
    assert re.search(r"2 workers: .*\(this process [\d.]+ ms, worker processes [\d.]+ ms\)", out)
    assert "final states bitwise equal: True" in out


def test_the_task_balance_benchmark_splits_every_phase():
    """``benchmarks/task_balance.py`` at its smallest: per phase, the tasks' sum against the
    best 2-worker split and the process backend's order, each a speed-up of at most 2x."""
    from benchmarks.task_balance import backend_split, best_split

    assert best_split([3.0, 3.0, 2.0, 2.0, 2.0]) == 6.0  # {3, 3} against {2, 2, 2}
    assert backend_split([3.0, 3.0, 2.0, 2.0, 2.0], [5, 4, 3, 2, 1]) == 7.0  # 3+2+2 | 3+2
    out = run_script("benchmarks/task_balance.py", "--rounds", "1", "--hidden", "16")
    phases = re.findall(
        r"tasks: sum +[\d.]+ ms; best split +[\d.]+ ms \(([\d.]+)x\); "
        r"backend's order +[\d.]+ ms \(([\d.]+)x\)",
        out,
    )
    assert phases and all(1.0 <= float(o) <= float(b) <= 2.0 for b, o in phases)
    assert re.search(r"all phases: [\d.]+ ms of tasks; on 2 workers at best [\d.]+x", out)


def test_the_cpu_scaling_benchmark_runs():
    """``benchmarks/cpu_scaling.py`` at its smallest: one process alone, two at once, and a
    speed-up between 0 and the process count."""
    out = run_script("benchmarks/cpu_scaling.py", "--hidden", "8", "--steps", "2", "--repeats", "1")
    assert re.search(r"1 process alone: [\d.]+ s", out)
    assert re.search(r"2 processes at once: [\d.]+ s", out)
    speed_up = float(re.search(r"speed-up the CPUs gave: ([\d.]+)x \(at most 2x\)", out)[1])
    assert speed_up > 0
