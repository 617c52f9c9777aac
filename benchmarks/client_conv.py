"""radbo's rules for a stacked cohort's convolutions and poolings against vmap's own, in whole
rounds (issue 30, item 2).

Under ``torch.vmap`` with a weight per client, a convolution becomes one grouped convolution
(``groups = clients``) whose bias vmap adds in a separate pass, and a max-pooling after it
copies its input to move the clients beside the images. radbo replaces both where measured to
gain:

* layers with few channels per group and enough work per client run each client's own
  convolution (:class:`radbo.models.functional._ClientConv2d`; at most
  ``CLIENT_CONV_MAX_IN_CHANNELS`` input and ``CLIENT_CONV_MAX_OUT_CHANNELS`` output channels
  per group and at least ``CLIENT_CONV_MIN_FLOPS`` per client);
* other convolutions with at least ``STACKED_CONV_MIN_NUMEL`` output elements per client run
  the grouped convolution with the bias inside the kernel and the output left where it lies
  (``_StackedConv2d``), and max-poolings of at least as many input elements per client pool it
  there (``_StackedMaxPool2d``).

This times whole rounds (``Simulation.step``, every phase and the aggregation) of the
workloads of ``benchmarks/batched.py`` for three sides:

* ``seq``: the sequential backend;
* ``vmap``: the batched backend with radbo's rules switched off (vmap's own rules everywhere);
* ``radbo``: the batched backend as it runs (the rules on).

The sides alternate, ``--repeats`` times; medians in ms, speed-ups over ``seq``. The last three
columns count the calls each rule took in one round of the ``radbo`` side.
``--max-in-channels``, ``--max-out-channels``, ``--min-flops`` and ``--stacked-min-numel``
replace the rules' bounds for the ``radbo`` side (to measure other rules). Freed memory is kept
for reuse, as ``radbo run`` does. Run with one thread:

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
def vmaps_rules() -> Iterator[None]:
    """Every convolution and pooling of a stacked cohort left to vmap (radbo's rules off)."""
    saved = functional.CLIENT_CONV_MIN_FLOPS, functional.STACKED_CONV_MIN_NUMEL
    functional.CLIENT_CONV_MIN_FLOPS = functional.STACKED_CONV_MIN_NUMEL = 1 << 62
    try:
        yield
    finally:
        functional.CLIENT_CONV_MIN_FLOPS, functional.STACKED_CONV_MIN_NUMEL = saved


RULES = {
    "client": functional._ClientConv2d,
    "stacked": functional._StackedConv2d,
    "pool": functional._StackedMaxPool2d,
}


@contextmanager
def counted(box: dict[str, int]) -> Iterator[None]:
    """Counts the calls of each rule's ``apply`` into ``box``."""
    originals = {name: rule.apply for name, rule in RULES.items()}

    def counter(name: str) -> Any:
        def apply(*args: Any) -> Any:
            box[name] += 1
            return originals[name](*args)

        return apply

    for name, rule in RULES.items():
        rule.apply = counter(name)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, rule in RULES.items():
            rule.apply = originals[name]  # type: ignore[method-assign]


def measure(model: str, algorithm: str, clients: int, repeats: int) -> dict[str, float]:
    exp = experiment(algorithm, clients, model)
    sim = exp.simulation
    seq, bat = SequentialBackend(), BatchedBackend()

    def step(backend: Any, rules: bool) -> object:
        sim.backend = backend
        if rules:
            return sim.step(exp.initial_state, 0)
        with vmaps_rules():
            return sim.step(exp.initial_state, 0)

    step(seq, True)  # warm-up: the FLOP meter's counts, kernels
    step(bat, False)
    box = dict.fromkeys(RULES, 0)
    with counted(box):
        step(bat, True)
    times = alternate(
        {
            "seq": lambda: step(seq, True),
            "vmap": lambda: step(bat, False),
            "radbo": lambda: step(bat, True),
        },
        repeats,
    )
    return {**times, **box}


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
    parser.add_argument("--stacked-min-numel", type=int, default=functional.STACKED_CONV_MIN_NUMEL)
    args = parser.parse_args()
    functional.CLIENT_CONV_MAX_IN_CHANNELS = args.max_in_channels
    functional.CLIENT_CONV_MAX_OUT_CHANNELS = args.max_out_channels
    functional.CLIENT_CONV_MIN_FLOPS = args.min_flops
    functional.STACKED_CONV_MIN_NUMEL = args.stacked_min_numel
    retain_freed_memory()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of "
        f"{args.repeats}; rule: <= {functional.CLIENT_CONV_MAX_IN_CHANNELS} input and <= "
        f"{functional.CLIENT_CONV_MAX_OUT_CHANNELS} output channels per group, >= "
        f"{functional.CLIENT_CONV_MIN_FLOPS:,} FLOPs per client; stacked: >= "
        f"{functional.STACKED_CONV_MIN_NUMEL:,} elements per client"
    )
    print()
    print(
        "| model | algorithm | clients | round seq (ms) | vmap (ms) | speed-up "
        "| radbo (ms) | speed-up | client by client | stacked conv | stacked pool |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in args.models:
        for algorithm in args.algorithms:
            for n in args.clients:
                m = measure(model, algorithm, n, args.repeats)
                print(
                    f"| {model} | {algorithm} | {n} | {1e3 * m['seq']:.1f} "
                    f"| {1e3 * m['vmap']:.1f} | {m['seq'] / m['vmap']:.2f}x "
                    f"| {1e3 * m['radbo']:.1f} | {m['seq'] / m['radbo']:.2f}x "
                    f"| {m['client']:.0f} | {m['stacked']:.0f} | {m['pool']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
