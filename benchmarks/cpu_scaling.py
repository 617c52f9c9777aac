"""How much parallel work the CPUs allow for a client-sized PyTorch workload: the same plain
PyTorch training steps timed in one process alone, then in ``--processes`` processes at once.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cpu_scaling.py [--hidden 1000 1000] [--steps 200]

Each process runs ``--steps`` SGD steps of an MLP 64-hidden-10 (by default the 1M-parameter
64-1000-1000-10 of ``benchmarks/workers.py --hidden 1000 1000``) on minibatches of 32, one
intra-op thread, after a warm-up. Reported: the wall time of one process alone, of the
processes together (started at once, from a barrier), and the speed-up the CPUs gave, ``N x
alone / together`` (``N`` where the processes do not slow each other). Memory bandwidth and
caches shared between cores, or virtual CPUs that are threads of one physical core, make it
less: no scheduling of clients over processes can beat it on this workload. The sides are
alternated ``--repeats`` times; medians.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch


def steps(hidden: list[int], count: int) -> None:
    """``count`` SGD steps of the MLP on random minibatches of 32 (one thread)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    widths = [64, *hidden, 10]
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64, generator=gen)
    y = torch.randint(0, 10, (32,), generator=gen)
    for _ in range(count):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _worker(hidden: list[int], count: int, barrier: object) -> None:
    steps(hidden, 3)  # warm-up
    barrier.wait()  # type: ignore[attr-defined]
    steps(hidden, count)


def together(hidden: list[int], count: int, processes: int) -> float:
    """Wall seconds for ``processes`` forked processes to run ``count`` steps each at once."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes + 1)
    procs = [
        context.Process(target=_worker, args=(hidden, count, barrier)) for _ in range(processes)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    start = time.perf_counter()
    for p in procs:
        p.join()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1000, 1000])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    alone, both = [], []
    for _ in range(args.repeats):
        alone.append(together(args.hidden, args.steps, 1))
        both.append(together(args.hidden, args.steps, args.processes))
    a, b = statistics.median(alone), statistics.median(both)
    n = args.processes
    print(
        f"MLP 64-{'-'.join(map(str, args.hidden))}-10, {args.steps} SGD steps of 32 examples per "
        f"process, one thread each, torch {torch.__version__}; medians of {args.repeats} "
        "alternated repeats"
    )
    print(f"  1 process alone: {a:.3f} s")
    print(f"  {n} processes at once: {b:.3f} s")
    print(f"  speed-up the CPUs gave: {n * a / b:.2f}x (at most {n}x)")


if __name__ == "__main__":
    main()
