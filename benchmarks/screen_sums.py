"""What the finiteness screen of a phase's updates costs, summed in the update's own dtype
(``radbo.simulation.screening._finite``, what the engine runs) against the float64
accumulation it used before (:func:`finite_float64`, kept here as the reference).

The screen sums every floating tensor of every client's update and reads the sums at once; a
finite sum proves a tensor free of NaN and Inf. Accumulating a float32 tensor in float64
converts every element on the way. The updates here are those of ``--clients`` clients of
pfl-research's CIFAR-10 ``simple_cnn`` (1,626,442 float32 numbers each, the model of
``benchmarks/vs_pfl.py``), as the sequential backend hands them in (one tensor per name and
client) and as the batched backend does (per-client slices of one stacked tensor per name,
summed in one reduction). Each way is timed ``--repeats`` times, the two alternated (the one
that goes first swaps every repetition), one intra-op thread; the table gives the median
milliseconds per client and the ratio. Both must give the same verdicts (all sound, and each
client with a NaN planted in its largest tensor found).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/screen_sums.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.vs_pfl import PflSimpleCNN  # noqa: E402
from radbo.simulation.screening import _finite  # noqa: E402


def finite_float64(tensors: Sequence[Tensor]) -> list[bool]:
    """``_finite`` as it was before: every sum accumulated in float64."""
    return _finite(tensors, accumulate=lambda _: torch.float64)


def updates(clients: int, stacked: bool, seed: int = 0) -> list[Tensor]:
    """The tensors of ``clients`` updates of pfl's CNN: separate, or slices of stacks."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [p.shape for p in PflSimpleCNN().parameters()]
    if stacked:
        stacks = [torch.randn(clients, *s, generator=gen) for s in shapes]
        return [stack[c] for c in range(clients) for stack in stacks]
    return [torch.randn(s, generator=gen) for _ in range(clients) for s in shapes]


def clock(check: Callable[[Sequence[Tensor]], list[bool]], tensors: list[Tensor]) -> float:
    start = time.perf_counter()
    check(tensors)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, default=50, help="updates in the phase")
    parser.add_argument("--repeats", type=int, default=11, help="timings of each way")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ways = {"own dtype (now)": _finite, "float64 (before)": finite_float64}
    print(
        f"torch {torch.__version__}; {args.clients} updates of pfl's simple_cnn (1,626,442 "
        f"float32 each); median of {args.repeats} alternated timings, one thread\n"
    )
    print("| updates | own dtype: ms per client | float64: ms per client | float64 / own |")
    print("|---|---:|---:|---:|")
    for stacked in (False, True):
        tensors = updates(args.clients, stacked)
        per = len(tensors) // args.clients
        planted = [t.clone() for t in tensors]
        for c in range(0, args.clients, 2):  # a NaN in every other client's largest tensor
            largest = max(range(per), key=lambda k: planted[c * per + k].numel())
            planted[c * per + largest].view(-1)[7] = float("nan")
        for check in ways.values():
            if not all(check(tensors)) or check(planted) != [
                bool(torch.isfinite(t).all()) for t in planted
            ]:
                raise SystemExit(f"{check.__name__} gave a wrong verdict")
        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.repeats + 1):
            for name in list(ways) if r % 2 == 0 else reversed(list(ways)):
                seconds = clock(ways[name], tensors)
                if r:  # the first round warms up
                    times[name].append(seconds)
        own, wide = (statistics.median(times[n]) / args.clients * 1e3 for n in ways)
        kind = "stacked cohort (batched)" if stacked else "one tensor per client (sequential)"
        print(f"| {kind} | {own:.3f} | {wide:.3f} | {wide / own:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
