"""``[runtime] device``: the config checks run everywhere; the GPU runs only where torch sees a
CUDA device (skipped otherwise: CI has none, every number-comparing test runs on the CPU).

A GPU run draws what a CPU run draws (minibatches, clients, masks come from CPU generators) and
differs only by floating-point rounding. The runs are float64, so TF32 (which PyTorch applies,
where allowed, to float32 matmuls and convolutions only) plays no part, whatever
``torch.backends.cuda.matmul.allow_tf32`` says. In float64 a GPU reduction sums in another
order and CUDA's exp / log round differently, each within a few ulps: every value's rounding is
of the order of n * 2^-53 for its n <= ~10^3 summed terms (~1e-13), amplified over 2 rounds of
training by the dynamics. Both runs start from the same initial state and data (built on the
CPU). The CPU measures the effect of summing in another order from the same start: batched vs
sequential float64 runs of every algorithm (test_algorithm_conformance.py, test_batched.py: 2
and 3 rounds, few-shot Conv-4 and finite differences included) differ by at most 1.1e-13
relative under the default, AVX2 and AVX-512 kernels; the tests allow 1e-9 of a state's
largest magnitude (at least 1) and of the test loss, 1e4 x that. (Runs of one config under two
CPU kernels are no measure of it: PyTorch's seeded ``uniform_`` and ``randn`` differ in the
last float32 bit between the default and AVX2 kernels, so such runs start 7e-9 apart.) These
tests skip without a GPU (CI has none) and carry the ``float_sensitive`` marker for machines
that have one. Last run on a GPU on 2026-11-28, a lent H200 (torch 2.11.0+cu130): 25 passed,
1 skipped (the no-GPU check) in 55 s (BENCHMARKS.md, section GPU), before the tests of
``[runtime] cuda_graphs`` and of ``auto`` running out of memory (the last two here) were
written: those have not run on a GPU.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from radbo.cli import main
from radbo.config import ConfigError, parse_config
from radbo.experiment.runner import run
from tests.configs import demo_dict

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _config(device: str, **overrides: Any):
    """The demo config for 2 rounds in float64 on ``device``, on the sequential backend unless
    ``runtime`` names another; an override of None removes the section, and ``[mask] policy =
    "none"`` drops the per-tier capacities."""
    data = demo_dict()
    data.update(rounds=2, eval_every=2, baseline={"enabled": False})
    for key, value in overrides.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    if data.get("mask", {}).get("policy") == "none":
        data["fleet"].pop("capacities", None)
    runtime = {"backend": "sequential", **data.get("runtime", {})}
    data["runtime"] = {**runtime, "dtype": "float64", "device": device}
    return parse_config(data)


def test_device_defaults_to_cpu_and_is_left_out_of_dumps():
    config = parse_config(demo_dict())
    assert config.runtime.device == "cpu"
    assert "device" not in config.model_dump()["runtime"]
    assert parse_config({"runtime": {"device": "cuda:1"}}).runtime.device == "cuda:1"


@pytest.mark.parametrize("device", ["gpu", "cuda:", "tpu", "CUDA", "cuda:x"])
def test_a_device_name_radbo_does_not_know_is_a_config_error(device: str):
    with pytest.raises(ConfigError, match=r"runtime\.device"):
        parse_config({"runtime": {"device": device}})


def test_a_gpu_with_worker_processes_is_refused():
    with pytest.raises(ConfigError, match='device = "cuda" needs backend = .*"sequential"'):
        parse_config({"runtime": {"device": "cuda", "backend": "processes"}})


@pytest.mark.skipif(CUDA, reason="checks the machine without a CUDA device")
def test_cuda_without_a_gpu_is_one_line_and_exit_code_2(tmp_path: Path, capsys):
    config = tmp_path / "gpu.toml"
    config.write_text('rounds = 1\n[runtime]\ndevice = "cuda"\n')
    assert main(["run", str(config), "--quiet", "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        'config error: runtime.device = "cuda": no CUDA device is available to torch here '
        '(torch.cuda.is_available() is False); use "cpu"'
    )


def _states_close(cpu: Any, gpu: Any) -> None:
    for field in dataclasses.fields(cpu):
        a, b = getattr(cpu, field.name), getattr(gpu, field.name)
        if not isinstance(a, dict):
            continue
        for name, t in a.items():
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_floating_point():  # flags and counters may stay on the CPU
                assert b[name].device.type == "cuda", f"{field.name}/{name} left the GPU"
                tol = 1e-9 * max(1.0, float(t.abs().max()))
                diff = float((t - b[name].cpu()).abs().max())
                assert diff <= tol, f"{field.name}/{name}: {diff:.3g} > {tol:.3g}"
            else:
                assert torch.equal(t, b[name].cpu()), f"{field.name}/{name}"


FEW_SHOT = {
    "partition": {"kind": "iid"},
    "model": {"name": "conv4", "width": 8},
    "task": {"name": "few_shot", "ways": 5, "shots": 1, "queries": 5, "test_episodes": 20},
    "fleet": {"num_clients": 3, "capacities": [1.0, 0.5, 0.25]},
    "mask": {"policy": "importance"},
    "algorithm": {"name": "rabo", "inner_steps": 2},
}
FULL = {"mask": {"policy": "none"}}
CASES = {
    "rabo-cg": {},
    "rabo-batched": {"runtime": {"backend": "batched"}},
    # 40 non-iid clients, most holding less than a minibatch: ragged cohorts padded (their
    # index tensors live on the CPU, the labels they mask on the GPU; that mix once failed)
    "rabo-padded": {
        "runtime": {"backend": "batched"},
        "fleet": {**demo_dict()["fleet"], "num_clients": 40},
    },
    # all 8,320 coordinates of x, 256 per gradient of g: one at a time took over 100 s on an
    # H100 (one launch sequence per coordinate); test_fd_batched.py has batch = one at a time
    "rafbo-fd": {
        "algorithm": {"name": "rafbo"},
        "estimator": {"name": "finite_difference", "coordinate_batch": 256},
    },
    "shrofbo-batched": {
        "algorithm": {"name": "shrofbo"},
        "estimator": None,
        "runtime": {"backend": "batched"},
    },
    "simfbo": {"algorithm": {"name": "simfbo"}, "estimator": None},
    "fedavg": {"algorithm": {"name": "fedavg", "lr": 0.1}, "estimator": None},
    "fedmbo": {"algorithm": {"name": "fedmbo"}, "estimator": None, **FULL},
    "fedmsa": {"algorithm": {"name": "fedmsa"}, "estimator": None, **FULL},
    "fednest": {"algorithm": {"name": "fednest"}, "estimator": None, **FULL},
    "aggitd": {"algorithm": {"name": "aggitd"}, "estimator": None, **FULL},
    "fedsvrbgd_fo": {"algorithm": {"name": "fedsvrbgd_fo"}, "estimator": None, **FULL},
    "cnn": {"model": {"name": "cnn"}},
    # the CNN's minibatches in NHWC layout on both devices (cuDNN's channels-last kernels)
    "cnn-channels-last": {"model": {"name": "cnn"}, "runtime": {"memory_format": "channels_last"}},
}


@pytest.mark.float_sensitive
@needs_cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gpu_run_equals_the_cpu_run_up_to_rounding(case: str):
    cpu = run(_config("cpu", **CASES[case]), progress=False, save=False)
    gpu = run(_config("cuda", **CASES[case]), progress=False, save=False)
    _states_close(cpu.state, gpu.state)
    for key in ("flops", "bytes_up", "bytes_down", "sim_time_s"):
        assert cpu.totals[key] == gpu.totals[key], key
    assert abs(cpu.final["test_loss"] - gpu.final["test_loss"]) <= 1e-9 * cpu.final["test_loss"]


@needs_cuda
def test_the_flat_scatter_on_the_gpu_adds_in_client_order():
    """add_at_many's GPU default (one ordered accumulation per chunk) equals add_at called
    client after client on the GPU, bitwise: CUDA's accumulating index_put_ adds the
    duplicates of a coordinate in the order they are listed (1,000 clients, up to 1,000
    values per coordinate)."""
    from radbo.masks.index import add_at, add_at_many

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randperm(64, generator=gen)[:k].sort()[0] for k in (64, 32, 16)]
    cols = [torch.randperm(128, generator=gen)[:k].sort()[0] for k in (128, 64, 32)]
    entries = [(rows[i % 3], cols[i % 3]) if i % 3 else (None, None) for i in range(1000)]
    values = [
        torch.randn(len(rows[i % 3]), len(cols[i % 3]), generator=gen).cuda() for i in range(1000)
    ]
    loop = torch.zeros(64, 128, dtype=torch.float64, device="cuda")
    for entry, value in zip(entries, values, strict=True):
        add_at(loop, entry, value)
    flat = torch.zeros_like(loop)
    add_at_many(flat, entries, values)
    assert torch.equal(flat, loop)


@pytest.mark.float_sensitive
@needs_cuda
def test_few_shot_conv4_runs_on_the_gpu_like_on_the_cpu():
    data = {**FEW_SHOT, "rounds": 2, "eval_every": 2, "runtime": {"dtype": "float64"}}
    cpu = run(parse_config(data), progress=False, save=False)
    data["runtime"] = {"dtype": "float64", "device": "cuda"}
    gpu = run(parse_config(data), progress=False, save=False)
    _states_close(cpu.state, gpu.state)
    # an accuracy is a count of argmax hits: equal unless a logit pair ties within rounding
    # (~1e-12 here); measured equal under the default and AVX2 CPU kernels even from initial
    # states 7e-9 apart (final states 2e-6 apart)
    assert cpu.final["test_accuracy"] == pytest.approx(gpu.final["test_accuracy"], abs=1e-9)


@pytest.mark.float_sensitive
@needs_cuda
def test_a_gpu_run_is_reproducible_and_resumes_from_its_checkpoint(tmp_path: Path):
    """Bitwise on one GPU: the demo's MLP runs cuBLAS GEMMs (the same algorithm for the same
    shapes on one device) and index_add_ / scatter with distinct indices, none of CUDA's
    atomic-order kernels (index_add_ with repeated indices, adaptive pooling's backward), so two
    runs round alike."""
    config = _config("cuda", rounds=3, eval_every=3)
    first = run(config, progress=False, save=False)
    second = run(config, progress=False, save=False)
    for name, t in first.state.x.items():
        assert torch.equal(t, second.state.x[name]), name
    half = _config("cuda", rounds=2, eval_every=3, checkpoint_every=1)
    run(half, progress=False, output_dir=tmp_path)
    whole = _config("cuda", rounds=3, eval_every=3, checkpoint_every=1)
    resumed = run(whole, progress=False, output_dir=tmp_path, resume=True)
    for name, t in first.state.x.items():
        assert torch.equal(t, resumed.state.x[name]), name


@pytest.mark.float_sensitive
@needs_cuda
def test_a_stacked_cohorts_convolutions_and_poolings_on_the_gpu(monkeypatch):
    """radbo's batching of a stacked cohort's convolutions and max-poolings
    (``_StackedConv2d``, ``_StackedMaxPool2d``, every layer taken) on the GPU: a CNN body's
    output and gradients equal vmap's own rules on the GPU, and the same functions on the CPU.
    float64; the sums: a first-layer output of 27 products, a second-layer one of 72, a weight
    gradient of 5 x 14 x 14 = 980 (batch x output positions) plus what flows from the layer
    after; two orders of n terms differ by at most about ``2 n u`` of their magnitudes
    (``u = 2^-53``), here ``2 (980 + 72 + 27) u = 2.4e-13``; the tolerance is 1e-11 relative,
    1e-12 absolute for sums that cancel."""
    from torch import nn

    from radbo.models import functional
    from radbo.models.functional import apply_layer

    body = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3), nn.ReLU(),
        nn.MaxPool2d(2),
    ).double()  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    state = {
        k: torch.stack([v.detach() + 0.1 * torch.randn(v.shape, generator=gen) for _ in range(3)])
        for k, v in body.state_dict().items()
    }
    images = torch.randn(3, 5, 3, 32, 32, generator=gen, dtype=torch.float64)

    def outputs(device: str, min_numel: int) -> list[torch.Tensor]:
        monkeypatch.setattr(functional, "STACKED_CONV_MIN_NUMEL", min_numel)
        params = {k: v.to(device).requires_grad_(True) for k, v in state.items()}
        out = torch.vmap(lambda s, i: apply_layer(body.to(device), "", s, i))(
            params, images.to(device)
        )
        grads = torch.autograd.grad(out.tanh().sum(), list(params.values()))
        return [t.cpu() for t in (out, *grads)]

    ours = outputs("cuda", 0)
    for ref in (outputs("cuda", 1 << 62), outputs("cpu", 0)):
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.float_sensitive
@pytest.mark.filterwarnings("error:.*capturing phase:RuntimeWarning")
@pytest.mark.parametrize(
    "estimator",
    [
        {"name": "cg"},
        {"name": "finite_difference", "num_coordinates": 16, "coordinate_batch": 8},
        {"name": "cg", "uneven": True},  # clients of 1 to 4 local steps: masked in the graph
        # FedAvg's local steps (HeteroFL-like masks of the demo), clients of 1 to 4 steps
        {"name": "fedavg", "uneven": True, "algorithm": {"name": "fedavg", "local_steps": 3}},
        # ShroFBO's simultaneous steps with the exact products, clients of 1 to 4 steps
        {"name": "shrofbo", "uneven": True, "algorithm": {"name": "shrofbo"}},
        # FedSVRBGD-FO's iterations with the STORM correction, its first round from line 1
        {
            "name": "fedsvrbgd_fo",
            "uneven": True,
            "algorithm": {"name": "fedsvrbgd_fo", "momentum": 0.5},
        },
        # FedNest's steps on y and x (full model), and its eager phases between them
        {
            "name": "fednest",
            "algorithm": {"name": "fednest", "local_steps": 2, "outer_local_steps": 2},
            "mask": {"policy": "none"},
        },
    ],
    ids=lambda e: e["name"] + ("-uneven" if e.get("uneven") else ""),
)
@needs_cuda
def test_cuda_graphs_replay_rabos_phases_like_the_eager_run(monkeypatch, estimator):
    """``[runtime] cuda_graphs``: RABO's two phases (and the local steps of FedAvg, ShroFBO,
    FedSVRBGD-FO and FedNest) captured once per padded cohort shape and
    replayed in later rounds (CG masked, not stopped, inside the capture; finite differences'
    check of a vanishing step deferred to after the replay; clients of unequal step counts
    masked by counts on the device) give the eager
    batched GPU run's states, float64, 40 non-iid demo
    clients (ragged minibatches padded) over 4 rounds. The bound is the module's 1e-9 of a
    state's largest magnitude: a padded cohort runs kernels of another batch size, which may
    sum in another order (rounding of ~1e3 terms, ~1e-13). Ledgers are identical; stacked
    cohorts went through the cache, no capture fell back to eager (a warning would fail the
    test: it runs with warnings as errors), and later rounds replayed earlier captures
    (a replay that read stale inputs would differ by far more than the bound)."""
    from radbo.graphs import PhaseGraphs

    calls: list[int] = []
    captures: list[int] = []
    run_phase, record = PhaseGraphs.run, PhaseGraphs._record

    def spy_run(self, key, fn, inputs, clients):
        calls.append(clients)
        return run_phase(self, key, fn, inputs, clients)

    def spy_record(self, fn, inputs):
        captures.append(1)
        return record(self, fn, inputs)

    monkeypatch.setattr(PhaseGraphs, "run", spy_run)
    monkeypatch.setattr(PhaseGraphs, "_record", spy_record)
    estimator = dict(estimator)
    fleet = {**demo_dict()["fleet"], "num_clients": 40}
    if estimator.pop("uneven", False):
        fleet.update(local_steps="uniform", local_steps_range=[1, 4])
    sections: dict[str, Any] = {"estimator": estimator}
    if "algorithm" in estimator:  # an algorithm with its default estimator
        sections = {"algorithm": estimator["algorithm"], "estimator": None}
        if "mask" in estimator:
            sections["mask"] = estimator["mask"]
    eager = run(
        _config("cuda", runtime={"backend": "batched"}, fleet=fleet, rounds=4, **sections),
        progress=False,
        save=False,
    )
    assert calls == [] and captures == []
    graphed = run(
        _config(
            "cuda",
            runtime={"backend": "batched", "cuda_graphs": True},
            fleet=fleet,
            rounds=4,
            **sections,
        ),
        progress=False,
        save=False,
    )
    assert len(calls) >= 8 and 1 <= len(captures) < len(calls)
    for block in ("x", "y"):
        for name, t in getattr(eager.state, block).items():
            other = getattr(graphed.state, block)[name]
            tol = 1e-9 * max(1.0, float(t.abs().max()))
            assert float((t - other).abs().max()) <= tol, f"{block}/{name}"
    for key in ("flops", "bytes_up", "bytes_down", "sim_time_s"):
        assert eager.totals[key] == graphed.totals[key], key


@pytest.mark.float_sensitive
@needs_cuda
def test_auto_chunks_a_stack_that_runs_out_of_gpu_memory():
    """``auto`` (which stacks every family on a GPU) under a memory cap halfway between a
    round's peak one client at a time and its peak with every group stacked: the stacks that
    do not fit raise ``torch.OutOfMemoryError``, are halved until they fit (``limits``), and
    the round equals the CPU's sequential round up to rounding, as every GPU run here does.
    The cap is ``torch.cuda.set_per_process_memory_fraction`` on the reserved memory; a wide
    MLP (2048 x 2048 hidden, 4.3 M numbers per client, float64) makes the two peaks hundreds
    of MB apart. Written without a GPU to run it on (2026-12-07)."""
    from radbo.experiment import build
    from radbo.simulation import AutoBackend, BatchedBackend

    wide = {"model": {"name": "mlp", "hidden": [2048, 2048]}, "rounds": 1, **FULL}

    def round_on(device: str, backend: Any) -> tuple[Any, int]:
        """The state after round 0 with ``backend``, and the peak reserved GPU memory."""
        gc.collect()  # the previous round's engine, held in reference cycles
        torch.cuda.empty_cache()
        exp = build(_config(device, **wide))
        exp.simulation.backend = backend
        torch.cuda.reset_peak_memory_stats()
        state, _ = exp.simulation.step(exp.initial_state, 0)
        return state, torch.cuda.max_memory_reserved()

    # [1]: the measuring rounds' states are dropped at once, so no round holds another's
    one = round_on("cuda", BatchedBackend(max_group=1))[1]
    stacked = round_on("cuda", BatchedBackend())[1]
    if stacked - one < 256 << 20:
        pytest.skip(f"the stacked round needs only {(stacked - one) >> 20} MB more to cap")
    total = torch.cuda.get_device_properties(0).total_memory
    backend = AutoBackend()
    try:
        torch.cuda.set_per_process_memory_fraction((one + (stacked - one) // 2) / total)
        chunked, _ = round_on("cuda", backend)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert backend.limits and set(backend.plan.values()) == {"stacked"}
    reference = run(_config("cpu", **wide), progress=False, save=False)
    _states_close(reference.state, chunked)
