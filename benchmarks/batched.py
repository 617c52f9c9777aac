"""Speed-up of :class:`~radbo.simulation.BatchedBackend` over the sequential backend.

RABO on the digits MLP (``examples/demo.toml`` with full models everywhere: no masks, r = 1,
no device profiles, iid split) for fleets of 10, 50 and 100 clients. Two measurements, both
after a warm-up that fills the FLOP meter's cache (FLOPs are measured once per workload in
either backend):

* **inner phase**: ``backend.map`` over one ``train.inner`` task per client (the phase that
  is batched: T SGD steps on y under ``torch.func.vmap``);
* **round**: ``Simulation.step`` (inner phase batched, outer phase -- hypergradients by CG --
  sequential in both, plus the server's aggregation).

Sequential and batched runs alternate in the same process; each time is the median of
``--repeats`` (3). Speed-up = sequential time / batched time. Clients whose local data is
smaller than the batch size draw smaller minibatches and form their own groups (the "groups"
column). Prints a Markdown table. Run it with one thread on an otherwise idle machine:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batched.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batched.py --clients 10 50 100 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import torch

from radbo.config import parse_config
from radbo.experiment import Experiment, build
from radbo.simulation import BatchedBackend, SequentialBackend
from radbo.simulation.batched import batched_impl
from radbo.client import ClientTask, run_measured
from radbo.simulation import full_index_set
from radbo.randomness import derive_seed

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.toml"


def experiment(num_clients: int) -> Experiment:
    data = tomllib.loads(DEMO.read_text())
    data["fleet"] = {"num_clients": num_clients, "capacities": [1.0]}
    data["mask"] = {"policy": "none"}
    data["partition"] = {"kind": "iid"}
    data["baseline"] = {"enabled": False}
    return build(parse_config(data))


def inner_tasks(exp: Experiment) -> list[ClientTask]:
    sim, algo = exp.simulation, exp.simulation.algorithm
    index_set = full_index_set(sim.shapes)
    params = algo.broadcast_inner(exp.initial_state, index_set)
    return [
        ClientTask(
            client=c,
            round=0,
            phase="train.inner",
            params=params,
            index_set=index_set,
            data=sim.clients[c],
            seed=derive_seed(sim.seed, 0, 1, c),
            budget=sim.budgets[c],
            slot=c,
        )
        for c in range(len(sim.clients))
    ]


def alternate(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs alternating."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(num_clients: int, repeats: int) -> dict[str, float]:
    exp = experiment(num_clients)
    sim, algo = exp.simulation, exp.simulation.algorithm
    tasks = inner_tasks(exp)
    fn = functools.partial(run_measured, algo.client_inner, sim.runtime, sim.flop_meter)
    impl = batched_impl(algo.client_inner)
    assert impl is not None
    groups = len({impl.group_key(algo, sim.runtime, t) for t in tasks})
    seq_backend, bat_backend = SequentialBackend(), BatchedBackend()

    def step(backend):
        sim.backend = backend
        return sim.step(exp.initial_state, 0)

    step(seq_backend)  # warm-up: fills the FLOP meter's cache, builds skeletons
    step(bat_backend)
    phase = alternate(
        {"seq": lambda: seq_backend.map(fn, tasks), "bat": lambda: bat_backend.map(fn, tasks)},
        repeats,
    )
    rounds = alternate(
        {"seq": lambda: step(seq_backend), "bat": lambda: step(bat_backend)}, repeats
    )
    return {
        "groups": groups,
        "inner_seq": phase["seq"],
        "inner_bat": phase["bat"],
        "round_seq": rounds["seq"],
        "round_bat": rounds["bat"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}"
    )
    print()
    print(
        "| clients | groups | inner seq (ms) | inner batched (ms) | inner speed-up "
        "| round seq (ms) | round batched (ms) | round speed-up |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.clients:
        m = measure(n, args.repeats)
        print(
            f"| {n} | {m['groups']} | {1e3 * m['inner_seq']:.1f} | {1e3 * m['inner_bat']:.1f} "
            f"| {m['inner_seq'] / m['inner_bat']:.2f}x | {1e3 * m['round_seq']:.1f} "
            f"| {1e3 * m['round_bat']:.1f} | {m['round_seq'] / m['round_bat']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
