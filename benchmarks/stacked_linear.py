"""The weight gradient of a stacked linear layer: ``bmm``'s transposed view against the
contiguous one of :class:`radbo.models.functional._StackedLinear` (issue 30, item 2).

Under ``torch.vmap`` with a weight per client (a stacked cohort), ``F.linear``'s backward
returns each weight's gradient as the transpose of ``x^T @ grad``: a strided view. A local step
then adds it to a running sum and subtracts it from the contiguous parameters (FedAvg's
``total += g; p -= lr * g``), elementwise operations that read one operand with a stride. This
times, for ``--clients`` clients of a layer ``[out, in]`` with a batch of ``--batch`` each:

* ``backward``: the weight gradient of the vmapped layer's loss (``F.linear`` or
  ``_StackedLinear``);
* ``update``: FedAvg's in-place update with that gradient (``add_``, ``mul_``, ``sub_``);
* ``speed-up``: F.linear's backward + update over _StackedLinear's (above 1: the custom
  function pays; it costs a fixed overhead per call, so it loses on small layers).

The two sides alternate, ``--repeats`` times; medians in ms. Freed memory is kept for reuse, as
``radbo run`` does. The script exits non-zero unless the two gradients agree (float64 on the
smallest layer, to 1e-12 relative). Run with one thread:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stacked_linear.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radbo.allocator import retain_freed_memory  # noqa: E402
from radbo.models.functional import _StackedLinear  # noqa: E402

#: name -> (out, in): pfl-research's CIFAR-10 CNN hidden layer (benchmarks/vs_pfl.py), layers
#: around radbo.models.functional.STACKED_LINEAR_MIN_WEIGHTS (65,536 per client), and the demo
#: MLP's layers (examples/demo.toml: 64 -> 32 -> 10 on 8x8 digits)
LAYERS: dict[str, tuple[int, int]] = {
    "simple_cnn fc (12544 -> 128)": (128, 12544),
    "1024 -> 256": (256, 1024),
    "256 -> 256": (256, 256),
    "256 -> 64": (64, 256),
    "demo mlp body (64 -> 32)": (32, 64),
    "demo mlp head (32 -> 10)": (10, 32),
}
Linear = Callable[[Tensor, Tensor, Tensor], Tensor]
SIDES: dict[str, Linear] = {
    "F.linear": F.linear,
    "_StackedLinear": lambda x, w, b: _StackedLinear.apply(x, w) + b,
}


def weight_gradient(linear: Linear, x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    loss = torch.vmap(lambda x_, w_, b_: linear(x_, w_, b_).square().mean())(x, w, b)
    (grad,) = torch.autograd.grad(loss.sum(), w)
    return grad


def check() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    ref, ours = (weight_gradient(f, x, w, b) for f in SIDES.values())
    if not ours.is_contiguous() or not torch.allclose(ours, ref, rtol=1e-12, atol=0.0):
        sys.exit("the two weight gradients differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    args = parser.parse_args()
    retain_freed_memory()
    check()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}"
    )
    print()
    print(
        "| layer | clients | gradient of F.linear | backward (ms) | update (ms) "
        "| _StackedLinear | backward (ms) | update (ms) | speed-up |"
    )
    print("|---|---:|---|---:|---:|---|---:|---:|---:|")
    for name in args.layers:
        out, inp = LAYERS[name]
        for n in args.clients:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(n, args.batch, inp, generator=gen)
            w = (torch.randn(n, out, inp, generator=gen) * 0.01).requires_grad_(True)
            b = torch.zeros(n, out)
            p, total = w.detach().clone(), torch.zeros_like(w)
            grads = {k: weight_gradient(f, x, w, b) for k, f in SIDES.items()}
            times: dict[str, list[float]] = {f"{k} {part}": [] for k in SIDES for part in "bu"}
            for _ in range(args.repeats):
                for key, f in SIDES.items():
                    start = time.perf_counter()
                    weight_gradient(f, x, w, b)
                    times[f"{key} b"].append(time.perf_counter() - start)
                    g = grads[key].clone()  # fresh, in the same layout (clone keeps strides)
                    start = time.perf_counter()
                    total.add_(g)
                    p.sub_(g.mul_(0.1))
                    times[f"{key} u"].append(time.perf_counter() - start)
            ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            plain = ms["F.linear b"] + ms["F.linear u"]
            ours = ms["_StackedLinear b"] + ms["_StackedLinear u"]
            layout = {k: "contiguous" if g.is_contiguous() else "strided" for k, g in grads.items()}
            print(
                f"| {name} | {n} | {layout['F.linear']} | {ms['F.linear b']:.2f} "
                f"| {ms['F.linear u']:.2f} | {layout['_StackedLinear']} "
                f"| {ms['_StackedLinear b']:.2f} | {ms['_StackedLinear u']:.2f} "
                f"| {plain / ours:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
