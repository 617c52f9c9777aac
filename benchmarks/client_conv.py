"""A stacked cohort's convolutions client by client against vmap's grouped convolution, in
whole rounds (issue 30, item 2).

Under ``torch.vmap`` with a weight per client, a convolution becomes one grouped convolution
(``groups = clients``). For layers with few channels per group and enough work per client radbo
runs each client's own convolution instead
(:class:`radbo.models.functional._ClientConv2d`; the rule: at most
``CLIENT_CONV_MAX_IN_CHANNELS`` input and ``CLIENT_CONV_MAX_OUT_CHANNELS`` output channels per
group and at least ``CLIENT_CONV_MIN_FLOPS`` per client). This times whole rounds
(``Simulation.step``, every phase and the aggregation) of the workloads of
``benchmarks/batched.py`` for three sides:

* ``seq``: the sequential backend;
* ``grouped``: the batched backend with every convolution left to vmap (the rule switched off);
* ``rule``: the batched backend as it runs (the rule on).

The sides alternate, ``--repeats`` times; medians in ms, speed-ups over ``seq``. The "client
by client" column counts the convolution calls the rule took in one round of the ``rule``
side. ``--max-in-channels``, ``--max-out-channels`` and ``--min-flops`` replace the rule's
bounds for the ``rule`` side (to measure another rule). Freed memory is kept for reuse, as
``radbo run`` does. Run with one thread:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/client_conv.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/client_conv.py --models cnn7_32 --clients 10
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.batched import ALGORITHMS, MODELS, alternate, experiment  # noqa: E402
from radbo.allocator import retain_freed_memory  # noqa: E402
from radbo.models import functional  # noqa: E402
from radbo.simulation import BatchedBackend, SequentialBackend  # noqa: E402


@contextmanager
def grouped_convolutions() -> Iterator[None]:
    """Every convolution of a stacked cohort left to vmap (the rule switched off)."""
    saved = functional.CLIENT_CONV_MIN_FLOPS
    functional.CLIENT_CONV_MIN_FLOPS = 1 << 62
    try:
        yield
    finally:
        functional.CLIENT_CONV_MIN_FLOPS = saved


@contextmanager
def counted(box: list[int]) -> Iterator[None]:
    """Counts the calls of ``_ClientConv2d.apply`` into ``box[0]``."""
    original = functional._ClientConv2d.apply

    def apply(*args: Any) -> Any:
        box[0] += 1
        return original(*args)

    functional._ClientConv2d.apply = apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        functional._ClientConv2d.apply = original  # type: ignore[method-assign]


def measure(model: str, algorithm: str, clients: int, repeats: int) -> dict[str, float]:
    exp = experiment(algorithm, clients, model)
    sim = exp.simulation
    seq, bat = SequentialBackend(), BatchedBackend()

    def step(backend: Any, rule: bool) -> object:
        sim.backend = backend
        if rule:
            return sim.step(exp.initial_state, 0)
        with grouped_convolutions():
            return sim.step(exp.initial_state, 0)

    step(seq, True)  # warm-up: the FLOP meter's counts, kernels
    step(bat, False)
    box = [0]
    with counted(box):
        step(bat, True)
    times = alternate(
        {
            "seq": lambda: step(seq, True),
            "grouped": lambda: step(bat, False),
            "rule": lambda: step(bat, True),
        },
        repeats,
    )
    return {**times, "calls": box[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn7_32", "simple_cnn", "cnn7"],
                        choices=[m for m in MODELS if m != "mlp"])  # fmt: skip
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "rabo"], choices=ALGORITHMS)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-in-channels", type=int, default=functional.CLIENT_CONV_MAX_IN_CHANNELS
    )
    parser.add_argument(
        "--max-out-channels", type=int, default=functional.CLIENT_CONV_MAX_OUT_CHANNELS
    )
    parser.add_argument("--min-flops", type=int, default=functional.CLIENT_CONV_MIN_FLOPS)
    args = parser.parse_args()
    functional.CLIENT_CONV_MAX_IN_CHANNELS = args.max_in_channels
    functional.CLIENT_CONV_MAX_OUT_CHANNELS = args.max_out_channels
    functional.CLIENT_CONV_MIN_FLOPS = args.min_flops
    retain_freed_memory()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of "
        f"{args.repeats}; rule: <= {functional.CLIENT_CONV_MAX_IN_CHANNELS} input and <= "
        f"{functional.CLIENT_CONV_MAX_OUT_CHANNELS} output channels per group, >= "
        f"{functional.CLIENT_CONV_MIN_FLOPS:,} FLOPs per client"
    )
    print()
    print(
        "| model | algorithm | clients | round seq (ms) | grouped (ms) | speed-up "
        "| rule (ms) | speed-up | client by client (calls per round) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in args.models:
        for algorithm in args.algorithms:
            for n in args.clients:
                m = measure(model, algorithm, n, args.repeats)
                print(
                    f"| {model} | {algorithm} | {n} | {1e3 * m['seq']:.1f} "
                    f"| {1e3 * m['grouped']:.1f} | {m['seq'] / m['grouped']:.2f}x "
                    f"| {1e3 * m['rule']:.1f} | {m['seq'] / m['rule']:.2f}x | {m['calls']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
