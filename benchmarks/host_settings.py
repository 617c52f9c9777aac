"""Two process settings of a round's host side, each on against off (issue 30).

- ``--setting gc``: Python's cyclic garbage collector paused for the length of
  :meth:`radbo.simulation.Simulation.step` (``Simulation.pause_gc``, default ``True``;
  :mod:`radbo.simulation.collection`) against running. A round of many clients makes and
  drops tens of thousands of Python objects; the collector promotes those alive when it runs,
  and after enough promotions walks every object the process tracks.
- ``--setting allocator``: glibc's malloc keeping freed memory for reuse
  (``[runtime] allocator = "retain"``, the default, which :func:`radbo.run` applies;
  :func:`radbo.allocator.retain_freed_memory`) against the C library's own behaviour, which
  unmaps large freed blocks and trims its heap, so that the next round faults their pages
  in again.
- ``--setting trim``: that kept heap with glibc's trimming off (``"retain"`` as it is) against
  the same with a 1 GiB trim threshold (what ``"retain"`` set before): a threshold is a cliff,
  at which glibc gives back the whole free top of its heap (:mod:`radbo.allocator`), which
  only a round that frees more than the threshold at once reaches (``--workload
  simple_cnn:rabo --clients 50``).

For each ``--clients`` size, each side runs in a fresh process (the collector, the allocator
and the memory they manage are the process's): it builds the demo fleet
(:func:`benchmarks.gpu.demo_fleet`, ``--backend``; or, with ``--workload MODEL:ALGORITHM``, a
workload of ``benchmarks/batched.py``), steps two warm-up rounds, then
``--rounds`` timed rounds. The sides alternate, ``--repeats`` times each (the side that goes
first swaps every repetition). Per side: seconds per round as the mean of the timed rounds
(a full collection or a trimmed heap lands in one round of several, which a median would
pass over; the table gives the median over repetitions of these means, and their range);
the collector's own time and collections per round (``gc.callbacks``); minor page faults and
system CPU time per round (``getrusage``); resident memory after the rounds and at its peak;
and the objects one more round leaves to the collector (``gc.collect()`` after it: cyclic
garbage, which reference counting cannot free). Both sides run the same rounds from the same
seed, so their final states must be bitwise equal; the script compares digests of them and
exits 1 if they differ.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_settings.py --setting gc
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_settings.py --setting allocator
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_settings.py --setting trim \\
        --workload simple_cnn:rabo --clients 50 --rounds 3 --repeats 2
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.batched import ALGORITHMS, MODELS, experiment_data  # noqa: E402
from benchmarks.bitwise_reference import tensors  # noqa: E402
from benchmarks.gpu import Runner, demo_fleet  # noqa: E402
from radbo.allocator import _M_TRIM_THRESHOLD, _glibc, retain_freed_memory  # noqa: E402

#: per setting: (the side without it, the side with it)
SIDES = {
    "gc": ("running", "paused"),
    "allocator": ("system", "retain"),
    "trim": ("trim_1gib", "no_trim"),
}
#: the models ``--workload`` takes: those of ``benchmarks/batched.py``
WORKLOAD_MODELS = sorted({*MODELS, "simple_cnn"})


def workload_data(workload: str, clients: int) -> dict[str, Any]:
    """The config of ``"demo"`` or of ``"MODEL:ALGORITHM"`` (``benchmarks/batched.py``)."""
    if workload == "demo":
        return demo_fleet(clients)
    model, _, algorithm = workload.partition(":")
    return experiment_data(algorithm, clients, model)


def check_workload(workload: str) -> str:
    """``--workload``'s parser: ``demo`` or a model and algorithm of ``benchmarks/batched.py``."""
    model, _, algorithm = workload.partition(":")
    if workload != "demo" and (model not in WORKLOAD_MODELS or algorithm not in ALGORITHMS):
        raise argparse.ArgumentTypeError(
            f"{workload!r}: 'demo' or MODEL:ALGORITHM with MODEL in {WORKLOAD_MODELS} and "
            f"ALGORITHM in {sorted(ALGORITHMS)}"
        )
    return workload


