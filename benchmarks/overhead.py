"""radbo's steady round against a plain PyTorch loop of the same work (issue 12, item 7).

For each config (``demo``: ``examples/demo.toml``, RABO on the digits MLP with a CG
hypergradient and masked submodels; ``cnn7``: the same run with FedNest's 7-layer CNN on the
digits upsampled to 28x28), the script advances the run ``--warmup-rounds`` rounds, runs the
next round once to fill the FLOP meter's cache and record every client's task, and then times
that same round again and again: a *steady round* (no FLOP measurement, the same work every
time).

The **plain loop** does, for every ledger entry of that round, the forward / backward /
Hessian-vector-product work the ledger records (``LedgerEntry.n_grad``, ``n_hvp``,
``samples``), written the way a user would write it in plain PyTorch: an ``nn.Module`` with the
client's submodel shapes (a copy of the model whose parameters are the tensors the client
received), ``module(inputs)``, ``F.cross_entropy``, ``torch.autograd.grad``:

* ``train.inner`` -- ``n_grad`` SGD steps on the head y of ``CE + inner_l2/2 ||y||^2`` on
  minibatches of ``samples / n_grad`` examples;
* ``train.outer`` -- the implicit hypergradient: one gradient of f w.r.t. (x, y) on the outer
  batch, one of g w.r.t. y with ``create_graph=True`` on the inner batch, ``n_hvp - 1`` CG
  iterations (each one double-backward ``H_yy p``), the mixed product ``∇²_xy g v`` and the
  clipping.

It leaves out what is not client arithmetic: mask assignment, extracting the submodels,
aggregation, the ledger. Those count as radbo's overhead.

Timing: one intra-op thread (``torch.set_num_threads(1)``; run with ``OMP_NUM_THREADS=1``),
radbo round and plain loop alternated, ``--repeats`` of each, medians of process CPU time
(``time.process_time``) and wall time (``time.perf_counter``). The FLOPs of the plain loop are
counted once with ``torch.utils.flop_counter.FlopCounterMode`` and printed next to the
ledger's; the gap is radbo's extra ``f(x, y)`` forward for its ``outer_loss`` metric, which
is counted separately (``metric fwd``). ``--profile`` adds a cProfile of one radbo steady round
per config (top 15 by cumulative and by own time). ``--backend batched`` times radbo with
:class:`~radbo.simulation.BatchedBackend` instead of the config's backend (sequential).
``--compare-module-call`` also times the radbo round with every loss evaluated through
``torch.func.functional_call`` (:func:`radbo.problem.module_calls_only`, the path before the
models' functional forms), alternated with the other two (column ``module call``).

``--compile-probe`` asks whether ``torch.compile`` (inductor, CPU) of the client step would pay:
it runs the round's inner phase (every client's T SGD steps on its recorded minibatches, the
loss written directly with the model's functional form: the best case for the compiler) eager
and compiled, reports the compile time (wall seconds of the first compiled pass, recompiles
for every submodel shape and batch size included, minus an eager pass), the steady CPU time of
each, and what the compile costs over runs of 20 and 200 rounds. It also tries the outer
phase's second-order products (``create_graph=True``) through the compiled loss.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --configs demo --repeats 9 --profile
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --repeats 7 --compare-module-call
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py --repeats 7 --compile-probe

Writes the tables and the command to ``--out`` (default ``runs/bench/overhead.md``).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import shlex
import statistics
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from radbo.algorithms.rabo import RABO
from radbo.client import Backend, ClientResult, ClientRuntime, ClientTask
from radbo.config import parse_config
from radbo.cost import FlopMeter, LedgerEntry
from radbo.experiment import build
from radbo.experiment.runner import torch_threads
from radbo.hypergrad import ImplicitCG
from radbo.models import BilevelModel
from radbo.problem import MinibatchSampler, l2_penalty, module_calls_only
from radbo.simulation import RoundRecord, Simulation
from radbo.tasks.hyper_representation import HyperRepresentation

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.toml"
INNER, OUTER = "train.inner", "train.outer"
T = TypeVar("T")


def demo_config() -> dict[str, Any]:
    """``examples/demo.toml`` without its baseline run (the benchmark drives rounds itself), on
    the sequential backend: the plain loop it is compared with runs one client at a time."""
    data = tomllib.loads(DEMO.read_text())
    data["baseline"] = {"enabled": False}
    data["runtime"] = {"backend": "sequential"}
    return data


def cnn7_config() -> dict[str, Any]:
    """The demo with FedNest's CNN7 on the digits upsampled to 28x28 (1x28x28, MNIST's size)."""
    data = demo_config()
    data["model"] = {"name": "cnn7"}
    data["data"] = {**data["data"], "image_size": 28}
    return data


CONFIGS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "demo": ("demo (RABO, MLP 64-128-10, CG, masks)", demo_config),
    "cnn7": ("cnn7 (RABO, CNN7 on 1x28x28 digits, CG, masks)", cnn7_config),
}


# ------------------------------------------------------------------------------ radbo side
@dataclass
class RecordingBackend:
    """Runs a phase with ``inner`` and keeps the phase's tasks (what each client received)."""

    inner: Backend
    tasks: dict[str, list[ClientTask]] = field(default_factory=dict)

    def run(
        self,
        work: Callable[[ClientRuntime, ClientTask], ClientResult],
        runtime: ClientRuntime,
        meter: FlopMeter | None,
        tasks: Sequence[ClientTask],
    ) -> list[ClientResult]:
        if tasks:
            self.tasks[tasks[0].phase] = list(tasks)
        return self.inner.run(work, runtime, meter, tasks)


