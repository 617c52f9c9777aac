"""Ragged cohorts padded against split: seconds per round and dispatched operations (issue 30).

On the demo's non-iid fleet most clients hold fewer examples than a minibatch, so their
draws are shorter, and without padding every length is a cohort of its own (39 and 50 cohorts
per phase at 100 clients, most of one or two clients). Where the losses are a mean
cross-entropy and no layer mixes examples, the batched backend now pads the shorter
minibatches (``radbo.client.Prepared.ragged``; the padded examples' targets are ignored), so a
phase runs one cohort per submodel shape.

Each row builds ``examples/demo.toml`` (baseline off) with ``--clients`` clients (above 719,
``allow_overlap``: digits has 1,438 training examples) and the algorithm, three times:
sequential, batched with ``runtime.pads = False`` (the old grouping) and batched as built
(padded). After two warm-up rounds the three step round after round, alternated (order
rotated every round); the figure is the median of ``--rounds`` rounds. Also per side: the
stacked cohorts per phase and the aten operations one round dispatches (counted under a
``TorchDispatchMode``): on a GPU most of them launch a kernel, and launches bound a small
model's round there.

``--device cuda`` runs every side on the GPU (``torch.cuda.synchronize`` before each clock
stops); ``--sides split padded`` leaves the sequential side out (its 1,000-client rounds take
seconds each).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/padding.py
    .venv/bin/python benchmarks/padding.py --device cuda --clients 100 1000 --algorithms rabo \\
        --sides split padded
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/padding.py --clients 10 100 1000 \\
        --algorithms rabo fedavg shrofbo --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from radbo._torch_private import TorchDispatchMode
from radbo.client import Cohort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gpu import Runner, demo_fleet  # noqa: E402

SIDES = ("sequential", "batched, split", "batched, padded")
MISSING = {"s": float("nan"), "ops": 0, "cohorts_per_phase": float("nan")}


def side_config(clients: int, algorithm: str, side: str) -> dict[str, Any]:
    """The demo fleet of ``clients`` (:func:`benchmarks.gpu.demo_fleet`) with ``algorithm``
    on the backend of ``side``."""
    data = demo_fleet(clients)
    if algorithm != "rabo":
        data["algorithm"] = {"name": algorithm}
        data.pop("estimator", None)
    if side == "sequential":
        data["runtime"] = {"backend": "sequential"}
    return data


def make_side(clients: int, algorithm: str, side: str, device: str = "cpu") -> Runner:
    """One side built and ready to step; "batched, split" runs with padding off."""
    runner = Runner(side_config(clients, algorithm, side), device)
    runtime = runner.exp.simulation.runtime
    runtime.pads = runtime.pads and side == "batched, padded"
    return runner


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += 1
        return func(*args, **(kwargs or {}))


def counted_round(side: Runner) -> tuple[int, int]:
    """(aten operations, stacked cohorts) of one round of ``side``."""
    stacks: list[int] = []
    original = Cohort.stack.__func__  # type: ignore[attr-defined]

    def spy(cls, tasks, prepared):  # noqa: ANN001
        stacks.append(len(tasks))
        return original(cls, tasks, prepared)

    Cohort.stack = classmethod(spy)  # type: ignore[method-assign,assignment]
    try:
        with _Ops() as ops:
            side.step()
    finally:
        Cohort.stack = classmethod(original)  # type: ignore[method-assign,assignment]
    return ops.count, len(stacks)


def measure(
    clients: int,
    algorithm: str,
    rounds: int,
    device: str = "cpu",
    names: tuple[str, ...] = SIDES,
) -> dict[str, dict[str, float]]:
    """Per side of ``names``: median seconds per round, aten operations of one round and
    stacked cohorts per phase."""
    sides = {name: make_side(clients, algorithm, name, device) for name in names}
    for side in sides.values():  # round 0 measures FLOPs; round 1 is the first steady one
        side.step()
        side.step()
    counts = {name: counted_round(side) for name, side in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    for q in range(rounds):
        k = q % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(sides[name].step())
    phases = len(sides[names[0]].exp.simulation.algorithm.phases())
    return {
        name: {
            "s": statistics.median(times[name]),
            "ops": counts[name][0],
            "cohorts_per_phase": counts[name][1] / phases,
        }
        for name in names
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--algorithms", nargs="+", default=["rabo", "fedavg", "shrofbo"])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side")
    parser.add_argument("--device", default="cpu", help='"cpu" or "cuda" ([runtime] device)')
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=["sequential", "split", "padded"],
        default=None,
        help="a subset of the sides (default all three; nan in the table for the others)",
    )
    args = parser.parse_args(argv)
    names = SIDES if args.sides is None else tuple(n for n in SIDES if n.split()[-1] in args.sides)
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name() if args.device != "cpu" else "CPU, 1 thread"
    print(
        f"torch {torch.__version__}, {where}; median of {args.rounds} alternated rounds; "
        "ops: aten operations dispatched in one round"
    )
    print(
        "| algorithm | clients | seq s/round | split s/round | padded s/round | padded vs seq "
        "| padded vs split | stacked cohorts/phase split | padded | ops seq | split | padded |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for algorithm in args.algorithms:
        for clients in args.clients:
            r = measure(clients, algorithm, args.rounds, args.device, names)
            seq, split, pad = (r.get(name, MISSING) for name in SIDES)
            print(
                f"| {algorithm} | {clients} | {seq['s']:.3f} | {split['s']:.3f} | "
                f"{pad['s']:.3f} | {seq['s'] / pad['s']:.2f}x | {split['s'] / pad['s']:.2f}x | "
                f"{split['cohorts_per_phase']:.1f} | {pad['cohorts_per_phase']:.1f} | "
                f"{seq['ops']:,} | {split['ops']:,} | {pad['ops']:,} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