def set_allocator(setting: str, side: str) -> None:
    """This process's allocator for one side (see the module docstring)."""
    if (setting == "allocator" and side == "retain") or setting == "trim":
        if not retain_freed_memory():
            raise RuntimeError("glibc refused radbo's allocator setting")
    if setting == "trim" and side == "trim_1gib":
        libc = _glibc()
        if libc is None or libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) != 1:
            raise RuntimeError("glibc refused a 1 GiB trim threshold")


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
    """A SHA-256 of every tensor of an algorithm state, by path
    (:func:`benchmarks.bitwise_reference.tensors`): equal digests mean bitwise equal states."""
    h = hashlib.sha256()
    for path, tensor in sorted(tensors(state).items()):
        h.update(f"{path} {tensor.dtype} {tuple(tensor.shape)}".encode())
        h.update(tensor.cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def child(
    setting: str, side: str, clients: int, backend: str, rounds: int, workload: str = "demo"
) -> dict[str, Any]:
    """One side in this process (see the module docstring)."""
    torch.set_num_threads(1)
    set_allocator(setting, side)
    data = workload_data(workload, clients)
    data["runtime"] = {**data.get("runtime", {}), "backend": backend}
    runner = Runner(data, "cpu")
    runner.exp.simulation.pause_gc = not (setting == "gc" and side == "running")
    runner.step()
    runner.step()
    clock = CollectorClock()
    gc.callbacks.append(clock)
    before = resource.getrusage(resource.RUSAGE_SELF)
    seconds = [runner.step() for _ in range(rounds)]
    after = resource.getrusage(resource.RUSAGE_SELF)
    gc.callbacks.remove(clock)
    rss = psutil.Process().memory_info().rss / 2**20
    gc.collect()
    runner.step()
    left = gc.collect()
    return {
        "s": sum(seconds) / rounds,
        "gc_s": clock.seconds / rounds,
        "collections": [c / rounds for c in clock.counts],
        "faults": (after.ru_minflt - before.ru_minflt) / rounds,
        "sys_s": (after.ru_stime - before.ru_stime) / rounds,
        "rss_mb": rss,
        "peak_mb": after.ru_maxrss / 1024,  # Linux reports kB
        "left": left,
        "digest": digest(runner.state),
    }


def run_side(args: argparse.Namespace, clients: int, side: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--setting", args.setting, "--child", side]
    command += ["--clients", str(clients), "--backend", args.backend, "--rounds", str(args.rounds)]
    command += ["--workload", args.workload]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {side} side at {clients} clients failed: {tail}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(args: argparse.Namespace, clients: int) -> dict[str, Any]:
    sides = SIDES[args.setting]
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(args.repeats):
        for side in sides if r % 2 == 0 else reversed(sides):
            runs[side].append(run_side(args, clients, side))
    digests = {run["digest"] for side in sides for run in runs[side]}
    return {"clients": clients, "runs": runs, "equal": len(digests) == 1}


def summary(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    mid = statistics.median(values) * scale
    if len(values) == 1:
        return f"{mid:.{digits}f}"
    return f"{mid:.{digits}f} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    off, on = SIDES[args.setting]
    lines = [
        f"setting {args.setting}; workload {args.workload}; backend {args.backend}; "
        f"torch {torch.__version__}; "
        f"{args.rounds} timed rounds per run, {args.repeats} run(s) per side; medians over "
        "the runs (range)",
        "",
        f"| clients | {off}: ms/round | {on}: ms/round | {off} / {on} | collector, {off}: "
        f"ms/round | collections per round, {off}: generations 0/1/2 | page faults per round, "
        f"{off} / {on} | system CPU per round, {off} / {on} (ms) | resident memory after the "
        f"rounds, {off} / {on} (MB) | peak, {off} / {on} (MB) | cyclic garbage per round | "
        "final states bitwise equal |",
        "|---:|---:|---:|---:|---:|---|---|---|---|---|---:|---|",
    ]

    def both(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str, scale: float = 1.0,
             digits: int = 0) -> str:  # fmt: skip
        return (
            f"{summary([r[key] for r in a], scale, digits)} / "
            f"{summary([r[key] for r in b], scale, digits)}"
        )

    for row in rows:
        a, b = row["runs"][off], row["runs"][on]

        ratio = statistics.median([r["s"] for r in a]) / statistics.median([r["s"] for r in b])
        gens = "/".join(
            f"{statistics.median([r['collections'][g] for r in a]):.1f}" for g in range(3)
        )
        lines.append(
            f"| {row['clients']} | {summary([r['s'] for r in a], 1e3)} | "
            f"{summary([r['s'] for r in b], 1e3)} | {ratio:.2f}x | "
            f"{summary([r['gc_s'] for r in a], 1e3)} | {gens} | {both(a, b, 'faults')} | "
            f"{both(a, b, 'sys_s', 1e3, 1)} | {both(a, b, 'rss_mb')} | {both(a, b, 'peak_mb')} | "
            f"{max(r['left'] for r in a + b)} | {row['equal']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--setting", choices=sorted(SIDES), required=True)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--backend", default="batched", help='"batched" or "sequential"')
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side")
    parser.add_argument(
        "--workload",
        type=check_workload,
        default="demo",
        help='"demo" (the demo fleet) or MODEL:ALGORITHM of benchmarks/batched.py, '
        'e.g. "simple_cnn:rabo"',
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        (clients,) = args.clients
        result = child(args.setting, args.child, clients, args.backend, args.rounds, args.workload)
        print(json.dumps(result))
        return 0
    rows = [measure(args, n) for n in args.clients]
    print(table(rows, args))
    return 0 if all(row["equal"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
