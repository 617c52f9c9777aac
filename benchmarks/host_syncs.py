"""Host reads per round: where a round reads a tensor's value back to Python (issue 30, item 3).

On a GPU each such read (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``, ``nonzero``)
waits for every queued kernel: a host synchronisation. This script counts them on the CPU,
where the same code paths run, for one steady round (round 1) of the demo config on the
batched backend at full width, and lists the call sites in radbo by count. A read of a tensor
already on the host counts too (the CPU cannot tell), so the figures are an upper bound of a
GPU round's synchronisations.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_syncs.py --clients 10 100
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radbo._torch_private import TorchDispatchMode  # noqa: E402
from radbo.experiment import build  # noqa: E402
from tests.configs import small_config  # noqa: E402

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}


def _site() -> str:
    frames = [f for f in traceback.extract_stack() if "/radbo/" in f.filename]
    return " <- ".join(f"{f.filename.split('radbo/')[-1]}:{f.lineno}" for f in frames[-2:][::-1])


class HostReads(TorchDispatchMode):
    """Counts scalar reads and ``nonzero`` by radbo call site (``.tolist()`` does not pass the
    dispatcher, so ``Tensor.tolist`` is wrapped while the mode is on)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()
        self._tolist: Callable[..., Any] | None = None

    def __enter__(self) -> HostReads:
        self._tolist = torch.Tensor.tolist
        original = self._tolist

        def tolist(t: torch.Tensor) -> Any:
            self.sites[f"tolist {_site()}"] += 1
            return original(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in READS:
            self.sites[f"{func.__name__.split('.')[0]} {_site()}"] += 1
        return func(*args, **(kwargs or {}))


def count(algorithm: str, clients: int) -> HostReads:
    overrides: dict[str, Any] = dict(
        rounds=2,
        eval_every=5,
        runtime={"backend": "batched"},
        fleet={"num_clients": clients, "capacities": [1.0]},
        mask={"policy": "none"},
        baseline={"enabled": False},
    )
    if algorithm != "rabo":
        overrides["algorithm"] = {"name": algorithm}
    exp = build(small_config(**overrides))
    rounds = exp.simulation.iterate(exp.initial_state, 2)
    next(rounds)
    reads = HostReads()
    with reads:
        next(rounds)
    return reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=["rabo", "fedavg", "shrofbo"])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--top", type=int, default=8, help="call sites listed per run")
    args = parser.parse_args()
    print("| algorithm | clients | host reads in round 1 |\n|---|---:|---:|")
    details = []
    for algorithm in args.algorithms:
        for clients in args.clients:
            reads = count(algorithm, clients)
            print(f"| {algorithm} | {clients} | {sum(reads.sites.values())} |")
            details.append((algorithm, clients, reads))
    for algorithm, clients, reads in details:
        print(f"\n{algorithm}, {clients} clients:")
        for site, n in reads.sites.most_common(args.top):
            print(f"  {n:6d}  {site}")


if __name__ == "__main__":
    main()
