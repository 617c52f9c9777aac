"""RABO paper, Table II / Fig. 2: few-shot N-way K-shot accuracy of RABO and its baselines.

Paper: Li, Zhang, Zheng, Shi, Yuan, Cheng and Yu, "Distributed Bilevel Optimization with Dual
Pruning for Resource-limited Clients" (RABO/RAFBO), Sec. V-A, Table II and Fig. 2
(``papers/rabo_rafbo.txt``): 5- and 20-way, 1- and 5-shot on Omniglot, ResNet-12 backbone.

Each method runs the same fleet (the capacities {1, 1/2, 1/4, 1/8, 1/16} cycled over
``--clients``: 5 by default, one each, 10 with ``--full`` as in the paper; the meta-train
classes split iid over the clients on digits, by whole characters on Omniglot as in the paper),
the same rounds and the same fixed meta-test episodes (drawn from the run seed), and
is evaluated as the few-shot literature reports it: a linear head fitted on each test episode's
support set, mean query accuracy and its 95 % confidence interval. Every method uses the same
backbone with static BatchNorm (HeteroFL's sBN). Rows:

- untrained backbone: the initial weights, BatchNorm statistics recomputed; what training adds
  is the distance above this row;
- RABO: Alg. 1 as printed (importance masks on x and y, CG hypergradient);
- RABO, refit S: RABO with ``[algorithm] refit_steps = S`` (radbo's addition, ``--refit-steps``,
  default 100): before eq. (7) each client takes S SGD steps on the outer phase's inner
  minibatch, so the hypergradient is taken near y*(x) (``radbo/algorithms/rabo.py``);
- RAFBO: importance masks, forward finite-difference hypergradient (eq. 10) on |P| sampled
  coordinates of x;
- FedMBO (full model): every client at capacity 1, randomized Neumann hypergradient;
- FedAvg (full model): single-level FedAvg, every client at capacity 1, backbone and head
  trained jointly on the clients' classes;
- Dist-ProtoNet: prototypical networks (Snell et al., the paper's [25]) federated with
  FedAvg, every client at capacity 1 (``[algorithm] name = "protonet"``); evaluated like every
  row (a head fitted per test episode) and, in the row "Dist-ProtoNet, nearest prototype", by
  its own rule on the same episodes and runs;
- Dist-MAML: MAML (Finn et al., the paper's [7]) federated with FedAvg, every client at
  capacity 1 (``[algorithm] name = "maml"``; ``--maml-inner-steps``, ``--maml-inner-lr``,
  ``--maml-first-order``);
- Static (HeteroFL): single-level FedAvg on ``leading`` submodels;
- OAP (the paper's [40]): single-level FedAvg on ``oap`` submodels (radbo's reading of it:
  ``radbo/masks/policies/oap.py`` says what the sources say and what was assumed);
- FedRolex: single-level FedAvg on ``rolling`` submodels;
- FIARSE (the paper's [33]): single-level FedAvg on ``fiarse`` submodels (FIARSE's
  importance-aware selection on structured channels; its per-parameter training step is not
  reproduced: ``radbo/masks/policies/fiarse.py``).

A configuration the data cannot serve (20-way on digits, which has 5 meta-train classes; a
client holding fewer than N classes with K + Q examples) is refused before any run, with one
line that names the fix.

    # 5-way 5-shot on digits 16x16, Conv-4 width 32, 20 rounds, seeds 0 1 2 (minutes)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_fewshot.py
    # on Omniglot 28x28 (queries default to 20 - shots), 10 rounds (about 7 minutes)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_fewshot.py --omniglot DIR
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_fewshot.py --omniglot DIR \\
        --ways 20 --shots 1 --model resnet12
    # the paper's size on a GPU: 10 clients, width 64, 28x28, 200 rounds, 600 episodes
    # (20 rounds of every row took 160 s on an H100: about 27 minutes per seed)
    .venv/bin/python benchmarks/paper/rabo_fewshot.py --omniglot DIR --full --device cuda \\
        --coordinate-batch 32

Writes ``<out>/rabo_fewshot.md`` (the table, the device that produced it and the command) and
``<out>/rabo_fewshot.png`` (meta-test accuracy against rounds, mean over seeds with a band of
+- one seed standard deviation). Run with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from radbo.config import parse_config
from radbo.experiment import build, run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.paper.rabo_common import (  # noqa: E402
    BILEVEL,
    CAPACITIES,
    CAPACITY_NAMES,
    add_common_arguments,
    add_coordinate_batch,
    check_device,
    check_served,
    command_line,
    data_label,
    data_sections,
    default_queries,
    giga,
    mean_std,
    merge,
    model_section,
    plot_curves,
    provenance,
    rabo_sections,
    rafbo_sections,
)

UNTRAINED = "untrained backbone"
FEDMBO = "FedMBO (full model)"
FULL_FEDAVG = "FedAvg (full model)"
STATIC = "Static (HeteroFL)"
FEDROLEX = "FedRolex"
PROTONET = "Dist-ProtoNet"
PROTOTYPE_RULE = "Dist-ProtoNet, nearest prototype"
MAML = "Dist-MAML"
OAP = "OAP"
FIARSE = "FIARSE"
#: Table II of the paper (full Omniglot, ResNet-12), in %: (ways, shots) -> row -> accuracy,
#: its rows in the paper's order. The paper's "FedRox [1]" is FedRolex (its reference [1]).
_ROWS = (PROTONET, MAML, FEDMBO, STATIC, OAP, FEDROLEX, FIARSE, "RABO", "RAFBO")
_TABLE_II = {
    (5, 1): (80.76, 81.46, 82.66, 72.34, 73.58, 73.74, 74.33, 76.05, 75.09),
    (5, 5): (89.33, 92.01, 93.69, 85.09, 86.16, 86.95, 87.78, 89.12, 88.57),
    (20, 1): (60.05, 61.36, 63.18, 42.99, 45.45, 47.25, 49.52, 54.97, 51.37),
    (20, 5): (78.01, 78.35, 81.64, 51.01, 51.92, 55.29, 55.87, 77.41, 71.16),
}
PAPER = {k: dict(zip(_ROWS, v, strict=True)) for k, v in _TABLE_II.items()}


def refit_name(steps: int) -> str:
    return f"RABO, refit {steps}"


def methods(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Config sections of each method (merged over the shared base), in table order."""
    fedavg = {"name": "fedavg", "lr": 0.1, "local_steps": 5}
    head = {"head": args.head}  # the single-level baselines keep one head row per class
    full_fleet = {"capacities": [1.0]}
    importance = {"mask": {"policy": "importance"}, "task": head}
    table: dict[str, dict[str, Any]] = {"RABO": {**importance, **rabo_sections()}}
    if args.refit_steps:
        table[refit_name(args.refit_steps)] = {**importance, **rabo_sections(args.refit_steps)}
    table["RAFBO"] = {
        **importance,
        **rafbo_sections(args.rafbo_coordinates, args.coordinate_batch),
    }
    table[FEDMBO] = {
        "mask": {"policy": "none"},
        "task": head,
        "fleet": full_fleet,
        "algorithm": {
            "name": "fedmbo",
            **BILEVEL,
            "neumann_terms": 5,
            "eta": 0.5,
            "clients_per_phase": args.clients,
        },
    }
    # what meta-training on the clients' classes does to the backbone at all, with no
    # submodels in the way
    table[FULL_FEDAVG] = {"mask": {"policy": "none"}, "fleet": full_fleet, "algorithm": fedavg}
    # the full-model few-shot learners, federated with FedAvg's server step; ProtoNet is also
    # scored by its own nearest-prototype rule (the PROTOTYPE_RULE row, from the same runs)
    table[PROTONET] = {
        "mask": {"policy": "none"},
        "fleet": full_fleet,
        "task": {"prototypes": True},
        "algorithm": {"name": "protonet", "lr": 0.1, "local_steps": 5},
    }
    table[MAML] = {
        "mask": {"policy": "none"},
        "fleet": full_fleet,
        "task": head,
        "algorithm": {
            "name": "maml",
            "lr": 0.1,
            "local_steps": 5,
            "inner_steps": args.maml_inner_steps,
            "inner_lr": args.maml_inner_lr,
            "first_order": args.maml_first_order,
        },
    }
    table[STATIC] = {"mask": {"policy": "leading"}, "algorithm": fedavg}
    table[OAP] = {"mask": {"policy": "oap"}, "algorithm": fedavg}
    table[FEDROLEX] = {"mask": {"policy": "rolling"}, "algorithm": fedavg}
    table[FIARSE] = {"mask": {"policy": "fiarse"}, "algorithm": fedavg}
    return table


