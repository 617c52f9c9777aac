"""How evenly can 2 workers share a round's client tasks? (issue 30, the process backend)

``benchmarks/workers.py --hidden 1000 1000`` measured 2 worker processes at 1.2-1.5x one in
the client phases, not the 2x two CPUs allow. One candidate is the split: a phase has 8-10
tasks of unequal size (capacities 1, 1/2 and 1/4). This script builds the same run (the demo
config with a 64-1000-1000-10 MLP, ``backend = "processes"``) with 1 worker, which runs the
tasks in this process one after the other, times every task of ``--rounds`` steady rounds,
and for each phase prints the sum of its task times against

- the best split of its tasks between 2 workers (every subset tried: the least makespan), and
- the split the process backend makes: tasks in its order (biggest received size first,
  ``radbo.simulation.processes._size``), each to whichever worker is free first,

as the speed-up each would give with no cost of handing tasks over and no contention. The
figures for all phases together close the output.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/task_balance.py [--rounds 8] [--hidden 1000 1000]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import radbo.simulation.processes as processes  # noqa: E402
from radbo.experiment import build  # noqa: E402
from tests.configs import small_config  # noqa: E402


def best_split(times: list[float]) -> float:
    """The least makespan of ``times`` on 2 workers (every subset tried; phases are small)."""
    total = sum(times)
    return min(
        max(part := sum(times[i] for i in subset), total - part)
        for r in range(len(times) + 1)
        for subset in itertools.combinations(range(len(times)), r)
    )


def backend_split(times: list[float], sizes: list[int], workers: int = 2) -> float:
    """The makespan of the process backend's order: biggest size first, to the first free."""
    free = [0.0] * workers
    for i in sorted(range(len(times)), key=lambda i: -sizes[i]):
        k = free.index(min(free))
        free[k] += times[i]
    return max(free)


def task_times(hidden: list[int], rounds: int) -> list[list[tuple[float, int]]]:
    """(seconds, received size x local steps) of every task, per phase of ``rounds`` steady
    rounds run by 1 worker."""
    torch.set_num_threads(1)
    model = {"model": {"name": "mlp", "hidden": hidden}}
    runtime = {"backend": "processes", "workers": 1}
    exp = build(small_config(rounds=rounds + 1, runtime=runtime, **model))
    sim = exp.simulation
    phases: list[list[tuple[float, int]]] = []
    measured = processes.run_measured

    def timed(work: Any, runtime: Any, meter: Any, task: Any, result: Any = None) -> Any:
        start = time.perf_counter()
        out = measured(work, runtime, meter, task, result)
        phases[-1].append((time.perf_counter() - start, processes._size(task)))
        return out

    run = sim.backend.run

    def each_phase(work: Any, runtime: Any, meter: Any, tasks: Any) -> Any:
        phases.append([])
        return run(work, runtime, meter, tasks)

    processes.run_measured = timed  # type: ignore[assignment]
    sim.backend.run = each_phase  # type: ignore[method-assign]
    try:
        state, _ = sim.step(exp.initial_state, 0)  # round 0 measures FLOPs: not counted
        phases.clear()
        for q in range(1, rounds + 1):
            state, _ = sim.step(state, q)
    finally:
        processes.run_measured = measured  # type: ignore[assignment]
        sim.backend.close()
    return [phase for phase in phases if phase]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="steady rounds timed")
    parser.add_argument("--hidden", type=int, nargs="+", default=[1000, 1000])
    args = parser.parse_args(argv)
    total = best = ours = 0.0
    for phase in task_times(args.hidden, args.rounds):
        times = [t for t, _ in phase]
        s, b, o = sum(times), best_split(times), backend_split(times, [n for _, n in phase])
        total, best, ours = total + s, best + b, ours + o
        print(
            f"{len(times)} tasks: sum {s * 1e3:6.1f} ms; best split {b * 1e3:6.1f} ms "
            f"({s / b:.2f}x); backend's order {o * 1e3:6.1f} ms ({s / o:.2f}x); tasks (ms): "
            + " ".join(f"{t * 1e3:.0f}" for t in times)
        )
    print(
        f"all phases: {total * 1e3:.0f} ms of tasks; on 2 workers at best {total / best:.2f}x, "
        f"in the backend's order {total / ours:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
