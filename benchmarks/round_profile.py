"""Where one steady round's time goes, on the device it runs on (issue 30, item 3).

Builds the demo fleet of ``--clients`` clients on the batched backend
(:func:`benchmarks.gpu.demo_fleet`), steps rounds 0 and 1 (round 0 measures FLOPs, round 1
loads the kernels), times ``--rounds`` more rounds, then profiles one round twice:

- with ``torch.profiler`` (CPU and, on a GPU, CUDA activity): the calls into the CUDA runtime
  by name (kernel launches, copies, synchronisations: each ``cudaStreamSynchronize`` and each
  pageable ``cudaMemcpyAsync`` stops the host), the summed time of the device's kernels
  against the round's wall time, the aten operations with the most host time, and the host
  time outside operations (an unprofiled round's wall time less the operations' and runtime
  calls' own host time: radbo's Python and the autograd engine, which no GPU, launch or CUDA
  graph makes faster);
- with ``torch.profiler`` and Python stacks: the radbo lines that issue the aten operations
  named by ``--sites-of``; by default the host reads (``.item()``, ``bool(t)``: on a GPU each
  a synchronisation), ``nonzero`` (likewise) and ``_to_copy`` (conversions and copies between
  devices, a pageable host-to-GPU copy being a synchronisation too). CUDA runtime calls
  (``cudaMemcpyAsync``, ...) are listed in the first part but have no call site: the profiler
  does not link them to the Python frames around them;
- with ``cProfile``: radbo's functions by their own host time (``tottime``) and by their
  time with callees (``cumtime``), so that a round's host time can be traced to the code
  that spends it. cProfile's own cost inflates both columns; read them as shares.

    .venv/bin/python benchmarks/round_profile.py --device cuda --clients 100 1000
    .venv/bin/python benchmarks/round_profile.py --device cuda --clients 100 --cuda-graphs
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/round_profile.py --clients 100
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gpu import Runner, demo_fleet  # noqa: E402

RUNTIME_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemsetAsync",
    "cudaEventRecord",
    "cudaStreamWaitEvent",
)


def torch_profile(runner: Runner, top: int, wall_ms: float) -> None:
    """One round under ``torch.profiler``: runtime calls, device time, top aten operations,
    and the host time outside operations against ``wall_ms``, an unprofiled round's wall
    time (:func:`outside_operations`)."""
    activities = [ProfilerActivity.CPU]
    if runner.cuda:
        activities.append(ProfilerActivity.CUDA)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        runner.step()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    print(f"profiled round: {wall * 1e3:.1f} ms wall (profiler overhead included)")
    calls = {e.key: e for e in events if e.key in RUNTIME_CALLS}
    for name in RUNTIME_CALLS:
        if name in calls:
            e = calls[name]
            print(f"  {name}: {e.count} calls, {e.self_cpu_time_total / 1e3:.1f} ms host")
    if runner.cuda:
        device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in device) / 1e3  # microseconds -> ms
        launched = sum(e.count for e in device)
        print(f"  device activity: {launched} kernels and copies, {busy:.1f} ms summed")
    aten = [e for e in events if e.key.startswith("aten::")]
    aten.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.count for e in aten)
    print(f"  aten operations: {total} (nested ones included); most host time (self):")
    for e in aten[:top]:
        print(f"    {e.key:40s} {e.count:7d} calls {e.self_cpu_time_total / 1e3:9.1f} ms")
    inside = sum(e.self_cpu_time_total for e in aten) / 1e3
    inside += sum(e.self_cpu_time_total for e in calls.values()) / 1e3
    print(outside_operations(wall_ms, inside))


def outside_operations(wall_ms: float, inside_ms: float) -> str:
    """The host time of a round spent outside operations: ``wall_ms`` (a round without the
    profiler) less ``inside_ms``, the profiled round's own host time of its aten operations
    and CUDA runtime calls (on a GPU, the launches). What is left is radbo's Python, the
    autograd engine's and the dispatcher's own work between operations: a GPU round cannot
    take less host time than this whatever its kernels and launches cost (CUDA graphs replay
    operations, not this). The profiler only adds to the operations' own times, so for a
    round like the unprofiled ones the difference errs low."""
    outside = max(wall_ms - inside_ms, 0.0)
    share = outside / wall_ms if wall_ms > 0 else 0.0
    return (
        f"  host time outside operations: about {outside:.1f} ms of a {wall_ms:.1f} ms round "
        f"({share:.0%}; operations' own host time {inside_ms:.1f} ms, profiled)"
    )


def call_sites(runner: Runner, names: list[str], top: int) -> None:
    """One round under ``torch.profiler`` with Python stacks: the radbo lines that issue each
    of ``names`` (aten operations), the two innermost radbo frames among the events that
    enclose it ("?" where none does)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        runner.step()
    sites: collections.Counter[tuple[str, str]] = collections.Counter()
    for event in prof.events():
        if event.name not in names:
            continue
        frames, holder = [], event.cpu_parent  # Python frames are the events around it
        while holder is not None and len(frames) < 2:
            if "radbo/" in holder.name and ".py(" in holder.name:
                frames.append(holder.name[holder.name.rindex("radbo/") :])
            holder = holder.cpu_parent
        where = " <- ".join(frames) or "?"
        sites[(event.name, where)] += 1
    print(f"  call sites of {', '.join(names)}:")
    for (name, where), n in sites.most_common(top):
        print(f"    {n:6d}  {name}  {where}")