def base_config(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    data, partition = data_sections(args.omniglot, args.image_size)
    model, _ = model_section(args.model, args.width)
    return {
        "seed": seed,
        "rounds": args.rounds,
        "eval_every": args.eval_every,
        "data": data,
        "partition": partition,
        # one model for every method: static BatchNorm (HeteroFL's sBN: batch statistics in
        # training, recomputed by the server before each evaluation)
        "model": model,
        "task": {
            "name": "few_shot",
            "ways": args.ways,
            "shots": args.shots,
            "queries": args.queries,
            "test_episodes": args.episodes,
        },
        # the capacities cycle over the clients (5 clients: one each)
        "fleet": {"num_clients": args.clients, "capacities": CAPACITIES},
        "runtime": {"device": args.device},
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--full",
        action="store_true",
        help="the paper's size: 10 clients, width 64, 28x28, 200 rounds, 600 episodes (a GPU)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--eval-every", type=int, default=None, help="rounds between evaluations")
    parser.add_argument("--model", choices=["conv4", "resnet12"], default="conv4")
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="Conv-4 channels, or ResNet-12's first stage (stages x1, x2.5, x5, x10)",
    )
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--episodes", type=int, default=None, help="meta-test episodes")
    parser.add_argument(
        "--clients", type=int, default=None, help="fleet size (default 5, --full 10: the paper's)"
    )
    parser.add_argument("--ways", type=int, default=5, help="N (the paper: 5 or 20)")
    parser.add_argument("--shots", type=int, default=5, help="K (the paper: 1 or 5)")
    parser.add_argument(
        "--queries", type=int, default=None, help="Q per class (default: 20 - K on Omniglot, 15)"
    )
    parser.add_argument(
        "--head",
        choices=["classes", "episode"],
        default="classes",
        help="the bilevel methods' head: one row per class, or N rows relabelled per episode",
    )
    parser.add_argument(
        "--refit-steps", type=int, default=100, help="S of the 'RABO, refit S' row (0: no row)"
    )
    parser.add_argument("--rafbo-coordinates", type=int, default=32, help="RAFBO's |P|")
    add_coordinate_batch(parser)
    parser.add_argument("--maml-inner-steps", type=int, default=1, help="Dist-MAML's steps")
    parser.add_argument("--maml-inner-lr", type=float, default=0.1, help="Dist-MAML's step")
    parser.add_argument(
        "--maml-first-order", action="store_true", help="Dist-MAML first-order (FOMAML)"
    )
    parser.add_argument("--methods", nargs="+", default=None, help="subset of the methods")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    full, omniglot = args.full, args.omniglot
    args.clients = args.clients or (10 if full else len(CAPACITIES))
    args.rounds = args.rounds or (200 if full else 10 if omniglot else 20)
    args.width = args.width or (64 if full else {"conv4": 32, "resnet12": 8}[args.model])
    args.image_size = args.image_size or (28 if full or omniglot else 16)
    args.episodes = args.episodes or (600 if full else 200 if omniglot else 500)
    # an Omniglot evaluation costs 1-2 s on a CPU (BatchNorm recalibration, features of the
    # whole meta-test set), a digits one well under a second
    args.eval_every = args.eval_every or (
        10 if full else max(1, args.rounds // (2 if omniglot else 5))
    )
    if args.queries is None:
        args.queries = default_queries(omniglot, args.shots)
    if args.refit_steps < 0:
        parser.error(f"--refit-steps must be >= 0, got {args.refit_steps}")
    return parser, args


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    table = methods(args)
    chosen = args.methods or list(table)
    unknown = set(chosen) - set(table)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {list(table)}")
    command = command_line(__file__, argv)
    print(command, flush=True)

    # every config is parsed, and the data checked against it, before the first run
    check_device(args.device)
    configs = {
        (name, seed): parse_config(merge(base_config(args, seed), table[name]))
        for name in chosen
        for seed in args.seeds
    }
    check_served(list(configs.values()))

    finals: dict[str, list[tuple[float, float]]] = {}
    flops: dict[str, list[float]] = {}
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    untrained: dict[int, float] = {}
    # reference: the initial backbone (random weights, BatchNorm statistics recomputed),
    # evaluated on the same episodes; every method starts from it (same seed, same model)
    for seed in args.seeds:
        exp = build(configs[(chosen[0], seed)])
        sim = exp.simulation
        metrics = sim.evaluate(sim.algorithm.model_state(exp.initial_state))
        untrained[seed] = metrics["accuracy"]
        finals.setdefault(UNTRAINED, []).append((metrics["accuracy"], metrics["accuracy_ci95"]))
        print(f"{UNTRAINED:22s} seed {seed}: {metrics['accuracy']:.3f}", flush=True)
    for name in chosen:
        for seed in args.seeds:
            start = time.perf_counter()
            result = run(configs[(name, seed)], progress=False, save=False)
            acc, ci = result.final["test_accuracy"], result.final["test_accuracy_ci95"]
            finals.setdefault(name, []).append((acc, ci))
            if "test_prototype_accuracy" in result.final:  # ProtoNet's own rule, same episodes
                rule = result.final["test_prototype_accuracy"]
                rule_ci = result.final["test_prototype_accuracy_ci95"]
                finals.setdefault(PROTOTYPE_RULE, []).append((rule, rule_ci))
                flops.setdefault(PROTOTYPE_RULE, []).append(result.totals["flops"])
            flops.setdefault(name, []).append(result.totals["flops"])
            evaluated = [r for r in result.rounds if "test_accuracy" in r]
            curve = [(0, untrained[seed])]
            curve += [(r["round"] + 1, r["test_accuracy"]) for r in evaluated]
            curves.setdefault(name, []).append(curve)
            elapsed = time.perf_counter() - start
            path = ", ".join(f"r{r}: {a:.3f}" for r, a in curve)
            line = f"{name:22s} seed {seed}: {acc:.3f} ± {ci:.3f}  ({elapsed:.0f} s; {path})"
            print(line, flush=True)

    data = data_label(args.omniglot, args.image_size)
    _, backbone = model_section(args.model, args.width)
    setting = f"{args.ways}-way {args.shots}-shot"
    paper = PAPER.get((args.ways, args.shots), {})
    lines = [
        f"# RABO paper Table II: {setting}",
        "",
        f"{setting}, {args.queries} queries per class, {data}, {backbone} (static BN), "
        f"{args.clients} clients at capacities {CAPACITY_NAMES} cycled (full-model rows: all 1), "
        f"{args.rounds} rounds, {args.episodes} meta-test episodes per run (accuracy ± 95 % "
        f"CI over episodes); RAFBO |P| = {args.rafbo_coordinates}. 'mean' is over seeds, with "
        "the seed standard deviation; GFLOP is one run's total (all clients, mean over seeds). "
        "The paper's column is its Table II (full Omniglot: 964 meta-train characters, "
        "ResNet-12, 10 clients); it is not the same setting unless this run is.",
        "",
        provenance(args.device),
        "",
        "| method | "
        + " | ".join(f"seed {s}" for s in args.seeds)
        + " | mean (seed std) | GFLOP | paper |",
        "|---" + "|---:" * (len(args.seeds) + 3) + "|",
    ]
    for name, rows in finals.items():
        cells = [f"{a:.3f} ± {c:.3f}" for a, c in rows]
        mean, spread = mean_std([a for a, _ in rows])
        gflop = giga(mean_std(flops[name])[0]) if name in flops else "-"
        cited = f"{paper[name] / 100:.3f}" if name in paper else ""
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {mean:.3f} ({spread:.3f}) | {gflop} "
            f"| {cited} |"
        )
    lines += ["", f"    {command}"]
    markdown = "\n".join(lines)
    print(markdown)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rabo_fewshot.md").write_text(markdown + "\n")
    untrained_mean = mean_std(list(untrained.values()))[0]
    plot_curves(
        curves,
        out / "rabo_fewshot.png",
        f"{setting}, {data_label(args.omniglot, args.image_size, where=False)}, {backbone}",
        reference=(UNTRAINED, untrained_mean),
    )
    print(f"wrote {out / 'rabo_fewshot.md'} and {out / 'rabo_fewshot.png'}")


if __name__ == "__main__":
    main()
