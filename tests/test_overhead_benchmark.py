"""benchmarks/overhead.py runs at its smallest size, writes its tables and the command, and its
plain PyTorch loop does the work the ledger records (FLOPs counted by FlopCounterMode).

Opt-in (``-m slow``): about ten seconds on one core.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests import helpers

ROOT = Path(__file__).resolve().parents[1]


def load_script() -> ModuleType:
    return helpers.load_script(ROOT / "benchmarks" / "overhead.py", "bench_overhead")


@pytest.mark.slow
def test_overhead_benchmark_writes_its_table_and_does_the_ledgers_work(tmp_path, capsys) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "overhead.md"
    args = ["--repeats", "1", "--configs", "demo", "--warmup-rounds", "0", "--out", str(out)]

    (result,) = load_script().main(args)

    table = out.read_text()
    assert "| demo (RABO, MLP 64-128-10, CG, masks) | sequential | 0 |" in table
    for phase in ("train.inner", "train.outer", "round"):
        assert f"| demo | {phase} |" in table
    assert "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --repeats 1" in table
    assert "OMP_NUM_THREADS=1" in capsys.readouterr().out
    # the plain loop's FLOPs are the ledger's: exactly in the inner phase, within 10 % over
    # the round, and exactly once radbo's extra metric forward of f is added (FLOPs are
    # integers counted from shapes: the same on every CPU)
    assert result.plain_flops["train.inner"] == result.ledger_flops["train.inner"] > 0
    assert abs(result.flop_ratio - 1.0) <= 0.10
    for phase, flops in result.ledger_flops.items():
        assert result.plain_flops[phase] + result.metric_flops[phase] == flops, phase
    # a steady round: no FLOP measurement while timing, the same work every time
    assert result.remeasured == 0
    assert result.same_work
    assert len(result.radbo_cpu) == len(result.plain_cpu) == 1
    assert torch.get_num_threads() == threads  # the caller's thread count is restored


@pytest.mark.float_sensitive
def test_plain_loop_hypergradient_is_radbos_bitwise_on_the_same_batches() -> None:
    """The plain loop's outer work is RABO's: on the batches radbo drew, its CG hypergradient
    equals each client's update bit for bit (one thread, float32; unclipped, as radbo clips
    with a float64 norm and the plain loop in float32). Two code paths, bitwise: they run the
    same aten ops on the same shapes in the same order, so whichever kernels
    ``ATEN_CPU_CAPABILITY`` selects run on both (measured equal under default, AVX2 and
    AVX-512); a tolerance would hide an op the plain loop does differently."""
    from radbo.algorithms.rabo import RABO
    from radbo.config import parse_config
    from radbo.experiment import build
    from radbo.experiment.runner import torch_threads

    script = load_script()
    config = script.demo_config()
    del config["algorithm"]["max_hypergrad_norm"]
    with torch_threads(1):
        exp = build(parse_config(config))
        sim = exp.simulation
        assert isinstance(sim.algorithm, RABO)
        recorder = script.RecordingBackend(sim.backend)
        sim.backend = recorder
        _, record = sim.step(exp.initial_state, 0)
        plain = script.plain_loop(sim, record, recorder.tasks)
        outer_phase = sim.algorithm.phases()[1]
        tasks = {t.client: t for t in recorder.tasks[script.OUTER]}
        jobs = [j for j in plain.jobs if j.phase == script.OUTER]

        for job in jobs:
            task = tasks[job.client]
            drawn = sim.algorithm.prepare_outer(sim.runtime, task).data
            expected = outer_phase.client(sim.runtime, task).update
            batches = [sim.runtime.batch(drawn[k]) for k in ("inner", "outer")]
            x, y = plain.load(job)

            got = plain.hypergradient(job, x, y, *[(b.inputs, b.targets) for b in batches])

            for name, tensor in zip(plain.x_names, got, strict=True):
                assert torch.equal(tensor, expected[name]), (job.client, name)
    assert len(jobs) == len(record.clients) > 1
