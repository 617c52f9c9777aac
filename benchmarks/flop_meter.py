"""The FLOP meter's cost: round 0 (where every workload is new and measured) against a steady
round, with the meter as it is (lean counter, CG workloads composed from a verified line,
repeated blocks -- inner steps, CG iterations -- counted once per measurement), counting every
operation, with ``FlopCounterMode`` itself and nothing composed (radbo before issue 12), and
without a meter;
plus the measurements each one made. Process CPU seconds, one thread, the three variants
alternated, median over ``--repeats`` runs of each.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/flop_meter.py            # demo and CNN7
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/flop_meter.py --configs demo --repeats 3

The ledger's FLOPs are the same integers with either meter (``tests/flops/test_flop_meter.py``).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import radbo.flops  # noqa: E402
from radbo.config import RunConfig, load_config, parse_config  # noqa: E402
from radbo.cost import FlopMeter  # noqa: E402
from radbo.experiment import build  # noqa: E402

SEQUENTIAL = {"backend": "sequential"}


def configs() -> dict[str, Callable[[], RunConfig]]:
    return {
        # the sequential backend, as BENCHMARKS.md's figures were measured
        "demo": lambda: parse_config(
            {**load_config(ROOT / "examples" / "demo.toml").model_dump(), "runtime": SEQUENTIAL}
        ),
        "cnn7": lambda: parse_config(
            {
                "seed": 0,
                "data": {"name": "digits", "image_size": 16},
                "model": {"name": "cnn7"},
                "runtime": SEQUENTIAL,
            }
        ),
    }


def reference_count(fn: Callable[[], Any], reuse: bool = False, blocks: Any = None) -> int:
    """radbo's count before issue 12: FlopCounterMode with its per-module bookkeeping."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


@contextmanager
def counter(kind: str) -> Iterator[None]:
    original = radbo.flops.count_flops
    if kind == "FlopCounterMode, no composition":
        radbo.flops.count_flops = reference_count
    try:
        yield
    finally:
        radbo.flops.count_flops = original


def rounds(make: Callable[[], RunConfig], kind: str, n: int) -> tuple[list[float], int]:
    """CPU seconds of rounds 0..n-1 and the meter's measurements."""
    exp = build(make())
    sim = exp.simulation
    sim.flop_meter = (
        None
        if kind == "no meter"
        else FlopMeter(compose=kind.startswith("lean"), reuse=kind == KINDS[0])
    )
    state, times = exp.initial_state, []
    with counter(kind):
        for r in range(n):
            start = time.process_time()
            state, _ = sim.step(state, r)
            times.append(time.process_time() - start)
    return times, 0 if sim.flop_meter is None else sim.flop_meter.measurements


KINDS = (
    "lean counter, composed, repeated blocks counted once",
    "lean counter, composed, every operation counted",
    "FlopCounterMode, no composition",
    "no meter",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(configs()), choices=list(configs()))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/flop_meter.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "OMP_NUM_THREADS=1 .venv/bin/python " + shlex.join(
        [f"benchmarks/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]
    )
    print(command, flush=True)
    lines = [
        f"Process CPU seconds, median of {args.repeats} runs of each variant (alternated), "
        f"{args.rounds} rounds; steady = median of rounds 1..{args.rounds - 1}.",
        "",
        "| config | meter | round 0 (s) | steady round (s) | round 0 / steady | measurements |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in args.configs:
        make = configs()[name]
        runs: dict[str, list[tuple[list[float], int]]] = {k: [] for k in KINDS}
        for rep in range(args.repeats):
            for kind in KINDS if rep % 2 == 0 else tuple(reversed(KINDS)):
                runs[kind].append(rounds(make, kind, args.rounds))
        for kind in KINDS:
            first = statistics.median(t[0] for t, _ in runs[kind])
            steady = statistics.median(statistics.median(t[1:]) for t, _ in runs[kind])
            measured = runs[kind][0][1]
            lines.append(
                f"| {name} | {kind} | {first:.3f} | {steady:.3f} | {first / steady:.1f} "
                f"| {measured} |"
            )
            print(lines[-1], flush=True)
    lines += ["", f"    {command}"]
    markdown = "\n".join(lines)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
