"""RABO paper, Table II / Fig. 2: few-shot N-way K-shot accuracy of RABO and its baselines.

Paper: Y. Hong et al., "Resource-Aware Federated Bilevel Optimization" (RABO/RAFBO), Sec. V-A.
Each method runs the same fleet (one client per capacity in {1, 1/2, 1/4, 1/8, 1/16}, meta-train
classes split iid over the clients), the same rounds and the same fixed meta-test episodes (drawn
from the run seed), and is evaluated as the few-shot literature reports it: a linear head fitted
on each test episode's support set, mean query accuracy and its 95 % confidence interval.

Methods: RABO (importance masks, CG hypergradient), RAFBO (importance masks, finite-difference
hypergradient), FedMBO (full model on every client), Static (single-level FedAvg on ``leading``
submodels with static BatchNorm: HeteroFL) and FedRolex (single-level FedAvg on ``rolling``
submodels). The single-level baselines train backbone and head jointly on the clients' classes.
Every method uses the same Conv-4 with static BatchNorm (HeteroFL's sBN).

    # digits 16x16, Conv-4 width 32, 30 rounds, 3 seeds (~10 min on one core)
    .venv/bin/python benchmarks/paper/rabo_fewshot.py
    .venv/bin/python benchmarks/paper/rabo_fewshot.py --shots 1    # 5-way 1-shot
    # 28x28, width 64, 100 rounds, 600 episodes, 5 seeds (hours)
    .venv/bin/python benchmarks/paper/rabo_fewshot.py --full
    .venv/bin/python benchmarks/paper/rabo_fewshot.py --omniglot /data/omniglot

Writes ``<out>/rabo_fewshot.md`` (the table) and ``<out>/rabo_fewshot.png`` (meta-test accuracy
against rounds, mean over seeds). Run with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from radbo.config import parse_config
from radbo.experiment import build, run

CAPACITIES = [1.0, 0.5, 0.25, 0.125, 0.0625]
UNTRAINED = "untrained backbone"
FULL_FEDAVG = "FedAvg (full model)"
#: methods run only when named with --methods
OPT_IN = (FULL_FEDAVG,)


def methods(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Config sections of each method (merged over the shared base)."""
    bilevel = {"inner_lr": 0.5, "outer_lr": 0.1, "inner_steps": 5, "max_hypergrad_norm": 1.0}
    fedavg = {"name": "fedavg", "lr": 0.1, "local_steps": 5}
    head = {"head": args.head}  # the single-level baselines keep one head row per class
    return {
        "RABO": {
            "mask": {"policy": "importance"},
            "algorithm": {"name": "rabo", **bilevel},
            "task": head,
        },
        "RAFBO": {
            "mask": {"policy": "importance"},
            "task": head,
            "algorithm": {"name": "rafbo", **bilevel},
            # |P| sampled coordinates of x get the finite-difference indirect term, the rest
            # the direct term only (the paper's RAFBO; one gradient of g per coordinate)
            "estimator": {
                "name": "finite_difference",
                "scheme": "forward",  # the paper's eq. (10)
                "num_coordinates": args.rafbo_coordinates,
            },
        },
        "FedMBO (full model)": {
            "mask": {"policy": "none"},
            "task": head,
            "fleet": {"num_clients": len(CAPACITIES), "capacities": [1.0] * len(CAPACITIES)},
            "algorithm": {
                "name": "fedmbo",
                **bilevel,
                "neumann_terms": 5,
                "eta": 0.5,
                "clients_per_phase": len(CAPACITIES),
            },
        },
        "Static (HeteroFL)": {"mask": {"policy": "leading"}, "algorithm": fedavg},
        "FedRolex": {"mask": {"policy": "rolling"}, "algorithm": fedavg},
        # opt-in (--methods): what meta-training on the clients' classes does to the backbone
        # at all, with no submodels in the way
        FULL_FEDAVG: {
            "mask": {"policy": "none"},
            "fleet": {"num_clients": len(CAPACITIES), "capacities": [1.0] * len(CAPACITIES)},
            "algorithm": fedavg,
        },
    }