def python_profile(runner: Runner, top: int) -> None:
    """One round under ``cProfile``: radbo's functions by own time and by time with callees."""
    prof = cProfile.Profile()
    prof.enable()
    runner.step()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/radbo/" in path and "/benchmarks/" not in path:
            where = path[path.rindex("/radbo/") + 1 :]
            rows.append((f"{where}:{line} {func}", calls, tottime, cumtime))
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"cProfile round: {total * 1e3:.1f} ms host in all functions")
    for key, label in ((2, "own time"), (3, "with callees")):
        print(f"  radbo functions by {label}:")
        for row in sorted(rows, key=lambda r: r[key], reverse=True)[:top]:
            print(
                f"    {row[2] * 1e3:8.1f} ms own {row[3] * 1e3:8.1f} ms cum {row[1]:7d}x  {row[0]}"
            )
    by_op: collections.Counter[str] = collections.Counter()
    for (path, _, func), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if path == "~":  # built-ins: torch's C functions among them
            by_op[func] += tottime
    print("  built-in calls by own time:")
    for func, t in by_op.most_common(top):
        print(f"    {t * 1e3:8.1f} ms  {func}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100])
    parser.add_argument("--device", default="cpu", help='"cpu" or "cuda"')
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds before profiling")
    parser.add_argument("--top", type=int, default=20, help="rows per list")
    parser.add_argument(
        "--sites-of",
        default="aten::_local_scalar_dense,aten::nonzero,aten::_to_copy",
        help="comma list of aten operations whose radbo call sites are listed (empty: none)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with [runtime] cuda_graphs = true (RABO's phases replayed; needs --device cuda)",
    )
    args = parser.parse_args(argv)
    if args.cuda_graphs and args.device == "cpu":
        parser.error("--cuda-graphs needs --device cuda")
    if args.device != "cpu" and not torch.cuda.is_available():
        print("benchmarks/round_profile.py: no CUDA device is available to torch here")
        return 0
    name = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    print(f"device: {name}; torch {torch.__version__}; {torch.get_num_threads()} thread(s)")
    for clients in args.clients:
        data = demo_fleet(clients)
        data["runtime"]["cuda_graphs"] = args.cuda_graphs
        runner = Runner(data, args.device)
        runner.step()
        runner.step()
        times = [runner.step() for _ in range(args.rounds)]
        print(
            f"\n## {clients} clients, batched: median {statistics.median(times) * 1e3:.1f} ms "
            f"per round over {args.rounds} rounds ({', '.join(f'{t * 1e3:.0f}' for t in times)})"
        )
        torch_profile(runner, args.top, statistics.median(times) * 1e3)
        if args.sites_of:
            call_sites(runner, args.sites_of.split(","), args.top)
        python_profile(runner, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
