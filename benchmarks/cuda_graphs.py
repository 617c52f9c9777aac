"""Seconds per round with ``[runtime] cuda_graphs`` on and off: demo fleets on a GPU (issue 30).

    .venv/bin/python benchmarks/cuda_graphs.py --clients 100 1000 --rounds 6
    .venv/bin/python benchmarks/cuda_graphs.py --clients 100 --dtype float64   # equivalence
    .venv/bin/python benchmarks/cuda_graphs.py --clients 100 1000 --algorithm fedavg
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cuda_graphs.py --device cpu --clients 20

For each fleet size, the demo fleet of that many clients on the batched backend
(:func:`benchmarks.gpu.demo_fleet`, RABO with CG; ``--algorithm fedavg``: FedAvg with 10
local steps of the demo's batches, on the demo's HeteroFL-like submodels; ``--algorithm
shrofbo``: ShroFBO, 10 simultaneous steps with the exact products) is built twice:
``cuda_graphs`` off (each stacked cohort's phases launched from Python) and on (RABO's two
phases, or the local steps, captured once per padded cohort shape and replayed,
:class:`radbo.graphs.PhaseGraphs`). Both step rounds 0 and 1
(round 0 measures FLOPs, round 1 loads kernels), then ``--rounds`` rounds alternated, the
first side switching every round; a round is one ``Simulation.step`` with the GPU's work
finished before the clock stops. A round that meets a new cohort shape captures it (a few
eager runs of the phase): the medians show the steady rounds, the captures are counted.

Reported per fleet size: each side's median seconds per round (and its fastest and slowest
round), the speed-up, the phases captured, and the largest difference of the two sides' final
x and y relative to the tensor's largest magnitude (float32 kernels of another batch size
round differently; ``--dtype float64`` for an equivalence check), and on a GPU the memory
the graphed side added to what the plain side holds after rounds 0 and 1 (``memory_reserved``:
the captures' private pools, which nothing else can use, with that side's own state and data).
``--device cpu`` runs the
cache's eager path (``PhaseGraphs(capture=False)``: the same padding and copies without a
graph; a CPU has no CUDA graphs), for the smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import Runner, demo_fleet  # noqa: E402
from radbo.graphs import PhaseGraphs  # noqa: E402


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    out = 0.0
    for name, t in a.items():
        scale = max(float(t.abs().max()), 1e-300)
        out = max(out, float((t - b[name]).abs().max()) / scale)
    return out


#: ``--algorithm fedavg`` / ``shrofbo``: the demo's batches, 10 local steps as RABO's inner
#: phase has (ShroFBO with its default step sizes and the exact products)
ALGORITHMS: dict[str, dict] = {
    "fedavg": {"name": "fedavg", "lr": 0.1, "local_steps": 10},
    "shrofbo": {"name": "shrofbo", "local_steps": 10},
}
NAMES = {"rabo": "RABO", "fedavg": "FedAvg", "shrofbo": "ShroFBO"}


def measure(
    clients: int, rounds: int, device: str, dtype: str, algorithm: str = "rabo"
) -> dict[str, float]:
    data = demo_fleet(clients)
    data["runtime"]["dtype"] = dtype
    if algorithm != "rabo":
        batches = {k: data["algorithm"][k] for k in ("batch_size", "outer_batch_size")}
        data["algorithm"] = {**ALGORITHMS[algorithm], **batches}
        data.pop("estimator", None)
    plain = Runner(data, device)
    plain.step()
    plain.step()
    cuda = device != "cpu"
    if cuda:  # what the plain side holds, its caching allocator warm
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
    if not cuda:  # the config refuses cuda_graphs off a GPU: the cache's eager path
        graphed = Runner(data, device)
        graphs = graphed.exp.simulation.runtime.graphs = PhaseGraphs(capture=False)
    else:
        graphed = Runner({**data, "runtime": {**data["runtime"], "cuda_graphs": True}}, device)
        graphs = graphed.exp.simulation.runtime.graphs
        assert graphs is not None
    sides = {"off": plain, "on": graphed}
    graphed.step()
    graphed.step()
    warm = len(graphs)
    # memory the graphed side added: its own state and data (as small as the plain side's)
    # and its captures' private memory pools, which no other allocation can use
    added = torch.cuda.memory_reserved() - before if cuda else float("nan")
    times: dict[str, list[float]] = {side: [] for side in sides}
    for q in range(rounds):
        for side in list(sides) if q % 2 == 0 else list(sides)[::-1]:
            times[side].append(sides[side].step())
    difference = max(
        relative_difference(getattr(plain.state, block), getattr(graphed.state, block))
        for block in ("x", "y")
    )
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {
        "off": off,
        "off_min": min(times["off"]),
        "off_max": max(times["off"]),
        "on": on,
        "on_min": min(times["on"]),
        "on_max": max(times["on"]),
        "speedup": off / on,
        "captures_warm": warm,
        "captures": len(graphs),
        "difference": difference,
        "added_mib": added / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per side")
    parser.add_argument("--device", default="cuda", help='"cuda" (default) or "cpu"')
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--algorithm", default="rabo", choices=list(NAMES))
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("benchmarks/cuda_graphs.py: no CUDA device is available to torch here")
        return 0
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu (cache's eager path)"
    print(
        f"## {name}, torch {torch.__version__}, {args.dtype}; median of {args.rounds} steady "
        "rounds per side after rounds 0 and 1, alternated"
    )
    print(
        f"| demo fleet, {NAMES[args.algorithm]}, batched "
        "| cuda_graphs off (s/round) | on (s/round) | speed-up | "
        "phases captured (after round 1 / end) | final x, y relative difference | "
        "GPU memory the graphed side added after round 1 (MiB, captures' pools included) |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for clients in args.clients:
        row = measure(clients, args.rounds, args.device, args.dtype, args.algorithm)
        print(
            f"| {clients} clients | {row['off']:.4f} ({row['off_min']:.4f}-{row['off_max']:.4f}) "
            f"| {row['on']:.4f} ({row['on_min']:.4f}-{row['on_max']:.4f}) | "
            f"{row['speedup']:.2f}x | {row['captures_warm']} / {row['captures']} | "
            f"{row['difference']:.1e} | {row['added_mib']:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
