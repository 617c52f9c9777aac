"""Where a batched phase spends the time a sequential one does not: aten operations side by side.

Builds one workload of ``benchmarks/batched.py`` (``--model``, ``--algorithm``, ``--clients``)
and runs its first phase, one task per client, on the sequential backend and on the batched one
(``--max-group``: stacks of at most that many clients), each warmed up twice, then profiles
``--repeats`` runs of each side with ``torch.profiler`` (CPU activity) and prints, per aten
operation, the mean self CPU time and call count of one run on each side, the operations whose
time differs most first. Run with one thread:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/op_diff.py --model simple_cnn --algorithm fedavg --clients 10
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/op_diff.py --model simple_cnn --algorithm fedavg --clients 10 --max-group 2
"""  # noqa: E501

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.batched import ALGORITHMS, MODELS, experiment, first_phase_tasks  # noqa: E402
from radbo.allocator import retain_freed_memory  # noqa: E402
from radbo.simulation import BatchedBackend, SequentialBackend  # noqa: E402


def operation_times(run: object, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per operation, the mean self CPU time (ms) and call count of one ``run()``."""
    times: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for _ in range(repeats):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()  # type: ignore[operator]
        for event in prof.key_averages():
            times[event.key] += event.self_cpu_time_total / 1e3 / repeats
            calls[event.key] += event.count / repeats
    return dict(times), dict(calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="simple_cnn", choices=list(MODELS))
    parser.add_argument("--algorithm", default="fedavg", choices=list(ALGORITHMS))
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--max-group", type=int, help="stacks of at most this many clients")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    if min(args.clients, args.repeats, args.top, args.max_group or 1) < 1:
        parser.error("--clients, --repeats, --top and --max-group must be >= 1")
    retain_freed_memory()  # as radbo run does by default
    exp = experiment(args.algorithm, args.clients, args.model)
    sim = exp.simulation
    work, tasks = first_phase_tasks(exp)
    sides = {"sequential": SequentialBackend(), "batched": BatchedBackend(max_group=args.max_group)}
    runs = {k: (lambda b=b: b.run(work, sim.runtime, None, tasks)) for k, b in sides.items()}
    for run in runs.values():  # warm-up: skeletons, kernels, allocator
        run()
        run()
    seq, bat = (operation_times(runs[k], args.repeats) for k in sides)
    stack = f"stacks of at most {args.max_group}" if args.max_group else "one stack per cohort"
    print(
        f"## {args.model}, {args.algorithm}, {args.clients} clients, first phase; batched: "
        f"{stack}; torch {torch.__version__}, {torch.get_num_threads()} thread(s), mean of "
        f"{args.repeats} profiled runs"
    )
    print(f"total self CPU time: sequential {sum(seq[0].values()):.1f} ms, batched "
          f"{sum(bat[0].values()):.1f} ms")  # fmt: skip
    print("| operation | sequential (ms) | calls | batched (ms) | calls | batched - sequential |")
    print("|---|---:|---:|---:|---:|---:|")
    names = set(seq[0]) | set(bat[0])
    ranked = sorted(names, key=lambda n: -abs(bat[0].get(n, 0.0) - seq[0].get(n, 0.0)))
    for name in ranked[: args.top]:
        a, b = seq[0].get(name, 0.0), bat[0].get(name, 0.0)
        print(
            f"| {name} | {a:.1f} | {seq[1].get(name, 0):.0f} | {b:.1f} | "
            f"{bat[1].get(name, 0):.0f} | {b - a:+.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
