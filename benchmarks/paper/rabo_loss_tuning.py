"""RABO paper, Sec. V-B / Figs. 5-6: VS-loss tuning on long-tailed data, accuracy and costs.

Paper: Li, Zhang, Zheng, Shi, Yuan, Cheng and Yu, "Distributed Bilevel Optimization with Dual
Pruning for Resource-limited Clients" (RABO/RAFBO), Sec. V-B, Figs. 5 and 6
(``papers/rabo_rafbo.txt``): the hyperparameters x = [w, l, Delta] of the VS loss (Kini et al.)
are tuned on each client's validation data while the inner model y (ResNet-18 in the paper) is
trained on its training data; long-tailed CIFAR-10 (``n'_i = n_i mu^i``) split into 10 shards,
80 % training / 20 % validation per client, every client at capacity beta = 1/2. The paper
plots test accuracy against global iterations (Fig. 5) and compute and communication against
FedMBO's (Fig. 6: RABO about 2x and RAFBO about 4x less compute, both 25 % of the
communication).

Here: task ``vs_loss`` (``radbo/tasks/vs_loss.py``: g = the VS loss with x on the training
split, f = the class-balanced cross-entropy on the validation split), ``[data] imbalance``
(class c of C keeps ``imbalance ** (-c / (C - 1))`` of its training examples, i.e. the paper's
mu = imbalance ** (-1 / (C - 1)); the paper does not give mu; the test set stays balanced) and
``[data] outer_fraction = 0.2`` (each client's 80 / 20 split), 10 clients split iid.
The inner model is ``--model mlp`` (default: model ``vs_mlp``, one hidden layer of ``--width``
units, the whole network y, its hidden layer prunable) or ``--model resnet18`` (the paper's:
model ``vs_resnet18``, stage widths ``--width`` x 1, 2, 4, 8, every layer y and its channels
prunable; ``--full`` runs it at width 64, the paper's size; digits are upsampled to 16x16 for
it). Data: scikit-learn's digits
(default, no files), MNIST with ``--mnist DIR`` or CIFAR-10 with ``--cifar10 DIR``. Rows:

- RABO: importance masks on y at r = 1/2, damped CG hypergradient (Alg. 1);
- RAFBO: importance masks at r = 1/2, forward finite-difference hypergradient (eq. 10) on
  ``--rafbo-coordinates`` sampled coordinates of x;
- FedMBO (full model): every client at capacity 1, randomized Neumann hypergradient; the
  reference of every cost fraction;
- RABO (full model): RABO's own round with every client at capacity 1 (not in the paper): what
  the masks alone save, apart from FedMBO's different round (one communication round per
  inner step and per Neumann term);
- FedAvg (full model, no tuning): single-level FedAvg of the same network with plain
  cross-entropy on all of each client's data (model ``mlp`` or ``resnet18`` of the same
  widths, task ``hyper_representation`` with ``inner_l2 = 0``): no loss hyperparameters at all;
- Static (HeteroFL) and FedRolex: the same single-level training on ``leading`` / ``rolling``
  submodels at r = 1/2.

Reported: balanced test accuracy (mean per-class recall; on the balanced test set it equals
accuracy up to the test split's rounding) at the last round and against rounds, and each run's
total FLOPs (torch's FLOP counter) and bytes sent and received, as fractions of FedMBO's in
the same seed, averaged over seeds.

    # digits, MLP 64-128-10, 40 rounds, seeds 0 1 2 (a few minutes on 2 cores)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_loss_tuning.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_loss_tuning.py --mnist DIR
    # ResNet-18 at toy width on the CPU (digits 16x16)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_loss_tuning.py --model resnet18
    # the paper's size on a GPU: CIFAR-10, ResNet-18 (widths 64-512), 200 rounds
    # (about 6 s per RABO round on an H100: some 20 minutes per row and seed)
    .venv/bin/python benchmarks/paper/rabo_loss_tuning.py --cifar10 DIR --full --device cuda \\
        --coordinate-batch 8

Writes ``<out>/rabo_loss_tuning.md`` (the table, the device that produced it and the command),
``<out>/rabo_loss_tuning.png`` (Fig. 5: balanced test accuracy against rounds, mean over seeds
with a band of +- one seed standard deviation) and ``<out>/rabo_loss_tuning_costs.png``
(Fig. 6: compute and communication as fractions of FedMBO's). Run with ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from radbo.config import RunConfig, parse_config
from radbo.experiment import run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.paper.rabo_common import (  # noqa: E402
    add_common_arguments,
    add_coordinate_batch,
    batch_setting,
    check_device,
    command_line,
    giga,
    mean_std,
    merge,
    plot_curves,
    provenance,
)

FEDMBO = "FedMBO (full model)"
RABO_FULL = "RABO (full model)"
FEDAVG = "FedAvg (full model, no tuning)"
STATIC = "Static (HeteroFL)"
FEDROLEX = "FedRolex"
#: every submodel row's capacity (the paper's beta = 1/2); full-model rows train at 1
CAPACITY = 0.5
CLIENTS = 10
#: RABO / RAFBO / FedMBO steps (those of ``examples/vs_loss.toml``, whose run learns x)
BILEVEL = {
    "inner_lr": 0.3,
    "outer_lr": 1.0,
    "inner_steps": 10,
    "batch_size": 32,
    "outer_batch_size": 32,
    "max_hypergrad_norm": 1.0,
}
#: g is not convex in the network's weights: damped CG keeps the implicit hypergradient sound
CG = {"max_iter": 5, "damping": 1.0}
#: Fig. 6 as the text of Sec. V-B gives it: (compute, communication) as fractions of FedMBO's
PAPER = {"RABO": (0.5, 0.25), "RAFBO": (0.25, 0.25), FEDMBO: (1.0, 1.0)}


def methods(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Config sections of each method (merged over the shared base), in table order."""
    full = {"mask": {"policy": "none"}, "fleet": {"capacities": [1.0]}}
    importance = {"mask": {"policy": "importance"}}
    rabo = {"algorithm": {"name": "rabo", **BILEVEL}, "estimator": {"name": "cg", **CG}}
    # single-level: the same network with plain cross-entropy, nothing tuned (x = the hidden
    # layer, y = the head; fedavg trains both alike)
    plain = {
        "model": model_section(args, tuned=False),
        "task": {"name": "hyper_representation", "inner_l2": 0.0},
        "algorithm": {"name": "fedavg", "lr": BILEVEL["inner_lr"], "local_steps": 10},
    }
    return {
        "RABO": {**importance, **rabo},
        "RAFBO": {
            **importance,
            "algorithm": {"name": "rafbo", **BILEVEL},
            "estimator": {
                "name": "finite_difference",
                "scheme": "forward",
                "num_coordinates": args.rafbo_coordinates,
                "cg_iters": CG["max_iter"],
                "damping": CG["damping"],
                **batch_setting(args.coordinate_batch),
            },
        },
        FEDMBO: {
            **full,
            "algorithm": {
                "name": "fedmbo",
                **BILEVEL,
                "neumann_terms": 5,
                "eta": 0.5,
                "clients_per_phase": CLIENTS,
            },
        },
        RABO_FULL: {**full, **rabo},
        FEDAVG: {**full, **plain},
        STATIC: {"mask": {"policy": "leading"}, **plain},
        FEDROLEX: {"mask": {"policy": "rolling"}, **plain},
    }


