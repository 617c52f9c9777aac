"""Rounds per second with ``[runtime] device = "cuda"`` against the CPU, same workloads.

    .venv/bin/python benchmarks/gpu.py [--rounds 5] [--workloads demo,cnn7,...] [--json F]
    .venv/bin/python benchmarks/gpu.py --workloads demo-batched-1000 --gpu-only demo-batched-1000

Each workload is a config built twice, once with ``device = "cpu"`` (one intra-op thread,
radbo's default) and once with ``device = "cuda"``; both are warmed up with rounds 0 and 1
(round 0 measures FLOPs, the first CUDA round loads kernels), then rounds 2..N+1 alternate
between the two (the GPU first in even rounds, the CPU first in odd ones). Each timed round is
one ``Simulation.step`` (no evaluation), with ``torch.cuda.synchronize()`` before the clock
stops. Reported per workload: median seconds per round on each device, rounds per second and
the GPU's speed-up, with the GPU's name and the CPU thread count beside the figures.

``--gpu-only`` names workloads timed on the GPU alone (the CPU side of 1,000 clients takes
minutes); their CPU columns read nan. Without a CUDA device the script says so and exits 0
(nothing to measure).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import tomllib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radbo.config import parse_config  # noqa: E402
from radbo.experiment import build  # noqa: E402


def demo() -> dict[str, Any]:
    data = tomllib.loads((ROOT / "examples" / "demo.toml").read_text())
    data["baseline"] = {"enabled": False}
    data["runtime"] = {"backend": "sequential"}  # as BENCHMARKS.md's figures were measured
    return data


def demo_fleet(clients: int) -> dict[str, Any]:
    """The demo config with ``clients`` clients on the batched backend (baseline off)."""
    data = demo()
    data["fleet"].update(num_clients=clients)
    data["runtime"] = {"backend": "batched"}
    if clients > 719:  # digits' 1,438 training examples give at most 719 disjoint clients
        data["partition"]["allow_overlap"] = True
    return data


def _cnn7() -> dict[str, Any]:
    data = demo()
    data["data"]["image_size"] = 16
    data["model"] = {"name": "cnn7"}
    return data


def _resnet18() -> dict[str, Any]:
    data = demo()
    data["data"]["image_size"] = 16
    data["model"] = {"name": "resnet18"}
    data["algorithm"].update(inner_steps=3)
    return data


def _conv4_few_shot() -> dict[str, Any]:
    return {
        "partition": {"kind": "iid"},
        "data": {"name": "digits", "image_size": 28},
        "model": {"name": "conv4", "width": 64},
        "task": {"name": "few_shot", "ways": 5, "shots": 5, "queries": 15, "test_episodes": 20},
        "fleet": {"num_clients": 5, "capacities": [1.0, 0.5, 0.25, 0.125, 0.0625]},
        "mask": {"policy": "importance"},
        "algorithm": {"name": "rabo", "inner_steps": 10, "max_hypergrad_norm": 1.0},
        "runtime": {"backend": "sequential"},
    }


WORKLOADS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "demo": ("demo: MLP on 8x8 digits, RABO + CG, 10 clients, sequential", demo),
    "demo-batched-100": ("demo fleet of 100 clients, batched backend", partial(demo_fleet, 100)),
    "demo-batched-1000": (
        "demo fleet of 1,000 clients, batched backend",
        partial(demo_fleet, 1000),
    ),
    "cnn7": ("CNN7 on 16x16 digits, RABO + CG, 10 clients", _cnn7),
    "resnet18": ("ResNet-18 on 16x16 digits, RABO + CG (T = 3), 10 clients", _resnet18),
    "conv4-few-shot": (
        "Conv-4 width 64, 28x28 digits, 5-way 5-shot, RABO, 5 clients (r = 1 .. 1/16)",
        _conv4_few_shot,
    ),
}


class Runner:
    """One built simulation stepping round after round from its initial state."""

    def __init__(self, data: dict[str, Any], device: str) -> None:
        runtime = {**data.get("runtime", {}), "device": device}
        self.config = parse_config({**data, "runtime": runtime})
        self.exp = build(self.config)
        self.state = self.exp.initial_state
        self.round = 0
        self.clock = 0.0
        self.cuda = device != "cpu"

    def step(self) -> float:
        """Run one round; its wall time in seconds (GPU work finished)."""
        start = time.perf_counter()
        self.state, record = self.exp.simulation.step(self.state, self.round, self.clock)
        if self.cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        self.round += 1
        self.clock = record.clock_s
        return elapsed


def measure(name: str, rounds: int, cpu_side: bool = True) -> dict[str, Any]:
    """One workload's figures; ``cpu_side=False`` times the GPU alone (CPU figures NaN)."""
    label, make = WORKLOADS[name]
    data = make()
    runners = [Runner(data, "cuda")] + ([Runner(data, "cpu")] if cpu_side else [])
    for runner in runners:  # round 0 (FLOP measurement) and round 1 (CUDA kernels load)
        runner.step()
        runner.step()
    times: dict[str, list[float]] = {"cuda": [], "cpu": [math.nan]}
    if cpu_side:
        times["cpu"] = []
    for q in range(rounds):
        for runner in runners if q % 2 == 0 else runners[::-1]:
            times["cuda" if runner.cuda else "cpu"].append(runner.step())
    cpu_s = statistics.median(times["cpu"])
    gpu_s = statistics.median(times["cuda"])
    return {
        "workload": name,
        "what": label,
        "cpu_s_per_round": cpu_s,
        "cuda_s_per_round": gpu_s,
        "cpu_rounds_per_s": 1.0 / cpu_s,
        "cuda_rounds_per_s": 1.0 / gpu_s,
        "speedup": cpu_s / gpu_s,
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per device")
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma list of {sorted(WORKLOADS)}"
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (1)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--gpu-only", default="", help="comma list of workloads timed on the GPU alone"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    gpu_only = {n for n in args.gpu_only.split(",") if n}
    unknown = sorted((set(names) | gpu_only) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device is available to torch here; nothing to measure")
        return 0
    torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name()
    print(
        f"GPU: {device}; CPU: {platform.processor() or platform.machine()}, "
        f"{args.threads} intra-op thread(s); torch {torch.__version__}; "
        f"median of {args.rounds} steady rounds each, alternated"
    )
    print("| workload | CPU s/round | GPU s/round | CPU rounds/s | GPU rounds/s | GPU speed-up |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for name in names:
        row = measure(name, args.rounds, cpu_side=name not in gpu_only)
        rows.append(row)
        print(
            f"| {row['what']} | {row['cpu_s_per_round']:.3f} | {row['cuda_s_per_round']:.3f} | "
            f"{row['cpu_rounds_per_s']:.2f} | {row['cuda_rounds_per_s']:.2f} | "
            f"{row['speedup']:.2f}x |",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"device": device, "threads": args.threads, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
