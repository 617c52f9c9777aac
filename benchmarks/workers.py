"""``[runtime] backend = "processes"``: a steady 10-client demo round on 2 worker processes
against 1 worker (which runs the clients in this process, as the sequential backend does).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/workers.py [--rounds 7] [--workers 2]
    # issue 30's size: an MLP of about 1M parameters (64-1000-1000-10: 1,075,010)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/workers.py --hidden 1000 1000
    # and the workers' tensors through the pipe as well, against shared memory (the default)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/workers.py --hidden 1000 1000 --wires shared pipe

Both runs are built from the demo config (``examples/demo.toml``: RABO + CG, masks, the
10-client device fleet) and warmed up with round 0 (it measures FLOPs and starts the pool).
Then rounds 1..N alternate between the two (2 workers first in odd rounds, 1 worker first in
even ones); each round is one ``Simulation.step`` (no evaluation). Reported: the median wall
time and the median CPU time of this process plus its worker processes (and each apart), the
speed-up of the medians, and the share of a 1-worker round spent in the client phases (the
part workers run in parallel; the rest -- sampling, masks, broadcast, aggregation -- bounds
the speed-up).
With ``--wires shared pipe`` a third run, 2 workers whose tensors cross in the pipe
(``ProcessBackend(shared_memory=False)``), joins the alternation; with
``--one-thread-server``, one of 2 workers whose server aggregates on one thread. All runs
compute the same states bitwise, which is checked. ``--profile K`` then runs K more rounds
of the first multi-worker side under cProfile and prints where this (the simulating) process
spent its time, waiting for workers included. Run it on an otherwise idle
machine: the figure is only meaningful with two free cores; printed beside it is the share of
the CPUs that other processes used during the measurement (from ``/proc/stat``, so it sees
processes of other containers on the same machine too) and the load average.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import radbo.aggregation as aggregation  # noqa: E402
from radbo.experiment import build  # noqa: E402
from radbo.simulation import ProcessBackend  # noqa: E402
from radbo.simulation.processes import usable_cpus  # noqa: E402
from tests.configs import small_config  # noqa: E402


class ServerThreads(ProcessBackend):
    """A process backend whose server aggregates on ``server_threads`` threads (by default
    as many as there are workers; 1 for the ``--one-thread-server`` side)."""

    def __init__(self, workers: int, *, shared_memory: bool, server_threads: int) -> None:
        super().__init__(workers, shared_memory=shared_memory)
        self._server_threads = server_threads

    @property
    def server_threads(self) -> int:
        return self._server_threads


def cpu_seconds(backend: ProcessBackend) -> tuple[float, float]:
    """User + system CPU seconds of this process, and of the backend's worker processes."""
    workers = 0.0
    for pid in backend.pids():
        t = psutil.Process(pid).cpu_times()
        workers += t.user + t.system
    return time.process_time(), workers


