"""Can ``torch.compile`` take a stacked cohort's local work, double backward included? (issue 30)

Issue 30 item 3 asks for CUDA graphs, or ``torch.compile`` where it can take double backward,
for the repeated local steps and CG iterations. This script measures what compiling would give
before the engine grows a compiled path. It builds the demo fleet of ``--clients`` clients on
the batched backend (:func:`benchmarks.gpu.demo_fleet`), steps rounds 0 and 1, and keeps the
largest stacked cohort of round 2's inner phase (RABO's phase 1). On that cohort it times, eager
against compiled (``torch.compile(fullgraph=True)``, ``--mode``):

- ``inner step``: one local SGD step of RABO's phase 1, eq. (5): the cohort's vmapped inner
  loss on the step's minibatch, its gradient over y (``torch.autograd.grad``), the step;
- ``Hessian-vector product``: ``∇²_yy g · u``, the product every CG iteration runs: the
  gradient with ``create_graph=True``, then its derivative along ``u`` (double backward). Eager,
  it is timed both as radbo runs it (:class:`radbo.autodiff.InnerSystem`: the gradient's graph
  built once and kept, each product one more backward pass) and recomputed whole, as the
  compiled function does;
- ``--products`` products on one gradient: the gradient with ``create_graph=True`` once, then
  that many products on its graph, what a CG solve of that many iterations runs, against
  radbo's eager build of the same graph plus the same products;
- ``inner phase``: the whole of RABO's phase 1 on the cohort (``run_inner``: every local step
  on its own minibatch, the summed gradients), eager only: on a GPU with ``--graphs`` it shows
  what one CUDA graph replay per phase would cost against the phase's launches from Python.

Dynamo traces ``torch.autograd.grad`` only with ``torch._dynamo.config.trace_autograd_ops``
(off by default in torch 2.13; with it off, ``fullgraph=True`` refuses the call). A compiled
forward whose backward is differentiated again does not work either way (AOTAutograd's backward
is not differentiable), so the whole product is compiled as one function.

For each function it prints the compile time of the first call, the largest difference of
the compiled result from the eager one relative to the eager result's largest magnitude
(``--dtype float64`` for an equivalence check), the medians of ``--trials`` alternated
timings of ``--repeats`` calls each, and what one call on the cohort less its last client
costs (a new shape). In torch 2.13 that call recompiles, ``--dynamic`` or not: the guard that
fails is the cohort's size (``TORCH_LOGS=recompiles`` shows it), so a compiled engine path
needs cohorts of a few fixed sizes. On a GPU the clocks stop after a synchronisation;
``--mode reduce-overhead`` there replays CUDA graphs of the compiled code, and ``--graphs``
adds each eager side captured as a CUDA graph of its own (``torch.cuda.graph``, no compiler),
the other way to replay a phase's launches. A function that fails to compile or capture is
reported in one line and the others still run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_step.py --clients 100
    .venv/bin/python benchmarks/compile_step.py --device cuda --mode reduce-overhead
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gpu import Runner, demo_fleet  # noqa: E402
from radbo.autodiff import InnerSystem, scalar  # noqa: E402
from radbo.client import Cohort  # noqa: E402

Tensors = tuple[torch.Tensor, ...]
#: a cohort's x, y and buffers (one tensor per name, clients first), inputs and targets
State = tuple[Tensors, Tensors, Tensors, torch.Tensor, torch.Tensor]


@contextlib.contextmanager
def kept_cohorts() -> Iterator[list[Cohort]]:
    """Every cohort :meth:`Cohort.stack` builds inside the block."""
    kept: list[Cohort] = []
    original = Cohort.stack.__func__  # type: ignore[attr-defined]

    def spy(cls: type[Cohort], tasks: Any, prepared: Any) -> Cohort:
        cohort = original(cls, tasks, prepared)
        kept.append(cohort)
        return cohort

    Cohort.stack = classmethod(spy)  # type: ignore[method-assign, assignment]
    try:
        yield kept
    finally:
        Cohort.stack = classmethod(original)  # type: ignore[method-assign, assignment]


class Workload:
    """RABO's phase-1 work on one stacked cohort, as functions of plain tensors."""

    def __init__(self, runner: Runner, cohort: Cohort) -> None:
        runtime = runner.exp.simulation.runtime
        algorithm = runner.exp.simulation.algorithm
        self.cohort, self.runtime, self.lr = cohort, runtime, algorithm.inner_lr
        self.module = cohort.module(runtime)
        self.x = cohort.params(algorithm.outer_names)
        self.y_names = list(algorithm.inner_names)
        self.y = cohort.params(self.y_names, clone=True)
        self.buffers = cohort.params(algorithm.buffer_names, clone=True)
        self.batch = runtime.batch(cohort.step_data("inner", 0))
        self.steps = [runtime.batch(cohort.step_data("inner", t)) for t in range(cohort.max_steps)]
        gen = torch.Generator().manual_seed(0)
        self.u = tuple(
            torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in self.y.values()
        )

    def inner_loss(self, state: State) -> torch.Tensor:
        x, y, buffers, inputs, targets = state
        value = self.cohort.loss(
            self.runtime.problem.inner_loss,
            self.module,
            dict(zip(self.x, x, strict=True)),
            dict(zip(self.y_names, y, strict=True)),
            dict(zip(self.buffers, buffers, strict=True)),
            type(self.batch)(inputs, targets),
        )
        return scalar("inner_loss", value, self.cohort.lead)

    def step(self, state: State) -> Tensors:
        """Eq. (5): ``y - lr * ∇_y g`` (the y of ``state`` requires grad)."""
        y = state[1]
        grads = torch.autograd.grad(self.inner_loss(state), list(y))
        return tuple((p - self.lr * g).detach() for p, g in zip(y, grads, strict=True))

    def hvp(self, state: State, u: Tensors) -> Tensors:
        """``∇²_yy g · u``, the gradient recomputed (the y of ``state`` requires grad)."""
        y = state[1]
        g = torch.autograd.grad(self.inner_loss(state), list(y), create_graph=True)
        return tuple(t.detach() for t in torch.autograd.grad(g, list(y), list(u)))

    def products(self, state: State, u: Tensors, k: int) -> Tensors:
        """``k`` products ``∇²_yy g · u`` on one gradient graph (what a CG solve of ``k``
        iterations runs; here the same ``u`` each time, summed, so none is dead code)."""
        y = state[1]
        g = torch.autograd.grad(self.inner_loss(state), list(y), create_graph=True)
        total = tuple(torch.zeros_like(t) for t in y)
        for _ in range(k):
            out = torch.autograd.grad(g, list(y), list(u), retain_graph=True)
            total = tuple(s + t for s, t in zip(total, out, strict=True))
        return tuple(t.detach() for t in total)

    def phase(self, state: State) -> Tensors:
        """RABO's whole inner phase (``run_inner``) on the cohort: every local step of eq. (5)
        on its own minibatch, and the summed gradients ``G`` (every client assumed to run all
        steps: the engine masks clients past their last step); returns ``(y, G)``."""
        x, y, buffers = state[:3]
        total = tuple(torch.zeros_like(p) for p in y)
        for batch in self.steps:
            y = tuple(p.detach().requires_grad_(True) for p in y)
            loss = self.inner_loss((x, y, buffers, batch.inputs, batch.targets))
            grads = torch.autograd.grad(loss, list(y))
            y = tuple(p - self.lr * g for p, g in zip(y, grads, strict=True))
            total = tuple(s + g for s, g in zip(total, grads, strict=True))
        return tuple(t.detach() for t in (*y, *total))

    def state(self, drop_last: bool = False) -> State:
        """The cohort's (x, y, buffers, inputs, targets); ``drop_last``: less its last client."""
        end = -1 if drop_last else None
        x = tuple(t[:end] for t in self.x.values())
        y = tuple(t[:end].detach().clone().requires_grad_(True) for t in self.y.values())
        buffers = tuple(t[:end].clone() for t in self.buffers.values())
        return x, y, buffers, self.batch.inputs[:end], self.batch.targets[:end]

    def retained_system(self) -> InnerSystem:
        """radbo's eager product: the gradient's graph built once (what CG reuses)."""
        x = {n: t.detach() for n, t in self.x.items()}

        def loss(x_: dict, y_: dict) -> torch.Tensor:
            return self.cohort.loss(
                self.runtime.problem.inner_loss, self.module, x_, y_, self.buffers, self.batch
            )

        return InnerSystem(loss, x, dict(self.y), lead=self.cohort.lead)


