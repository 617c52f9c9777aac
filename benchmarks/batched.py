r"""Speed-up of :class:`~radbo.simulation.BatchedBackend` over the sequential backend.

Every algorithm's client work runs batched (``radbo.client.ClientWork``); this measures RABO
(both phases: T SGD steps on y, then the hypergradient by CG with per-client stopping) and
ShroFBO (tau simultaneous steps with second-order products) on the digits MLP
(``examples/demo.toml`` with full models everywhere: no masks, r = 1, no device profiles,
iid split) for fleets of 10, 50 and 100 clients. Two measurements, both after a warm-up that
fills the FLOP meter's cache (FLOPs are measured once per workload in either backend):

* **first phase**: ``backend.run`` over one task per client of the algorithm's first phase;
* **round**: ``Simulation.step`` (every phase, plus the server's aggregation).

Sequential and batched runs alternate in the same process; each time is the median of
``--repeats`` (3). Speed-up = sequential time / batched time. Clients whose local data is
smaller than the batch size draw smaller minibatches and form cohorts of their own (the
"cohorts" column counts the distinct stack keys of the first phase). Prints a Markdown
table. Run it with one thread on an otherwise idle machine:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batched.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batched.py --clients 10 50 100 --repeats 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batched.py --models mlp cnn7 --algorithms fedavg

``--models``: ``mlp`` (the demo's), ``cnn7`` (a LeNet on digits at 16x16), ``cnn7_32`` (the
same at 32x32: more work per client on 1 and 6 input channels) and ``simple_cnn``
(pfl-research's CIFAR-10 CNN on synthetic CIFAR-shaped data, from ``benchmarks/vs_pfl.py``);
``fedavg`` (5 local steps on every parameter) is there for the convolutional cases.

The ``auto`` columns run :class:`~radbo.simulation.AutoBackend` after two warm-up rounds: by
default its size rule (``--auto-choice size``: a family stacks where one client's operations
average at most 1e6 FLOPs; the last column gives the FLOPs per operation it counted, over the
families), or its timing (``--auto-choice timing``: the first group of a family runs one by
one, the second measures both sides and records the faster one). It should read the faster
of the two other columns. ``--max-group G [G ...]`` adds a
batched side per ``G`` whose stacks hold at most ``G`` clients (``BatchedBackend(max_group=G)``:
a cohort split in chunks), alternated with the others, as two more columns each (its round
and its speed-up over sequential): whether smaller stacks, whose working set is smaller,
lose less.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/batched.py --models simple_cnn \
        --algorithms fedavg --clients 10 --max-group 2 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from radbo.allocator import retain_freed_memory
from radbo.client import ClientTask, ClientWork, stack_key
from radbo.config import parse_config
from radbo.experiment import Experiment, build
from radbo.randomness import task_seed
from radbo.simulation import AutoBackend, BatchedBackend, SequentialBackend, full_index_set

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEMO = ROOT / "examples" / "demo.toml"
ALGORITHMS: dict[str, dict[str, Any]] = {
    "rabo": {"name": "rabo", "inner_lr": 0.5, "outer_lr": 0.2, "inner_steps": 10},
    "shrofbo": {"name": "shrofbo", "local_steps": 10},
    "fedavg": {"name": "fedavg", "local_steps": 5},
}
#: The models: the demo's MLP on 8x8 digits, CNN7 (a LeNet) on digits at 16x16 and at 32x32
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {},
    "cnn7": {"data": {"name": "digits", "image_size": 16}, "model": {"name": "cnn7"}},
    "cnn7_32": {"data": {"name": "digits", "image_size": 32}, "model": {"name": "cnn7"}},
    "simple_cnn": {},  # pfl-research's, on synthetic CIFAR-shaped data (simple_cnn_sections)
}


def simple_cnn_sections(num_clients: int) -> dict[str, Any]:
    """pfl-research's CIFAR-10 setup (``benchmarks/vs_pfl.py``): its CNN, registered as a
    plug-in model, on synthetic data written once per fleet size (50 images per client)."""
    from benchmarks.vs_pfl import radbo_config, register_model, write_data

    register_model()
    folder = write_data(
        Path(tempfile.gettempdir()) / f"radbo-batched-cifar-{num_clients}", num_clients
    )
    config = radbo_config(folder, "sequential", num_clients, num_clients, 1, "cpu", 1)
    return {k: config[k] for k in ("data", "model", "task")}


def experiment_data(algorithm: str, num_clients: int, model: str = "mlp") -> dict[str, Any]:
    """The config (a TOML document's dict) of one workload of the table."""
    data = tomllib.loads(DEMO.read_text())
    data["fleet"] = {"num_clients": num_clients, "capacities": [1.0]}
    data["mask"] = {"policy": "none"}
    data["partition"] = {"kind": "iid"}
    data["baseline"] = {"enabled": False}
    data["algorithm"] = ALGORITHMS[algorithm]
    sections = simple_cnn_sections(num_clients) if model == "simple_cnn" else MODELS[model]
    for section, values in sections.items():
        data[section] = values
    if model == "simple_cnn" and algorithm == "fedavg":  # pfl's batch of 10 examples
        data["algorithm"] = {**data["algorithm"], "batch_size": 7, "outer_batch_size": 3}
    if algorithm != "rabo":
        data.pop("estimator", None)
    return data


def experiment(algorithm: str, num_clients: int, model: str = "mlp") -> Experiment:
    return build(parse_config(experiment_data(algorithm, num_clients, model)))


def first_phase_tasks(exp: Experiment) -> tuple[ClientWork, list[ClientTask]]:
    sim = exp.simulation
    phase = sim.algorithm.phases()[0]
    index_set = full_index_set(sim.shapes)
    params = phase.broadcast(exp.initial_state, index_set, 0)
    tasks = [
        ClientTask(
            client=c,
            round=0,
            phase=phase.name,
            params=params,
            index_set=index_set,
            data=sim.clients[c],
            seed=task_seed(sim.seed, 0, 0, c),
            budget=sim.budgets[c],
            slot=c,
        )
        for c in range(len(sim.clients))
    ]
    assert isinstance(phase.client, ClientWork)
    return phase.client, tasks


def alternate(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each run, the runs alternating."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(
    algorithm: str,
    num_clients: int,
    repeats: int,
    model: str = "mlp",
    max_groups: Sequence[int] = (),
    auto_choice: str = "size",
) -> dict[str, Any]:
    exp = experiment(algorithm, num_clients, model)
    sim = exp.simulation
    work, tasks = first_phase_tasks(exp)
    cohorts = len({stack_key(t, work.prepare(sim.runtime, t)) for t in tasks})
    seq_backend, bat_backend = SequentialBackend(), BatchedBackend()
    auto_backend = AutoBackend(choose=auto_choice)  # type: ignore[arg-type]

    def step(backend: Any) -> object:
        sim.backend = backend
        return sim.step(exp.initial_state, 0)

    def phase(backend: Any) -> object:
        return backend.run(work, sim.runtime, sim.flop_meter, tasks)

    step(seq_backend)  # warm-up: fills the FLOP meter's cache, builds skeletons
    step(bat_backend)
    step(auto_backend)  # the auto backend's warm-up, then its measurement: its plan is made
    step(auto_backend)
    sides: dict[str, Any] = {"seq": seq_backend, "bat": bat_backend, "auto": auto_backend}
    for g in max_groups:
        sides[f"bat{g}"] = BatchedBackend(max_group=g)
        step(sides[f"bat{g}"])
    phases = alternate({k: lambda b=b: phase(b) for k, b in sides.items()}, repeats)
    rounds = alternate({k: lambda b=b: step(b) for k, b in sides.items()}, repeats)
    return {
        "cohorts": cohorts,
        **{f"phase_{k}": v for k, v in phases.items()},
        **{f"round_{k}": v for k, v in rounds.items()},
        "auto_stacked": sum(v == "stacked" for v in auto_backend.plan.values()),
        "auto_families": len(auto_backend.plan),
        "auto_flops_per_op": [f / max(n, 1) for f, n in auto_backend.sizes.values()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-group",
        type=int,
        nargs="+",
        default=[],
        help="also batched with stacks of at most this many clients (a side per number)",
    )
    parser.add_argument(
        "--auto-choice",
        choices=["size", "timing"],
        default="size",
        help="how the auto side chooses (AutoBackend(choose=...); default: size)",
    )
    parser.add_argument(
        "--system-allocator",
        action="store_true",
        help="leave the C library's allocator as it is (radbo run's allocator = 'system'); "
        "by default freed memory is kept for reuse, as radbo run does",
    )
    args = parser.parse_args()
    if any(g < 1 for g in args.max_group):
        parser.error("--max-group takes numbers >= 1")
    if not args.system_allocator:
        retain_freed_memory()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of {args.repeats}"
    )
    print()
    extra = "".join(f" stacks <= {g} (ms) | speed-up |" for g in args.max_group)
    print(
        "| model | algorithm | clients | cohorts | 1st phase seq (ms) | batched (ms) | speed-up "
        "| round seq (ms) | batched (ms) | speed-up | auto (ms) | speed-up | auto stacked "
        "| FLOPs per operation |" + extra
    )
    print(
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + "---:|---:|" * len(args.max_group)
    )
    for model in args.models:
        for algorithm in args.algorithms:
            for n in args.clients:
                m = measure(algorithm, n, args.repeats, model, args.max_group, args.auto_choice)
                _row(model, algorithm, n, m, args.max_group)


def _flops_per_op(values: Sequence[float]) -> str:
    """The range of the auto side's counted FLOPs per operation (``-``: none counted)."""
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:,.0f}" if low == high else f"{low:,.0f}-{high:,.0f}"


def _row(
    model: str, algorithm: str, n: int, m: dict[str, Any], max_groups: Sequence[int] = ()
) -> None:
    chunks = "".join(
        f" {1e3 * m[f'round_bat{g}']:.1f} | {m['round_seq'] / m[f'round_bat{g}']:.2f}x |"
        for g in max_groups
    )
    print(
        f"| {model} | {algorithm} | {n} | {m['cohorts']} | {1e3 * m['phase_seq']:.1f} "
        f"| {1e3 * m['phase_bat']:.1f} | {m['phase_seq'] / m['phase_bat']:.2f}x "
        f"| {1e3 * m['round_seq']:.1f} | {1e3 * m['round_bat']:.1f} "
        f"| {m['round_seq'] / m['round_bat']:.2f}x | {1e3 * m['round_auto']:.1f} "
        f"| {m['round_seq'] / m['round_auto']:.2f}x "
        f"| {m['auto_stacked']} of {m['auto_families']} "
        f"| {_flops_per_op(m.get('auto_flops_per_op', []))} |" + chunks,
        flush=True,
    )


if __name__ == "__main__":
    main()