def data_section(args: argparse.Namespace) -> dict[str, Any]:
    """``[data]``: digits, MNIST or CIFAR-10, long-tailed, 20 % of each client for f."""
    common = {"outer_fraction": 0.2, "imbalance": args.imbalance}
    if args.cifar10:
        return {"name": "cifar10", "root": args.cifar10, **common}
    if args.mnist:
        return {"name": "mnist", "root": args.mnist, **common}
    size = {"image_size": 16} if args.model == "resnet18" else {}  # ResNet-18: >= 9x9
    return {"name": "digits", "test_fraction": 0.2, **size, **common}


def model_section(args: argparse.Namespace, *, tuned: bool) -> dict[str, Any]:
    """``[model]``: the VS-loss model (``tuned``) or the plain one of the same widths."""
    if args.model == "resnet18":
        widths = [args.width * k for k in (1, 2, 4, 8)]
        return {"name": "vs_resnet18" if tuned else "resnet18", "widths": widths}
    return {"name": "vs_mlp" if tuned else "mlp", "hidden": [args.width]}


def model_label(args: argparse.Namespace) -> str:
    """The inner model in words."""
    if args.model == "resnet18":
        return f"ResNet-18, stage widths {[args.width * k for k in (1, 2, 4, 8)]}"
    return f"MLP, hidden width {args.width}"