def timed(fn: Callable[[], Any], repeats: int, cuda: bool) -> float:
    """Milliseconds per call of ``fn`` over ``repeats`` calls."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def graphed(fn: Callable[[], Tensors]) -> Callable[[], Tensors]:
    """``fn`` (eager code) captured once as a CUDA graph, after 3 warm-up calls on a side
    stream as ``torch.cuda.graph``'s documentation prescribes; each call replays it and returns
    the captured outputs, which the next replay overwrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> Tensors:
        graph.replay()
        return out

    return replay


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def relative_difference(a: Tensors, b: Tensors) -> float:
    scale = max(t.abs().max().item() for t in b) or 1.0
    return max((s - t).abs().max().item() for s, t in zip(a, b, strict=True)) / scale


def compare(
    name: str,
    eager: dict[str, Callable[[], Tensors]],
    compiled: Callable[[], Tensors] | None,
    smaller: Callable[[], Tensors] | None,
    args: argparse.Namespace,
    cuda: bool,
) -> dict[str, float]:
    reference = next(iter(eager.values()))()
    sides = dict(eager)
    start = time.perf_counter()
    try:
        if compiled is None:  # the eager sides only (and, with --graphs, their CUDA graphs)
            print(f"  {name}: not compiled")
        else:
            got = tuple(t.clone() for t in compiled())  # CUDA graphs reuse their output memory
            if cuda:
                torch.cuda.synchronize()
            first = time.perf_counter() - start
            diff = relative_difference(got, reference)
            print(f"  {name}: first compiled call {first:.2f} s; relative difference {diff:.1e}")
            sides["compiled"] = compiled
    except Exception as error:  # a benchmark: report it, time the other sides
        print(f"  {name}: compiling failed: {first_line(error)}")
    if cuda and args.graphs:  # the eager code itself replayed as a CUDA graph
        for side, fn in eager.items():
            try:
                replay = graphed(fn)
                gap = relative_difference(replay(), reference)
                print(f"  {name}: {side} captured as a CUDA graph; relative difference {gap:.1e}")
                sides[f"{side}, graph"] = replay
            except Exception as error:
                print(f"  {name}: capturing {side} as a CUDA graph failed: {first_line(error)}")
    times: dict[str, list[float]] = {side: [] for side in sides}
    for trial in range(args.trials):
        order = list(sides) if trial % 2 == 0 else list(sides)[::-1]
        for side in order:
            times[side].append(timed(sides[side], args.repeats, cuda))
    medians = {side: statistics.median(ts) for side, ts in times.items()}
    for side, ms in medians.items():
        print(f"    {side:>16s}: {ms:8.3f} ms per call")
    for side in eager:
        if f"{side}, graph" in medians:
            ratio = medians[side] / medians[f"{side}, graph"]
            print(f"    {side} / its CUDA graph: {ratio:.2f}x")
    if "compiled" not in medians:
        return medians
    best_eager = min(ms for side, ms in medians.items() if side in eager)
    print(f"    eager / compiled: {best_eager / medians['compiled']:.2f}x")
    if smaller is not None:
        start = time.perf_counter()
        smaller()
        if cuda:
            torch.cuda.synchronize()
        other = time.perf_counter() - start
        print(f"    one call with one client fewer (a new shape): {other:.2f} s")
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--device", default="cpu", help='"cpu" or "cuda"')
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--mode", default=None, help="torch.compile mode (e.g. reduce-overhead)")
    parser.add_argument("--dynamic", action="store_true", help="compile with dynamic shapes")
    parser.add_argument(
        "--products", type=int, default=10, help="products on one gradient (CG iterations)"
    )
    parser.add_argument(
        "--new-shape",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time one call on the cohort less its last client",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="on a GPU, also each eager side captured as a CUDA graph (torch.cuda.graph)",
    )
    parser.add_argument("--repeats", type=int, default=100, help="calls per timing")
    parser.add_argument("--trials", type=int, default=5, help="alternated timings per side")
    args = parser.parse_args(argv)
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        parser.error(f"torch {torch.__version__}'s dynamo cannot trace torch.autograd.grad")
    cuda = args.device != "cpu"
    if args.graphs and not cuda:
        parser.error("--graphs needs --device cuda")
    data = demo_fleet(args.clients)
    data["runtime"]["dtype"] = args.dtype
    runner = Runner(data, args.device)
    runner.step()  # round 0 (FLOP measurement)
    runner.step()  # round 1 (kernels loaded)
    with kept_cohorts() as cohorts:
        runner.step()
    inner = [c for c in cohorts if "inner" in c.prepared[0].steps]
    if not inner:
        parser.error("no stacked cohort in the inner phase: use more --clients")
    cohort = max(inner, key=lambda c: c.size)
    work = Workload(runner, cohort)
    shapes = {n: tuple(t.shape) for n, t in work.y.items()}
    print(
        f"## {args.clients} clients on {args.device} ({args.dtype}), torch {torch.__version__}: "
        f"largest inner cohort {cohort.size} clients, y {shapes}, "
        f"minibatch {tuple(work.batch.inputs.shape)}; mode {args.mode}, dynamic {args.dynamic}"
    )
    options: dict[str, Any] = {"fullgraph": True, "mode": args.mode, "dynamic": args.dynamic}
    # specialize_float: with --dynamic, inductor (torch 2.13) fails on the L2 weight of the
    # inner loss as a symbolic float ("x must be Tensor or scalar, got SymFloat")
    with torch._dynamo.config.patch(trace_autograd_ops=True, specialize_float=True):
        step = torch.compile(work.step, **options)
        hvp = torch.compile(work.hvp, **options)
        full, fewer = work.state(), work.state(drop_last=True)
        compare(
            "inner step",
            {"eager": lambda: work.step(full)},
            lambda: step(full),
            (lambda: step(fewer)) if args.new_shape else None,
            args,
            cuda,
        )
        system = work.retained_system()
        compare(
            "Hessian-vector product",
            {
                "eager (radbo)": lambda: system.hvp(work.u),
                "eager (whole)": lambda: work.hvp(full, work.u),
            },
            lambda: hvp(full, work.u),
            (lambda: hvp(fewer, tuple(t[:-1] for t in work.u))) if args.new_shape else None,
            args,
            cuda,
        )
        k = args.products
        products = torch.compile(work.products, **options)

        def eager_products() -> Tensors:
            system = work.retained_system()
            total = tuple(torch.zeros_like(t) for t in work.u)
            for _ in range(k):
                total = tuple(s + t for s, t in zip(total, system.hvp(work.u), strict=True))
            return total

        compare(
            f"{k} products on one gradient (a CG solve's)",
            {"eager (radbo)": eager_products},
            lambda: products(full, work.u, k),
            (lambda: products(fewer, tuple(t[:-1] for t in work.u), k)) if args.new_shape else None,
            args,
            cuda,
        )
    # not compiled: dynamo would unroll the steps into one graph of T times the step's size
    compare(
        f"inner phase ({len(work.steps)} steps)",
        {"eager": lambda: work.phase(full)},
        None,
        None,
        args,
        cuda,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
