"""Seconds per round of RAFBO against ``[estimator] coordinate_batch``: the finite-difference
hypergradient one coordinate at a time against batches of coordinates (issue 30, item 3).

Each run is ``examples/rafbo.toml`` (the demo fleet and digits MLP, 416 sampled coordinates of
x per client; ``--all-coordinates``: every coordinate, 8,320 on a full-width client) with the
baseline off, for ``--rounds`` rounds in a fresh :func:`radbo.experiment.build`; the figure is
the median of its rounds after the first. The batch sizes alternate within each repetition
(order reversed every other repetition) and the table gives the median over repetitions,
with the speed-up against ``coordinate_batch = 1`` and whether the run's FLOP ledger equals
that of ``1`` (it must: the same arithmetic).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fd_batch.py               # about 4 minutes
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fd_batch.py --device cuda  # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from radbo.config import load_config
from radbo.experiment import build

ROOT = Path(__file__).resolve().parent.parent


def _config(batch: int, args: argparse.Namespace):
    config = load_config(ROOT / "examples" / "rafbo.toml")
    data = config.model_dump(mode="json")
    data.update(rounds=args.rounds, eval_every=args.rounds + 1)
    data["baseline"] = {"enabled": False}
    estimator = {**data["estimator"], "coordinate_batch": batch}
    if args.all_coordinates:
        estimator.pop("fraction", None)
        estimator["rescale"] = False
    data["estimator"] = estimator
    # the sequential backend, as BENCHMARKS.md's figures were measured
    data["runtime"] = {**data.get("runtime", {}), "device": args.device, "backend": "sequential"}
    return type(config).model_validate(data)


def one_run(batch: int, args: argparse.Namespace) -> tuple[float, int]:
    """(median seconds of rounds 1.., total FLOPs of the ledger) of one run."""
    exp = build(_config(batch, args))
    sim = exp.simulation
    times, flops = [], 0
    start = time.perf_counter()
    for _, record in sim.iterate(exp.initial_state, args.rounds):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - start)
        start = now
        flops += sum(row.flops for row in record.ledger)
    return statistics.median(times[1:]), flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run, first a warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="alternated runs per batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--all-coordinates", action="store_true", help="every coordinate of x")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    seconds: dict[int, list[float]] = {b: [] for b in args.batches}
    ledgers: dict[int, int] = {}
    for rep in range(args.repeats):
        order = args.batches if rep % 2 == 0 else list(reversed(args.batches))
        for batch in order:
            s, flops = one_run(batch, args)
            seconds[batch].append(s)
            ledgers.setdefault(batch, flops)
            print(f"repeat {rep + 1}/{args.repeats}: coordinate_batch {batch}: {s:.3f} s/round")
    base = statistics.median(seconds[args.batches[0]])
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU, 1 thread"
    print(
        f"\n| coordinate_batch | s/round (median, range) | speed-up | ledger = batch "
        f"{args.batches[0]} | device |"
    )
    print("|---:|---:|---:|---|---|")
    for batch in args.batches:
        med = statistics.median(seconds[batch])
        lo, hi = min(seconds[batch]), max(seconds[batch])
        same = "yes" if ledgers[batch] == ledgers[args.batches[0]] else "NO"
        print(
            f"| {batch} | {med:.3f} ({lo:.3f}-{hi:.3f}) | {base / med:.2f}x | {same} | {device} |"
        )


if __name__ == "__main__":
    main()