def ledger_signature(ledger: Sequence[LedgerEntry]) -> list[tuple[Any, ...]]:
    """What must repeat for two runs of a round to be the same work."""
    return [(e.phase, e.client, e.flops, e.n_grad, e.n_hvp, e.samples) for e in ledger]


# ------------------------------------------------------------------------------ plain side
def plain_module(model: nn.Module, tensors: dict[str, Tensor]) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fresh copies of ``tensors`` (a
    client's received submodel): layers read their weights' shapes, so the copy computes with
    the submodel's shapes."""
    module = copy.deepcopy(model)
    known = dict(module.state_dict())
    for name, tensor in tensors.items():
        if name not in known:
            continue  # an estimator's state, not a model tensor
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        value = tensor.detach().clone()
        if isinstance(getattr(owner, attr), nn.Parameter):
            setattr(owner, attr, nn.Parameter(value))
        else:
            owner.register_buffer(attr, value)
    module.train()
    return module


@dataclass
class PlainJob:
    """One ledger entry's work for the plain loop."""

    phase: str
    client: int
    module: nn.Module
    received: dict[str, Tensor]
    n_grad: int
    n_hvp: int
    inner_batch: int
    outer_batch: int
    inner_pool: Tensor
    outer_pool: Tensor


@dataclass
class PlainLoop:
    """RABO's client work written as plain PyTorch (see the module docstring)."""

    features: Tensor
    labels: Tensor
    x_names: list[str]
    y_names: list[str]
    inner_lr: float
    inner_l2: float
    max_norm: float | None
    jobs: list[PlainJob]

    def load(self, job: PlainJob) -> tuple[list[Tensor], list[Tensor]]:
        """Copy the received tensors into the client's module; its (x, y) parameters."""
        params = dict(job.module.named_parameters())
        with torch.no_grad():
            for name, tensor in job.received.items():
                if name in params:
                    params[name].copy_(tensor)
        return [params[n] for n in self.x_names], [params[n] for n in self.y_names]

    def draw(self, pool: Tensor, size: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        idx = pool[torch.randperm(pool.numel(), generator=gen)[:size]]
        return self.features[idx], self.labels[idx]

    def inner_loss(
        self, module: nn.Module, y: list[Tensor], inputs: Tensor, targets: Tensor
    ) -> Tensor:
        loss = F.cross_entropy(module(inputs), targets)
        if self.inner_l2:
            loss = loss + 0.5 * self.inner_l2 * sum((p * p).sum() for p in y)
        return loss

    def inner(self, job: PlainJob, gen: torch.Generator) -> None:
        """``n_grad`` SGD steps on y."""
        x, y = self.load(job)
        for p in x:
            p.requires_grad_(False)
        for _ in range(job.n_grad):
            inputs, targets = self.draw(job.inner_pool, job.inner_batch, gen)
            loss = self.inner_loss(job.module, y, inputs, targets)
            grads = torch.autograd.grad(loss, y)
            with torch.no_grad():
                for p, g in zip(y, grads, strict=True):
                    p.sub_(self.inner_lr * g)
        for p in x:
            p.requires_grad_(True)

    def outer(self, job: PlainJob, gen: torch.Generator) -> list[Tensor]:
        """Load the received tensors, draw the inner and outer batches, :meth:`hypergradient`."""
        x, y = self.load(job)
        inner = self.draw(job.inner_pool, job.inner_batch, gen)
        outer = self.draw(job.outer_pool, job.outer_batch, gen)
        return self.hypergradient(job, x, y, inner, outer)

    def hypergradient(
        self,
        job: PlainJob,
        x: list[Tensor],
        y: list[Tensor],
        inner: tuple[Tensor, Tensor],
        outer: tuple[Tensor, Tensor],
    ) -> list[Tensor]:
        """Implicit hypergradient on (inputs, targets) batches, clipped: 2 gradients,
        ``n_hvp - 1`` CG iterations, 1 mixed product."""
        (inner_inputs, inner_targets), (outer_inputs, outer_targets) = inner, outer
        f = F.cross_entropy(job.module(outer_inputs), outer_targets)
        grads_f = torch.autograd.grad(f, x + y)
        grad_x_f, grad_y_f = grads_f[: len(x)], grads_f[len(x) :]
        g = self.inner_loss(job.module, y, inner_inputs, inner_targets)
        grad_y_g = torch.autograd.grad(g, y, create_graph=True)
        # conjugate gradient on H_yy v = grad_y f, a fixed number of iterations
        v = [torch.zeros_like(t) for t in grad_y_f]
        r = list(grad_y_f)
        p = list(r)
        rs = sum((t * t).sum() for t in r)
        for _ in range(job.n_hvp - 1):
            hp = torch.autograd.grad(grad_y_g, y, grad_outputs=p, retain_graph=True)
            alpha = rs / sum((a * b).sum() for a, b in zip(p, hp, strict=True))
            v = [vi + alpha * pi for vi, pi in zip(v, p, strict=True)]
            r = [ri - alpha * hi for ri, hi in zip(r, hp, strict=True)]
            rs_new = sum((t * t).sum() for t in r)
            p = [ri + (rs_new / rs) * pi for ri, pi in zip(r, p, strict=True)]
            rs = rs_new
        mixed = torch.autograd.grad(grad_y_g, x, grad_outputs=v)
        hypergrad = [a - b for a, b in zip(grad_x_f, mixed, strict=True)]
        if self.max_norm is not None:
            norm = torch.stack([(t * t).sum() for t in hypergrad]).sum().sqrt()
            scale = torch.clamp(self.max_norm / norm, max=1.0)
            hypergrad = [t * scale for t in hypergrad]
        return hypergrad

    def run_phase(self, phase: str, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        for job in self.jobs:
            if job.phase != phase:
                continue
            if phase == INNER:
                self.inner(job, gen)
            else:
                self.outer(job, gen)

    def run(self, seed: int = 0) -> None:
        """The whole round: every inner job, then every outer job."""
        self.run_phase(INNER, seed)
        self.run_phase(OUTER, seed + 1)

    def metric_forward(self, phase: str) -> None:
        """radbo's extra no-grad ``f(x, y)`` of each outer job (its ``outer_loss`` metric)."""
        gen = torch.Generator().manual_seed(0)
        for job in self.jobs:
            if job.phase == phase == OUTER:
                self.load(job)
                inputs, _ = self.draw(job.outer_pool, job.outer_batch, gen)
                with torch.no_grad():
                    job.module(inputs)


def count_flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def plain_loop(
    sim: Simulation[Any], record: RoundRecord, tasks: dict[str, list[ClientTask]]
) -> PlainLoop:
    """The plain loop doing the work of ``record``'s ledger on the recorded tasks."""
    algorithm = sim.algorithm
    if not isinstance(algorithm, RABO) or not isinstance(algorithm.estimator, ImplicitCG):
        raise ValueError(
            f"the plain loop is written for RABO with the CG estimator, got {algorithm.name!r}"
        )
    task = sim.runtime.problem
    if not isinstance(task, HyperRepresentation) or not isinstance(
        sim.runtime.sampler, MinibatchSampler
    ):
        raise ValueError("the plain loop is written for the hyper_representation task")
    modules: dict[int, nn.Module] = {}
    jobs = []
    for phase in (INNER, OUTER):
        by_client = {t.client: t for t in tasks[phase]}
        for e in (e for e in record.ledger if e.phase == phase):
            t = by_client[e.client]
            data = sim.clients[e.client]
            inner_batch = min(algorithm.batch_size, data.inner.numel())
            outer_batch = min(algorithm.outer_batch_size, data.outer.numel())
            if phase == INNER:
                expected = (e.n_hvp == 0, e.samples == e.n_grad * inner_batch)
            else:
                expected = (e.n_grad == 2, e.samples == inner_batch + outer_batch)
            if not all(expected):
                raise ValueError(f"ledger entry {e} is not the work of RABO's {phase}")
            if e.client not in modules:  # one module per client, built from what it received
                modules[e.client] = plain_module(sim.runtime.model, dict(t.params))
            module = modules[e.client]
            received = {n: v for n, v in t.params.items() if n in dict(module.named_parameters())}
            jobs.append(
                PlainJob(
                    phase,
                    e.client,
                    module,
                    received,
                    e.n_grad,
                    e.n_hvp,
                    inner_batch,
                    outer_batch,
                    data.inner,
                    data.outer,
                )
            )
    return PlainLoop(
        sim.runtime.features,
        sim.runtime.labels,
        list(algorithm.outer_names),
        list(algorithm.inner_names),
        algorithm.inner_lr,
        task.inner_l2,
        algorithm.max_hypergrad_norm,
        jobs,
    )


# ------------------------------------------------------------------------ compile probe
@dataclass
class CompileProbe:
    """Eager against ``torch.compile`` on one round's inner phase (see the module docstring)."""

    compile_s: float
    eager_cpu: list[float]
    compiled_cpu: list[float]
    max_rel_diff: float
    double_backward: str

    def amortised(self, round_cpu: float, rounds: int) -> float:
        """A run of ``rounds`` steady rounds with the inner phase compiled, over the eager run
        (compile time included; < 1 means compiling pays)."""
        saved = statistics.median(self.eager_cpu) - statistics.median(self.compiled_cpu)
        return (rounds * (round_cpu - saved) + self.compile_s) / (rounds * round_cpu)


def compile_probe(sim: Simulation[Any], tasks: Sequence[ClientTask], repeats: int) -> CompileProbe:
    """The inner phase of ``tasks`` (RABO's T SGD steps per client) eager and compiled."""
    import torch._dynamo

    algorithm, runtime = sim.algorithm, sim.runtime
    assert isinstance(algorithm, RABO)
    task_problem = runtime.problem
    assert isinstance(task_problem, HyperRepresentation)
    l2, lr = task_problem.inner_l2, algorithm.inner_lr
    x_names, y_names = list(algorithm.outer_names), list(algorithm.inner_names)
    jobs = []
    for t in tasks:
        module = runtime.module_for(t.index_set)
        assert isinstance(module, BilevelModel)
        steps = algorithm.prepare_inner(runtime, t).steps["inner"]
        x = {n: t.params[n].detach() for n in x_names}
        y = {n: t.params[n].detach() for n in y_names}
        jobs.append((module, x, y, [runtime.batch(i) for i in steps]))

    def loss_of(module: BilevelModel) -> Callable[..., Tensor]:
        def loss(x: dict[str, Tensor], y: dict[str, Tensor], inputs: Tensor, targets: Tensor):
            logits = module._functional_forward({**x, **y}, inputs)
            return F.cross_entropy(logits, targets) + l2_penalty(y, l2)

        return loss

    modules = {id(m): m for m, *_ in jobs}
    eager = {k: loss_of(m) for k, m in modules.items()}
    torch._dynamo.config.recompile_limit = 64  # one entry per submodel shape and batch size
    compiled = {k: torch.compile(loss_of(m)) for k, m in modules.items()}

    def phase(losses: dict[int, Callable[..., Tensor]]) -> list[dict[str, Tensor]]:
        out = []
        for module, x, y0, batches in jobs:
            y = {n: v.clone().requires_grad_() for n, v in y0.items()}
            for batch in batches:
                grads = torch.autograd.grad(
                    losses[id(module)](x, y, batch.inputs, batch.targets), list(y.values())
                )
                y = {
                    n: (v - lr * g).detach().requires_grad_()
                    for (n, v), g in zip(y.items(), grads, strict=True)
                }
            out.append(y)
        return out

    phase(eager)
    eager_wall = timed(lambda: phase(eager))[1]
    first_wall = timed(lambda: phase(compiled))[1]
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        times["eager"].append(timed(lambda: phase(eager))[0])
        times["compiled"].append(timed(lambda: phase(compiled))[0])
    diff = 0.0
    for a, b in zip(phase(eager), phase(compiled), strict=True):
        for n in a:
            scale = float(a[n].abs().max())
            diff = max(diff, float((a[n] - b[n]).abs().max()) / max(scale, 1e-30))
    module, x, y0, batches = jobs[0]
    y = {n: v.clone().requires_grad_() for n, v in y0.items()}
    try:  # the outer phase's Hessian-vector products differentiate the gradient again
        g = torch.autograd.grad(
            compiled[id(module)](x, y, batches[0].inputs, batches[0].targets),
            list(y.values()),
            create_graph=True,
        )
        torch.autograd.grad(sum((t * t).sum() for t in g), list(y.values()))
        double = "works"
    except RuntimeError as error:
        double = f"fails: {str(error).splitlines()[0][:120]}"
    return CompileProbe(
        compile_s=first_wall - eager_wall,
        eager_cpu=times["eager"],
        compiled_cpu=times["compiled"],
        max_rel_diff=diff,
        double_backward=double,
    )


# ----------------------------------------------------------------------------- measuring
@dataclass
class Measurement:
    """One config's result."""

    key: str
    label: str
    backend: str
    round: int
    clients: int
    ledger_flops: dict[str, int]
    plain_flops: dict[str, int]
    metric_flops: dict[str, int]
    radbo_cpu: list[float]
    radbo_wall: list[float]
    plain_cpu: list[float]
    plain_wall: list[float]
    remeasured: int
    same_work: bool
    profile: str = ""
    module_call_cpu: list[float] = field(default_factory=list)
    module_call_wall: list[float] = field(default_factory=list)
    compiled: CompileProbe | None = None

    @property
    def ledger_total(self) -> int:
        return sum(self.ledger_flops.values())

    @property
    def plain_total(self) -> int:
        return sum(self.plain_flops.values())

    @property
    def flop_ratio(self) -> float:
        return self.plain_total / self.ledger_total

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))


def timed(fn: Callable[[], T]) -> tuple[float, float, T]:
    """(CPU seconds of this process, wall seconds, value) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return time.process_time() - cpu, time.perf_counter() - wall, value


def profile_round(fn: Callable[[], object], top: int = 15) -> str:
    """cProfile of ``fn()``: the ``top`` entries by cumulative and by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    out = io.StringIO()
    for order in ("cumulative", "tottime"):
        stats = pstats.Stats(profiler, stream=out)
        stats.strip_dirs().sort_stats(order).print_stats(top)
    return out.getvalue()


def measure(
    key: str,
    repeats: int,
    warmup_rounds: int,
    backend: str,
    profile: bool,
    compare_module_call: bool = False,
    probe_compile: bool = False,
) -> Measurement:
    label, make = CONFIGS[key]
    data = make()
    data["rounds"] = warmup_rounds + 1
    if backend != "config":
        data.setdefault("runtime", {})["backend"] = backend
    config = parse_config(data)
    exp = build(config)
    sim = exp.simulation
    state = exp.initial_state
    for q in range(warmup_rounds):
        state, _ = sim.step(state, q)
    q = warmup_rounds
    # one untimed run of round q: fills the FLOP meter's cache, records the tasks
    timed_backend = sim.backend
    recorder = RecordingBackend(timed_backend)
    sim.backend = recorder
    _, record = sim.step(state, q)
    sim.backend = timed_backend
    plain = plain_loop(sim, record, recorder.tasks)

    phases = (INNER, OUTER)
    ledger_flops = {p: sum(e.flops for e in record.ledger if e.phase == p) for p in phases}
    plain_flops = {p: count_flops(partial(plain.run_phase, p)) for p in phases}
    metric_flops = {p: count_flops(partial(plain.metric_forward, p)) for p in phases}

    plain.run()  # warm-up
    meter = sim.flop_meter
    before = 0 if meter is None else meter.measurements
    expected = ledger_signature(record.ledger)
    same = True
    times: dict[str, list[float]] = {
        "radbo_cpu": [],
        "radbo_wall": [],
        "plain_cpu": [],
        "plain_wall": [],
        "module_call_cpu": [],
        "module_call_wall": [],
    }
    if compare_module_call:
        with module_calls_only():
            sim.step(state, q)  # warm-up of the reference path
    for _ in range(repeats):
        cpu, wall, (_, again) = timed(lambda: sim.step(state, q))
        times["radbo_cpu"].append(cpu)
        times["radbo_wall"].append(wall)
        same = same and ledger_signature(again.ledger) == expected
        cpu, wall, _ = timed(plain.run)
        times["plain_cpu"].append(cpu)
        times["plain_wall"].append(wall)
        if compare_module_call:
            with module_calls_only():
                cpu, wall, (_, again) = timed(lambda: sim.step(state, q))
            times["module_call_cpu"].append(cpu)
            times["module_call_wall"].append(wall)
            same = same and ledger_signature(again.ledger) == expected
    remeasured = 0 if meter is None else meter.measurements - before
    text = profile_round(lambda: sim.step(state, q)) if profile else ""
    probe = compile_probe(sim, recorder.tasks[INNER], repeats) if probe_compile else None
    return Measurement(
        key=key,
        label=label,
        backend=type(timed_backend).__name__.removesuffix("Backend").lower(),
        round=q,
        clients=len(record.clients),
        ledger_flops=ledger_flops,
        plain_flops=plain_flops,
        metric_flops=metric_flops,
        remeasured=remeasured,
        same_work=same,
        profile=text,
        compiled=probe,
        **times,
    )


# ------------------------------------------------------------------------------- output
def table(results: Sequence[Measurement]) -> list[str]:
    lines = [
        "| config | backend | round | clients | ledger MFLOP | radbo CPU ms | plain CPU ms "
        "| CPU ratio | radbo wall ms | plain wall ms | wall ratio | radbo GFLOP/CPU-s "
        "| plain GFLOP/CPU-s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        rc, pc = m.median("radbo_cpu"), m.median("plain_cpu")
        rw, pw = m.median("radbo_wall"), m.median("plain_wall")
        lines.append(
            f"| {m.label} | {m.backend} | {m.round} | {m.clients} | {m.ledger_total / 1e6:.1f} "
            f"| {1e3 * rc:.1f} | {1e3 * pc:.1f} | {rc / pc:.2f}x "
            f"| {1e3 * rw:.1f} | {1e3 * pw:.1f} | {rw / pw:.2f}x "
            f"| {m.ledger_total / rc / 1e9:.2f} | {m.plain_total / pc / 1e9:.2f} |"
        )
    return lines


def module_call_table(results: Sequence[Measurement]) -> list[str]:
    """radbo's round with the models' functional forms against the same round through
    ``functional_call`` (only the configs measured with ``--compare-module-call``)."""
    lines = [
        "| config | backend | functional form CPU ms | module call CPU ms | plain CPU ms "
        "| ratio (functional form) | ratio (module call) | functional form / module call |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        if not m.module_call_cpu:
            continue
        rc, mc, pc = m.median("radbo_cpu"), m.median("module_call_cpu"), m.median("plain_cpu")
        lines.append(
            f"| {m.key} | {m.backend} | {1e3 * rc:.1f} | {1e3 * mc:.1f} | {1e3 * pc:.1f} "
            f"| {rc / pc:.2f}x | {mc / pc:.2f}x | {rc / mc:.3f} |"
        )
    return lines if len(lines) > 2 else []


def compile_table(results: Sequence[Measurement]) -> list[str]:
    """The ``--compile-probe`` results (only configs measured with it)."""
    lines = [
        "| config | compile s (wall) | inner phase eager CPU ms | compiled CPU ms "
        "| round CPU ms | 20 rounds compiled / eager | 200 rounds compiled / eager "
        "| max rel. diff | double backward |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in results:
        p = m.compiled
        if p is None:
            continue
        rc = m.median("radbo_cpu")
        lines.append(
            f"| {m.key} | {p.compile_s:.1f} | {1e3 * statistics.median(p.eager_cpu):.1f} "
            f"| {1e3 * statistics.median(p.compiled_cpu):.1f} | {1e3 * rc:.1f} "
            f"| {p.amortised(rc, 20):.2f} | {p.amortised(rc, 200):.2f} "
            f"| {p.max_rel_diff:.1e} | {p.double_backward} |"
        )
    return lines if len(lines) > 2 else []


def flop_table(results: Sequence[Measurement]) -> list[str]:
    lines = [
        "| config | phase | ledger FLOPs | plain-loop FLOPs | plain / ledger "
        "| metric fwd FLOPs | ledger - plain - metric fwd |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        for phase in (*m.ledger_flops, "round"):
            if phase == "round":
                led, pla = m.ledger_total, m.plain_total
                met = sum(m.metric_flops.values())
            else:
                led, pla, met = m.ledger_flops[phase], m.plain_flops[phase], m.metric_flops[phase]
            lines.append(
                f"| {m.key} | {phase} | {led:,} | {pla:,} | {pla / led:.3f} | {met:,} "
                f"| {led - pla - met:,} |"
            )
    return lines


def report(results: Sequence[Measurement], command: str, repeats: int) -> str:
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [
        "# radbo steady round vs a plain PyTorch loop of the same work",
        "",
        "```",
        command,
        "```",
        "",
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op thread(s), "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"median of {repeats} alternated runs each; load average (1, 5, 15 min) at the end: "
        f"{load}.",
        "",
        *table(results),
        "",
        "Ratio = radbo / plain (issue 12 target: <= 1.5x). GFLOP/CPU-s = each side's own "
        "FLOPs per CPU second.",
        "",
        *module_call_table(results),
        "",
        *compile_table(results),
        "",
        "FLOP check: the plain loop's FLOPs (FlopCounterMode, once) next to the ledger's. "
        "`metric fwd` is radbo's extra no-grad forward of f on the outer batch "
        "(`RABO.run_outer`'s `outer_loss` metric), which the plain loop does not do.",
        "",
        *flop_table(results),
        "",
    ]
    for m in results:
        lines.append(
            f"- {m.key}: FLOP-meter measurements during the timed rounds: {m.remeasured}; "
            f"every timed round did the recorded work: {'yes' if m.same_work else 'NO'}."
        )
    for m in results:
        if m.profile:
            lines += [
                "",
                f"## cProfile of one radbo steady round: {m.key}",
                "",
                "```text",
                m.profile.strip(),
                "```",
            ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> list[Measurement]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each (default 7)")
    parser.add_argument(
        "--warmup-rounds", type=int, default=2, help="rounds run before the measured one"
    )
    parser.add_argument(
        "--backend",
        choices=["config", "sequential", "batched"],
        default="config",
        help="radbo's backend (default: the config's, sequential)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile one steady round")
    parser.add_argument(
        "--compare-module-call",
        action="store_true",
        help="also time radbo's round through functional_call (the path before the models' "
        "functional forms), alternated",
    )
    parser.add_argument(
        "--compile-probe",
        action="store_true",
        help="also time the inner phase eager and under torch.compile (compile time counted)",
    )
    parser.add_argument("--out", default="runs/bench/overhead.md")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup_rounds < 0:
        parser.error(f"--warmup-rounds must be >= 0, got {args.warmup_rounds}")
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overhead.py " + shlex.join(
        list(argv) if argv is not None else sys.argv[1:]
    )
    print(command, flush=True)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("note: run with OMP_NUM_THREADS=1 (this process sets 1 intra-op thread itself)")
    results = []
    with torch_threads(1):
        for key in args.configs:
            results.append(
                measure(
                    key,
                    args.repeats,
                    args.warmup_rounds,
                    args.backend,
                    args.profile,
                    args.compare_module_call,
                    args.compile_probe,
                )
            )
        text = report(results, command.rstrip(), args.repeats)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"written to {out}")
    return results


if __name__ == "__main__":
    main()