def base_config(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    data: dict[str, Any]
    if args.omniglot:
        data = {"name": "omniglot", "root": args.omniglot, "image_size": args.image_size}
        partition: dict[str, Any] = {"kind": "classes"}
    else:
        data = {"name": "digits", "image_size": args.image_size}
        partition = {"kind": "iid"}
    return {
        "seed": seed,
        "rounds": args.rounds,
        "eval_every": args.eval_every,
        "data": data,
        "partition": partition,
        # one model for every method: static BatchNorm (HeteroFL's sBN: batch statistics in
        # training, recomputed by the server before each evaluation)
        "model": {"name": "conv4", "width": args.width, "batchnorm": "static"},
        "task": {
            "name": "few_shot",
            "ways": args.ways,
            "shots": args.shots,
            "queries": args.queries,
            "test_episodes": args.episodes,
        },
        "fleet": {"num_clients": len(CAPACITIES), "capacities": CAPACITIES},
    }


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and key in out else value
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the paper's size (slow)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--width", type=int, default=None, help="Conv-4 channels")
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--episodes", type=int, default=None, help="meta-test episodes")
    parser.add_argument("--ways", type=int, default=5)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--queries", type=int, default=15)
    parser.add_argument(
        "--head",
        choices=["classes", "episode"],
        default="classes",
        help="the bilevel methods' head: N rows relabelled per episode, or one row per class",
    )
    parser.add_argument("--rafbo-coordinates", type=int, default=32, help="RAFBO's |P|")
    parser.add_argument("--omniglot", default=None, help="Omniglot folder (instead of digits)")
    parser.add_argument("--methods", nargs="+", default=None, help="subset of the methods")
    parser.add_argument("--out", default="runs/paper")
    args = parser.parse_args(argv)
    full = args.full
    args.seeds = args.seeds or ([0, 1, 2, 3, 4] if full else [0, 1, 2])
    args.rounds = args.rounds or (100 if full else 30)
    args.width = args.width or (64 if full else 32)
    args.image_size = args.image_size or (28 if full or args.omniglot else 16)
    args.episodes = args.episodes or (600 if full else 500)
    args.eval_every = max(1, args.rounds // 6)

    table = methods(args)
    chosen = args.methods or [name for name in table if name not in OPT_IN]
    unknown = set(chosen) - set(table)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {list(table)}")
    command = "OMP_NUM_THREADS=1 .venv/bin/python " + shlex.join(
        [f"benchmarks/paper/{Path(__file__).name}", *(sys.argv[1:] if argv is None else argv)]
    )
    print(command, flush=True)

    finals: dict[str, list[tuple[float, float]]] = {}
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    for name in chosen:  # every config is checked before the first run
        for seed in args.seeds:
            parse_config(merge(base_config(args, seed), table[name]))
    # reference: the initial backbone (random weights, BatchNorm statistics recomputed), evaluated
    # on the same episodes; what training adds is the distance above this row
    for seed in args.seeds:
        exp = build(parse_config(merge(base_config(args, seed), table[chosen[0]])))
        sim = exp.simulation
        metrics = sim.evaluate(sim.algorithm.model_state(exp.initial_state))
        finals.setdefault(UNTRAINED, []).append((metrics["accuracy"], metrics["accuracy_ci95"]))
        print(f"{UNTRAINED:22s} seed {seed}: {metrics['accuracy']:.3f}", flush=True)
    for name in chosen:
        for seed in args.seeds:
            start = time.perf_counter()
            cfg = parse_config(merge(base_config(args, seed), table[name]))
            result = run(cfg, progress=False, save=False)
            acc, ci = result.final["test_accuracy"], result.final["test_accuracy_ci95"]
            finals.setdefault(name, []).append((acc, ci))
            evaluated = [r for r in result.rounds if "test_accuracy" in r]
            curve = [(r["round"] + 1, r["test_accuracy"]) for r in evaluated]
            curves.setdefault(name, []).append(curve)
            elapsed = time.perf_counter() - start
            path = ", ".join(f"r{r}: {a:.3f}" for r, a in curve)
            line = f"{name:22s} seed {seed}: {acc:.3f} ± {ci:.3f}  ({elapsed:.0f} s; {path})"
            print(line, flush=True)

    data = "Omniglot" if args.omniglot else f"digits {args.image_size}x{args.image_size}"
    lines = [
        f"{args.ways}-way {args.shots}-shot, {data}, Conv-4 width {args.width}, "
        f"{len(CAPACITIES)} clients at capacities {CAPACITIES}, {args.rounds} rounds, "
        f"{args.episodes} meta-test episodes per run (accuracy ± 95 % CI).",
        "",
        "| method | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean over seeds |",
        "|---" + "|---:" * (len(args.seeds) + 1) + "|",
    ]
    for name, rows in finals.items():
        cells = [f"{a:.3f} ± {c:.3f}" for a, c in rows]
        accs = [a for a, _ in rows]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        mean = f"{statistics.fmean(accs):.3f} (seed std {spread:.3f})"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    lines += ["", f"    {command}"]
    markdown = "\n".join(lines)
    print(markdown)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rabo_fewshot.md").write_text(markdown + "\n")
    plot(curves, out / "rabo_fewshot.png", f"{args.ways}-way {args.shots}-shot, {data}")
    print(f"wrote {out / 'rabo_fewshot.md'} and {out / 'rabo_fewshot.png'}")


def plot(curves: dict[str, list[list[tuple[int, float]]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in curves.items():
        rounds = [r for r, _ in runs[0]]
        mean = [statistics.fmean(run[i][1] for run in runs) for i in range(len(rounds))]
        ax.plot(rounds, mean, marker="o", label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("meta-test accuracy (mean over seeds)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
