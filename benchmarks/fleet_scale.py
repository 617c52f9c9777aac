"""Fleet size: memory and time per round at 1,000 / 10,000 / 100,000 clients, 100 per round.

The demo config (``examples/demo.toml``: digits, the demo MLP and task, RABO, devices from the
catalog, Dirichlet(0.5) partition) with ``[fleet] num_clients = N``, ``clients_per_round =
100``, ``[partition] allow_overlap = true`` (digits' 1,438 training examples give at most 719
clients the 2 examples each needs) and no baseline run. Each size runs in a fresh subprocess
with one intra-op thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), so that no
size inherits another's memory. Per size: process RSS (psutil) after imports, after
:func:`radbo.experiment.build` and after the rounds, the peak RSS (``ru_maxrss``), the CPU
seconds of the build, and the median CPU and wall seconds of the steady rounds (rounds 1..R-1
of :meth:`Simulation.step`; round 0 also measures FLOPs; no evaluation).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fleet_scale.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fleet_scale.py --sizes 1000,100000 --rounds 8

Prints a markdown table and the command, and writes both to ``--out`` (default
``runs/bench/fleet_scale.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "demo.toml"


def measure(num_clients: int, per_round: int, rounds: int) -> dict[str, Any]:
    """One size, in this process: build, then ``rounds`` rounds; returns the figures."""
    import resource

    import psutil
    import torch

    from radbo.config import load_config, parse_config
    from radbo.experiment import build

    torch.set_num_threads(1)
    proc = psutil.Process()
    data = load_config(CONFIG).model_dump()
    data["fleet"].update(num_clients=num_clients, clients_per_round=per_round)
    data["partition"]["allow_overlap"] = True
    data["baseline"]["enabled"] = False
    data["runtime"]["backend"] = "sequential"  # as BENCHMARKS.md's figures were measured
    config = parse_config(data)
    rss_start = proc.memory_info().rss
    cpu = time.process_time()
    exp = build(config)
    build_cpu = time.process_time() - cpu
    rss_build = proc.memory_info().rss
    sim, state = exp.simulation, exp.initial_state
    cpu_s, wall_s = [], []
    for q in range(rounds):
        cpu, wall = time.process_time(), time.perf_counter()
        state, record = sim.step(state, q)
        cpu_s.append(time.process_time() - cpu)
        wall_s.append(time.perf_counter() - wall)
        assert len(record.clients) == min(per_round, num_clients)
    steady = slice(1, None) if rounds > 1 else slice(None)
    return {
        "clients": num_clients,
        "per_round": per_round,
        "rounds": rounds,
        "rss_start_mb": rss_start / 1e6,
        "rss_build_mb": rss_build / 1e6,
        "rss_rounds_mb": proc.memory_info().rss / 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,  # KiB
        "build_cpu_s": build_cpu,
        "round_cpu_s": statistics.median(cpu_s[steady]),
        "round_wall_s": statistics.median(wall_s[steady]),
        "round0_cpu_s": cpu_s[0],
    }


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["round_cpu_s"]
    lines = [
        "| clients | per round | RSS after imports (MB) | RSS after build (MB) | RSS after "
        "rounds (MB) | peak RSS (MB) | build CPU s | steady round CPU s (median) | wall s "
        f"(median) | vs {rows[0]['clients']:,} clients |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['clients']:,} | {r['per_round']} | {r['rss_start_mb']:.0f} | "
            f"{r['rss_build_mb']:.0f} | {r['rss_rounds_mb']:.0f} | {r['peak_rss_mb']:.0f} | "
            f"{r['build_cpu_s']:.1f} | {r['round_cpu_s']:.3f} | {r['round_wall_s']:.3f} | "
            f"{r['round_cpu_s'] / base:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="comma-separated fleets")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per size (first: warm-up)")
    parser.add_argument("--per-round", type=int, default=100, help="clients per round")
    parser.add_argument("--out", default="runs/bench/fleet_scale.md", help="markdown output")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.per_round < 1:
        parser.error("--rounds and --per-round must be >= 1")
    if args.one is not None:  # the child: one size, figures as one JSON line
        print(json.dumps(measure(args.one, args.per_round, args.rounds)))
        return
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < args.per_round:
        parser.error(f"--sizes must be at least --per-round = {args.per_round} clients each")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    rows = []
    for size in sizes:
        child = [sys.executable, __file__, "--one", str(size)]
        child += ["--rounds", str(args.rounds), "--per-round", str(args.per_round)]
        done = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{size} clients failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{size:,} clients done", file=sys.stderr, flush=True)
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fleet_scale.py " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in (("sizes", ",".join(map(str, sizes))), ("rounds", args.rounds))
    )
    text = f"{table(rows)}\n\nCommand: `{command}`\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