def data_label(args: argparse.Namespace) -> str:
    """``digits``, ``MNIST (DIR)`` or ``CIFAR-10 (DIR)``."""
    if args.cifar10:
        return f"CIFAR-10 ({args.cifar10})"
    digits = "digits 16x16" if args.model == "resnet18" else "digits 8x8"
    return f"MNIST ({args.mnist})" if args.mnist else digits


def base_config(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    return {
        "seed": seed,
        "rounds": args.rounds,
        "eval_every": args.eval_every,
        "data": data_section(args),
        "partition": {"kind": "iid"},
        "model": model_section(args, tuned=True),
        "task": {"name": "vs_loss", "inner_l2": 1e-3},
        "fleet": {"num_clients": CLIENTS, "capacities": [CAPACITY]},
        "runtime": {"device": args.device},
    }


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--full",
        action="store_true",
        help="the paper's size (a GPU): ResNet-18 at widths 64-512, 200 rounds",
    )
    parser.add_argument(
        "--model", choices=["mlp", "resnet18"], default=None, help="default mlp, --full resnet18"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=None, help="default 40, --full 200")
    parser.add_argument("--eval-every", type=int, default=None, help="rounds between evaluations")
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="MLP hidden units (default 128), or ResNet-18's first stage (default 4, --full 64)",
    )
    parser.add_argument(
        "--imbalance",
        type=float,
        default=10.0,
        help="largest / smallest class of the training set (mu = imbalance ** (-1 / (C - 1)))",
    )
    parser.add_argument("--rafbo-coordinates", type=int, default=8, help="RAFBO's |P|")
    add_coordinate_batch(parser)
    parser.add_argument("--methods", nargs="+", default=None, help="subset of the methods")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--mnist", default=None, metavar="DIR", help="MNIST IDX files in DIR")
    where.add_argument("--cifar10", default=None, metavar="DIR", help="CIFAR-10 binary in DIR")
    add_common_arguments(parser, omniglot=False)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (200 if args.full else 40)
    args.model = args.model or ("resnet18" if args.full else "mlp")
    default_width = {"mlp": 128, "resnet18": 64 if args.full else 4}[args.model]
    args.width = args.width or default_width
    args.eval_every = args.eval_every or (10 if args.full else max(1, args.rounds // 8))
    return parser, args


def mega(value: float) -> str:
    """``value`` / 1e6 with as many decimals as a table of small and large runs needs."""
    m = value / 1e6
    return f"{m:,.0f}" if m >= 100 else f"{m:.1f}" if m >= 1 else f"{m:.3f}"


def costs(results: dict[str, list[dict[str, float]]], key: str) -> dict[str, float]:
    """Each method's ``key`` total as a fraction of FedMBO's in the same seed, mean over
    seeds (FedMBO itself: exactly 1)."""
    reference = results[FEDMBO]
    return {
        name: mean_std([t[key] / ref[key] for t, ref in zip(runs, reference, strict=True)])[0]
        for name, runs in results.items()
    }


def plot_costs(compute: dict[str, float], comm: dict[str, float], path: Path) -> None:
    """Fig. 6: compute and communication of every method as fractions of FedMBO's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(compute)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    at = range(len(names))
    ax.bar([i - 0.2 for i in at], [compute[n] for n in names], 0.4, label="compute (FLOPs)")
    ax.bar([i + 0.2 for i in at], [comm[n] for n in names], 0.4, label="communication (bytes)")
    ax.axhline(1.0, color="k", ls="--", lw=1)
    ax.set_xticks(list(at), names, rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("fraction of FedMBO's (mean over seeds)")
    ax.set_title("loss-function tuning: cost against FedMBO (full model)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    table = methods(args)
    chosen = args.methods or list(table)
    unknown = set(chosen) - set(table)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {list(table)}")
    if FEDMBO not in chosen:
        parser.error(f"--methods must include {FEDMBO!r}: every cost is a fraction of its")
    command = command_line(__file__, argv)
    print(command, flush=True)

    # every config is parsed before the first run
    check_device(args.device)
    configs: dict[tuple[str, int], RunConfig] = {
        (name, seed): parse_config(merge(base_config(args, seed), table[name]))
        for name in chosen
        for seed in args.seeds
    }

    finals: dict[str, list[float]] = {}
    totals: dict[str, list[dict[str, float]]] = {}
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    for name in chosen:
        for seed in args.seeds:
            start = time.perf_counter()
            result = run(configs[(name, seed)], progress=False, save=False)
            acc = result.final["test_balanced_accuracy"]
            finals.setdefault(name, []).append(acc)
            totals.setdefault(name, []).append(result.totals)
            curve = [
                (r["round"] + 1, r["test_balanced_accuracy"])
                for r in result.rounds
                if "test_balanced_accuracy" in r
            ]
            curves.setdefault(name, []).append(curve)
            elapsed = time.perf_counter() - start
            path = ", ".join(f"r{r}: {a:.3f}" for r, a in curve)
            print(f"{name:31s} seed {seed}: {acc:.3f}  ({elapsed:.0f} s; {path})", flush=True)

    compute, comm = costs(totals, "flops"), costs(totals, "bytes")
    data = data_label(args)
    lines = [
        "# RABO paper Sec. V-B / Figs. 5-6: loss-function tuning",
        "",
        f"{data} long-tailed (imbalance {args.imbalance:g}: class c keeps "
        f"{args.imbalance:g}^(-c/9) of its training examples; balanced test set), {CLIENTS} "
        f"clients split iid, 80 % training / 20 % validation each; {model_label(args)} "
        f"(the paper: ResNet-18 at widths 64-512); submodel rows "
        f"at capacity 1/2, full-model rows at 1; {args.rounds} rounds; RAFBO |P| = "
        f"{args.rafbo_coordinates} of dim(x) = 30. Accuracy: balanced test accuracy at the last "
        "round ('mean' over seeds, with the seed standard deviation). GFLOP and MB: one run's "
        "total over all clients, mean over seeds; 'vs FedMBO': the fraction of FedMBO's in the "
        "same seed, mean over seeds. The paper's column is Fig. 6 as Sec. V-B's text gives it "
        "(compute, communication against FedMBO; ResNet-18 on long-tailed CIFAR-10); the paper "
        "gives no accuracy numbers for Fig. 5.",
        "",
        provenance(args.device),
        "",
        "| method | "
        + " | ".join(f"seed {s}" for s in args.seeds)
        + " | mean (seed std) | GFLOP | compute vs FedMBO | MB | bytes vs FedMBO "
        "| paper (compute, bytes) |",
        "|---" + "|---:" * (len(args.seeds) + 6) + "|",
    ]
    for name, accs in finals.items():
        mean, spread = mean_std(accs)
        flops = mean_std([t["flops"] for t in totals[name]])[0]
        sent = mean_std([t["bytes"] for t in totals[name]])[0]
        cited = "{:.2f}, {:.2f}".format(*PAPER[name]) if name in PAPER else ""
        lines.append(
            f"| {name} | "
            + " | ".join(f"{a:.3f}" for a in accs)
            + f" | {mean:.3f} ({spread:.3f}) | {giga(flops)} | {compute[name]:.3f} "
            f"| {mega(sent)} | {comm[name]:.3f} | {cited} |"
        )
    lines += ["", f"    {command}"]
    markdown = "\n".join(lines)
    print(markdown)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rabo_loss_tuning.md").write_text(markdown + "\n")
    plot_curves(
        curves,
        out / "rabo_loss_tuning.png",
        f"VS-loss tuning, {data}, imbalance {args.imbalance:g}, {model_label(args)}",
        ylabel="balanced test accuracy",
    )
    plot_costs(compute, comm, out / "rabo_loss_tuning_costs.png")
    print(
        f"wrote {out / 'rabo_loss_tuning.md'}, rabo_loss_tuning.png and rabo_loss_tuning_costs.png"
    )


if __name__ == "__main__":
    main()
