"""Python's garbage collector during a round: paused (the default) against running (issue 30).

A round of many clients makes and drops tens of thousands of Python objects; CPython's
generational collector promotes those alive when it runs, and after enough promotions walks
every object the process tracks. ``Simulation.pause_gc`` (default ``True``) pauses it for the
length of :meth:`radbo.simulation.Simulation.step` (:mod:`radbo.simulation.collection`).

For each ``--clients`` size, each side (``pause_gc`` on, "paused", and off, "running") runs in
a fresh process, since the collector and the objects it walks are the process's: it builds the
demo fleet (:func:`benchmarks.gpu.demo_fleet`, ``--backend``), steps two warm-up rounds, then
``--rounds`` timed rounds. The sides alternate, ``--repeats`` times each (the side that goes
first swaps every repetition). Per side: seconds per round as the mean of the timed rounds
(a full collection lands in one round of several, so a median would pass over it; the table
gives the median over repetitions of these means, and their range), the collector's own time
and collections per round (``gc.callbacks``), and the objects one more round leaves to the
collector (``gc.collect()`` after it: cyclic garbage, which reference counting cannot free;
after a paused round, what the collector must still find once it runs again). Both sides run
the same rounds from the same seed, so their final states must be bitwise equal; the script
compares digests of them and exits 1 if they differ.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gc_pause.py --clients 10 100 1000
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gpu import Runner, demo_fleet  # noqa: E402

SIDES = ("running", "paused")


class CollectorClock:
    """The collector's time and collections by generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.counts = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.counts[info["generation"]] += 1


def digest(state: Any) -> str:
    """A SHA-256 of every tensor of an algorithm state (by field and name) and its other
    fields' text: equal digests mean bitwise equal states."""
    h = hashlib.sha256()
    for name, value in sorted(vars(state).items()):
        h.update(name.encode())
        items = sorted(value.items()) if isinstance(value, dict) else [("", value)]
        for key, item in items:
            h.update(str(key).encode())
            if isinstance(item, torch.Tensor):
                h.update(str((item.dtype, tuple(item.shape))).encode())
                h.update(item.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(item).encode())
    return h.hexdigest()


def child(clients: int, backend: str, rounds: int, side: str) -> dict[str, Any]:
    """One side in this process (see the module docstring)."""
    torch.set_num_threads(1)
    data = demo_fleet(clients)
    data["runtime"] = {"backend": backend}
    runner = Runner(data, "cpu")
    runner.exp.simulation.pause_gc = side == "paused"
    runner.step()
    runner.step()
    clock = CollectorClock()
    gc.callbacks.append(clock)
    seconds = [runner.step() for _ in range(rounds)]
    gc.callbacks.remove(clock)
    gc.collect()
    runner.step()
    left = gc.collect()
    return {
        "side": side,
        "s": sum(seconds) / rounds,
        "gc_s": clock.seconds / rounds,
        "collections": [c / rounds for c in clock.counts],
        "left": left,
        "tracked": len(gc.get_objects()),
        "digest": digest(runner.state),
    }


def run_side(clients: int, backend: str, rounds: int, side: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", side, "--clients", str(clients)]
    command += ["--backend", backend, "--rounds", str(rounds)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {side} side at {clients} clients failed: {tail}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(clients: int, backend: str, rounds: int, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for r in range(repeats):
        for side in SIDES if r % 2 == 0 else reversed(SIDES):
            runs[side].append(run_side(clients, backend, rounds, side))
    digests = {run["digest"] for side in SIDES for run in runs[side]}
    return {"clients": clients, "runs": runs, "equal": len(digests) == 1}


def summary(values: list[float], scale: float = 1e3) -> str:
    mid = statistics.median(values) * scale
    if len(values) == 1:
        return f"{mid:.1f}"
    return f"{mid:.1f} ({min(values) * scale:.1f}-{max(values) * scale:.1f})"


def table(rows: list[dict[str, Any]], backend: str, rounds: int) -> str:
    lines = [
        f"backend {backend}; torch {torch.__version__}; {rounds} timed rounds per run; "
        "medians over the runs (range)",
        "",
        "| clients | running: ms/round | paused: ms/round | running / paused | collector while "
        "running: ms/round | collections per round, generations 0/1/2 | collector while paused: "
        "ms/round | objects tracked | cyclic garbage per round | final states bitwise equal |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for row in rows:
        run, pause = row["runs"]["running"], row["runs"]["paused"]
        ratio = statistics.median([r["s"] for r in run])
        ratio /= statistics.median([p["s"] for p in pause])
        gens = "/".join(
            f"{statistics.median([r['collections'][g] for r in run]):.1f}" for g in range(3)
        )
        left = max(r["left"] for side in SIDES for r in row["runs"][side])
        tracked = max(r["tracked"] for side in SIDES for r in row["runs"][side])
        lines.append(
            f"| {row['clients']} | {summary([r['s'] for r in run])} | "
            f"{summary([p['s'] for p in pause])} | {ratio:.2f}x | "
            f"{summary([r['gc_s'] for r in run])} | {gens} | "
            f"{summary([p['gc_s'] for p in pause])} | {tracked:,} | {left} | {row['equal']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--backend", default="batched", help='"batched" or "sequential"')
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        (clients,) = args.clients
        print(json.dumps(child(clients, args.backend, args.rounds, args.child)))
        return 0
    rows = [measure(n, args.backend, args.rounds, args.repeats) for n in args.clients]
    print(table(rows, args.backend, args.rounds))
    return 0 if all(row["equal"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