def timed(run: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    """``run`` adding its wall time to ``spent[-1]`` (the client phases of the current round)."""

    def wrapper(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return run(*args)
        finally:
            spent[-1] += time.perf_counter() - start

    return wrapper


#: where the aggregation's wall time goes: ``AGGREGATING[0][-1]``, the current side's round
AGGREGATING: list[list[float]] = [[0.0]]


def _timed_mean(*args: Any) -> Any:
    """:func:`radbo.aggregation._weighted_mean` (the arithmetic of every coverage-weighted
    mean), its wall time added to the current side's round (:data:`AGGREGATING`)."""
    start = time.perf_counter()
    try:
        return _WEIGHTED_MEAN(*args)
    finally:
        AGGREGATING[0][-1] += time.perf_counter() - start


_WEIGHTED_MEAN = aggregation._weighted_mean


def machine_busy_s() -> float:
    """CPU seconds every process of this machine used since boot, all CPUs (``/proc/stat``;
    NaN where there is none): other processes' share during a measurement is this one's
    difference minus our own CPU time."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def same_state(a: Any, b: Any, sim: Any) -> bool:
    ma, mb = sim.algorithm.model_state(a), sim.algorithm.model_state(b)
    return all(torch.equal(ma[k], mb[k]) for k in ma)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="steady rounds per worker count")
    parser.add_argument("--workers", type=int, default=2, help="the worker count set against 1")
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=None, help="MLP hidden widths (default: demo's)"
    )
    parser.add_argument(
        "--wires",
        nargs="+",
        choices=("shared", "pipe"),
        default=["shared"],
        help="how the workers' tensors cross: shared memory (default) and/or the pipe",
    )
    parser.add_argument(
        "--one-thread-server",
        action="store_true",
        help="also 2 workers whose server aggregates on one thread (as before server_threads)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="K", help="K more rounds under cProfile"
    )
    args = parser.parse_args()
    model = {} if args.hidden is None else {"model": {"name": "mlp", "hidden": args.hidden}}
    n = args.workers
    torch.set_num_threads(1)
    aggregation._weighted_mean = _timed_mean  # type: ignore[assignment]
    # label -> (workers, shared memory, server threads, what it is); the first side is the
    # 1-worker reference
    sides = {"1": (1, True, 1, "1 worker")}
    for wire in args.wires:
        shared = wire == "shared"
        label = str(n) if shared else f"{n}-pipe"
        sides[label] = (n, shared, n, f"{n} workers" + ("" if shared else ", tensors in the pipe"))
    if args.one_thread_server:
        sides[f"{n}-1t"] = (n, True, 1, f"{n} workers, aggregation on 1 thread")
    runs = {}
    for side, (workers, shared, threads, _) in sides.items():
        runtime = {"backend": "processes", "workers": workers}
        exp = build(small_config(rounds=args.rounds + 1, runtime=runtime, **model))
        sim = exp.simulation
        sim.backend = ServerThreads(workers, shared_memory=shared, server_threads=threads)
        AGGREGATING[0] = [0.0]  # not counted
        state, _ = sim.step(exp.initial_state, 0)  # warm-up: FLOP measurements, pool start
        r = {"sim": sim, "state": state, "wall": [], "cpu": [], "clients": [], "phases": [0.0]}
        r["own"], r["workers"] = [], []
        r["aggregation"] = AGGREGATING[0] = [0.0]
        sim.backend.run = timed(sim.backend.run, r["phases"])  # type: ignore[method-assign]
        runs[side] = r
    busy0, start = machine_busy_s(), time.perf_counter()
    order = list(sides)
    for q in range(1, args.rounds + 1):
        for side in order[::-1] if q % 2 else order:
            r = runs[side]
            backend = r["sim"].backend
            AGGREGATING[0] = r["aggregation"]
            (own0, workers0), wall0 = cpu_seconds(backend), time.perf_counter()
            r["state"], record = r["sim"].step(r["state"], q)
            r["wall"].append(time.perf_counter() - wall0)
            own1, workers1 = cpu_seconds(backend)
            r["own"].append(own1 - own0)
            r["workers"].append(workers1 - workers0)
            r["cpu"].append(r["own"][-1] + r["workers"][-1])
            r["clients"].append(len(record.clients))
            r["phases"].append(0.0)
            r["aggregation"].append(0.0)
    ours = sum(sum(r["cpu"]) for r in runs.values())
    others = (machine_busy_s() - busy0 - ours) / ((time.perf_counter() - start) * usable_cpus())
    ref = runs["1"]
    equal = all(same_state(ref["state"], r["state"], ref["sim"]) for r in runs.values())
    profile = None
    if args.profile > 0:
        r = runs[order[1]]
        AGGREGATING[0] = [0.0]  # not counted
        profile = cProfile.Profile()
        profile.enable()
        for q in range(args.rounds + 1, args.rounds + 1 + args.profile):
            r["state"], _ = r["sim"].step(r["state"], q)
        profile.disable()
    for r in runs.values():
        r["sim"].backend.close()
    load = os.getloadavg()
    size = sum(math.prod(s) for s in ref["sim"].shapes.values())
    clients = statistics.mean(ref["clients"])
    print(
        f"demo round ({size:,} model numbers; 10-client fleet, {clients:.1f} clients per "
        f"round on average), median of {args.rounds} alternated steady rounds, "
        f"torch {torch.__version__}, {usable_cpus()} CPUs; other processes used "
        f"{100 * max(others, 0.0):.0f} % of them meanwhile, load average "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min) at the end"
    )
    wall = {w: statistics.median(r["wall"]) for w, r in runs.items()}
    cpu = {w: statistics.median(r["cpu"]) for w, r in runs.items()}
    for side, (*_, name) in sides.items():
        own, workers = (1e3 * statistics.median(runs[side][k]) for k in ("own", "workers"))
        print(
            f"  {name}: wall {1e3 * wall[side]:7.1f} ms, CPU {1e3 * cpu[side]:7.1f} ms "
            f"(this process {own:.1f} ms, worker processes {workers:.1f} ms)"
        )
    for side in order[1:]:
        print(
            f"  speed-up, {sides[side][3]} vs 1 worker: wall {wall['1'] / wall[side]:.2f}x, "
            f"CPU {cpu['1'] / cpu[side]:.2f}x"
        )
    # the rest of a round (sampling, masks, broadcast, screening, the server's step) runs in
    # this process alone; with n workers the aggregation runs on n threads (server_threads)
    share = statistics.median(p / w for p, w in zip(ref["phases"], ref["wall"], strict=False))
    agg = statistics.median(a / w for a, w in zip(ref["aggregation"], ref["wall"], strict=False))
    k = min(n, usable_cpus())
    bound = 1 / (1 - share - agg + (share + agg) / k)
    print(
        f"  client phases {100 * share:.0f} % and aggregation {100 * agg:.0f} % of a 1-worker "
        f"round; the rest is serial, so {k} workers (the aggregation on {k} threads) can "
        f"reach at most {bound:.2f}x on {k} CPUs (Amdahl)"
    )
    for side in order:
        print(
            f"  {sides[side][3]}: client phases "
            f"{1e3 * statistics.median(runs[side]['phases'][:-1]):.1f} ms, aggregation "
            f"{1e3 * statistics.median(runs[side]['aggregation'][:-1]):.1f} ms per round"
        )
    print(f"  final states bitwise equal: {equal}")
    print(f"  per round (clients: wall ms of {' / '.join(str(side) for side in order)} workers):")
    for q, clients in enumerate(ref["clients"], start=1):
        walls = [1e3 * runs[side]["wall"][q - 1] for side in order]
        ratios = ", ".join(f"{walls[0] / w:.2f}x" for w in walls[1:])
        print(
            f"    round {q}: {clients} clients: {' / '.join(f'{w:6.1f}' for w in walls)} ({ratios})"
        )
    if profile is not None:
        print(f"  where this process spent {args.profile} rounds on {order[1]} workers (cProfile):")
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
