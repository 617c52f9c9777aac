"""RABO paper, Table III: RABO's and RAFBO's accuracy as the fleet grows (10, 20, 30, 50 clients).

Paper: Li, Zhang, Zheng, Shi, Yuan, Cheng and Yu, "Distributed Bilevel Optimization with Dual
Pruning for Resource-limited Clients" (RABO/RAFBO), Sec. V-C and Table III
(``papers/rabo_rafbo.txt``): 5-way 1-shot and 5-shot on full Omniglot with 10, 20, 30 and 50
clients; accuracy falls as clients are added (RABO 76.05 -> 72.76 % 1-shot, 89.12 -> 86.58 %
5-shot) because each client holds fewer characters.

Here: the same few-shot task as ``rabo_fewshot.py`` (importance masks, the capacities {1, 1/2,
1/4, 1/8, 1/16} cycled over the clients, static BatchNorm, fixed meta-test episodes from the
run seed), for every client count and every K. On Omniglot the meta-train characters are split
by class over the clients, so a client of n holds about C / n of the C characters; a client
count that leaves some client fewer than N characters (omniglot-small's 136 characters over 30
or 50 clients: 4 or 2) is reported as "not enough classes" and not run. On digits (5
meta-train classes split iid) the limit is examples per class instead, and queries default to
5. ``--refit-steps S`` adds RABO with radbo's refit (``[algorithm] refit_steps``), the variant
that learns on Omniglot at width 32 and beyond (``rabo_fewshot.py``).

    # Conv-4 width 16, 10 rounds, seeds 0 1, 5-way 1- and 5-shot (about 5 minutes)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_scalability.py --omniglot DIR
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_scalability.py --omniglot DIR \\
        --clients 10 20 --shots 5 --refit-steps 100
    # the paper's size on a GPU: width 64, 28x28, 200 rounds, 600 episodes, seeds 0 1 2
    .venv/bin/python benchmarks/paper/rabo_scalability.py --omniglot DIR --full --device cuda

Writes ``<out>/rabo_scalability.md`` (the table, the device that produced it and the command)
and ``<out>/rabo_scalability.png`` (final accuracy against clients). Run with
``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from radbo.config import RunConfig, parse_config
from radbo.experiment import build, run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.paper.rabo_common import (  # noqa: E402
    CAPACITIES,
    CAPACITY_NAMES,
    add_common_arguments,
    check_device,
    clients_usable,
    command_line,
    data_label,
    data_sections,
    data_unserved,
    default_queries,
    fleet_unserved,
    mean_std,
    model_section,
    provenance,
    rabo_sections,
    rafbo_sections,
    refuse,
)

UNTRAINED = "untrained backbone"
#: Table III of the paper (full Omniglot, 5-way), in %: shots -> method -> clients -> accuracy
PAPER = {
    1: {
        "RABO": {10: 76.05, 20: 75.81, 30: 74.39, 50: 72.76},
        "RAFBO": {10: 75.09, 20: 74.85, 30: 73.04, 50: 71.80},
    },
    5: {
        "RABO": {10: 89.12, 20: 88.52, 30: 87.76, 50: 86.58},
        "RAFBO": {10: 88.57, 20: 87.53, 30: 87.03, 50: 86.44},
    },
}


def methods(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Config sections of each method, in table order."""
    table = {"RABO": rabo_sections()}
    if args.refit_steps:
        table[f"RABO, refit {args.refit_steps}"] = rabo_sections(args.refit_steps)
    table["RAFBO"] = rafbo_sections(args.rafbo_coordinates)
    return table


def config(
    args: argparse.Namespace, sections: dict[str, Any], clients: int, shots: int, seed: int
) -> RunConfig:
    data, partition = data_sections(args.omniglot, args.image_size)
    model, _ = model_section(args.model, args.width)
    return parse_config(
        {
            "seed": seed,
            "rounds": args.rounds,
            "eval_every": args.rounds,  # the final accuracy only
            "data": data,
            "partition": partition,
            "model": model,
            "task": {
                "name": "few_shot",
                "ways": args.ways,
                "shots": shots,
                "queries": args.queries[shots],
                "test_episodes": args.episodes,
            },
            "fleet": {"num_clients": clients, "capacities": CAPACITIES},
            "mask": {"policy": "importance"},
            "runtime": {"device": args.device},
            **sections,
        }
    )


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--full",
        action="store_true",
        help="the paper's size: width 64, 28x28, 200 rounds, 600 episodes, seeds 0 1 2",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 20, 30, 50])
    parser.add_argument("--ways", type=int, default=5, help="N")
    parser.add_argument("--shots", type=int, nargs="+", default=[1, 5], help="K (one table each)")
    parser.add_argument(
        "--queries", type=int, default=None, help="Q per class (default: 20 - K on Omniglot, 5)"
    )
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
        "--refit-steps", type=int, default=0, help="add the row 'RABO, refit S' (default 0: none)"
    )
    parser.add_argument("--rafbo-coordinates", type=int, default=32, help="RAFBO's |P|")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    full, omniglot = args.full, args.omniglot
    args.seeds = args.seeds or ([0, 1, 2] if full else [0, 1])
    args.rounds = args.rounds or (200 if full else 10)
    args.width = args.width or (64 if full else {"conv4": 16, "resnet12": 8}[args.model])
    args.image_size = args.image_size or (28 if full or omniglot else 16)
    args.episodes = args.episodes or (600 if full else 200)
    # digits' 5 meta-train classes hold ~180 examples each: 10 clients leave ~18 per class
    args.queries = {
        k: args.queries if args.queries is not None else default_queries(omniglot, k, digits=5)
        for k in args.shots
    }
    if args.refit_steps < 0:
        parser.error(f"--refit-steps must be >= 0, got {args.refit_steps}")
    return parser, args


def cell(accs: list[tuple[float, float]]) -> str:
    """One seed: accuracy ± 95 % CI over episodes; several: mean (seed std)."""
    if not accs:
        return ""
    if len(accs) == 1:
        return f"{accs[0][0]:.3f} ± {accs[0][1]:.3f}"
    mean, spread = mean_std([a for a, _ in accs])
    return f"{mean:.3f} ({spread:.3f})"


def main(argv: list[str] | None = None) -> None:
    _, args = parse_args(argv)
    command = command_line(__file__, argv)
    print(command, flush=True)
    table = methods(args)

    # every config is parsed and checked against the data before the first run: the data set
    # must serve N-way episodes at all (else refused), a client count may leave clients
    # without N classes (then its column says so)
    check_device(args.device)
    skipped: dict[tuple[int, int], tuple[str, str]] = {}
    spread: dict[tuple[int, int], str] = {}
    configs: dict[tuple[str, int, int, int], RunConfig] = {}
    for shots in args.shots:
        for clients in args.clients:
            for name, sections in table.items():
                for seed in args.seeds:
                    configs[(name, shots, clients, seed)] = config(
                        args, sections, clients, shots, seed
                    )
            first = configs[(next(iter(table)), shots, clients, args.seeds[0])]
            problem = data_unserved(first)
            if problem is not None:
                refuse(problem)
            usable = clients_usable(first)
            low, high = (min(usable), max(usable)) if usable else (0, 0)
            spread[(shots, clients)] = f"{low}" if low == high else f"{low}-{high}"
            shortfall = fleet_unserved(first)
            if shortfall is not None:
                skipped[(shots, clients)] = shortfall
                print(f"not run: {shortfall[1]}", flush=True)

    results: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for shots in args.shots:
        served = [n for n in args.clients if (shots, n) not in skipped]
        for seed in args.seeds if served else []:
            # the initial backbone is the same for every client count (same seed and model)
            exp = build(configs[(next(iter(table)), shots, served[0], seed)])
            sim = exp.simulation
            metrics = sim.evaluate(sim.algorithm.model_state(exp.initial_state))
            for n in served:
                results.setdefault((UNTRAINED, shots, n), []).append(
                    (metrics["accuracy"], metrics["accuracy_ci95"])
                )
            print(f"{UNTRAINED}, {shots}-shot, seed {seed}: {metrics['accuracy']:.3f}", flush=True)
        for clients in served:
            for name in table:
                for seed in args.seeds:
                    start = time.perf_counter()
                    result = run(configs[(name, shots, clients, seed)], progress=False, save=False)
                    acc = result.final["test_accuracy"]
                    ci = result.final["test_accuracy_ci95"]
                    results.setdefault((name, shots, clients), []).append((acc, ci))
                    print(
                        f"{name}, {shots}-shot, {clients} clients, seed {seed}: {acc:.3f} ± "
                        f"{ci:.3f} ({time.perf_counter() - start:.0f} s)",
                        flush=True,
                    )

    data = data_label(args.omniglot, args.image_size)
    _, backbone = model_section(args.model, args.width)
    rows = [UNTRAINED, *table]
    header = "| method | K | " + " | ".join(f"{n} clients" for n in args.clients) + " |"
    rule = "|---|---:" + "|---:" * len(args.clients) + "|"
    queries = ", ".join(f"{q} for K = {k}" for k, q in args.queries.items())
    each = "accuracy ± 95 % CI over episodes" if len(args.seeds) == 1 else "mean (seed std)"
    lines = [
        f"# RABO paper Table III: scalability, {args.ways}-way",
        "",
        f"{args.ways}-way K-shot, queries per class {queries}, {data}, {backbone} (static BN), "
        f"importance masks, capacities {CAPACITY_NAMES} cycled over the clients, "
        f"{args.rounds} rounds, {args.episodes} meta-test episodes, seeds {args.seeds} "
        f"({each}); RAFBO |P| = {args.rafbo_coordinates}. 'classes per client' counts the "
        "meta-train classes with at least K + Q examples each client holds (fewest-most); a "
        f"client count that leaves some client fewer than {args.ways} is not run.",
        "",
        provenance(args.device),
        "",
        header,
        rule,
    ]
    for shots in args.shots:
        usable = [spread[(shots, n)] for n in args.clients]
        lines.append(f"| classes per client | {shots} | " + " | ".join(usable) + " |")
        for name in rows:
            cells = []
            for n in args.clients:
                if (shots, n) in skipped:
                    cells.append(skipped[(shots, n)][0])
                else:
                    cells.append(cell(results.get((name, shots, n), [])))
            lines.append(f"| {name} | {shots} | " + " | ".join(cells) + " |")
    lines += ["", "Paper, Table III (full Omniglot: 964 meta-train characters, ResNet-12):", ""]
    lines += [header, rule]
    for shots in args.shots:
        for name, by_clients in PAPER.get(shots, {}).items():
            values = [by_clients.get(n) for n in args.clients]
            lines.append(
                f"| {name} | {shots} | "
                + " | ".join("" if v is None else f"{v / 100:.3f}" for v in values)
                + " |"
            )
    if skipped:
        lines += ["", "Not run:", ""]
        lines += [f"- {line}" for _, line in skipped.values()]
    lines += ["", f"    {command}"]
    markdown = "\n".join(lines)
    print(markdown)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rabo_scalability.md").write_text(markdown + "\n")
    short = data_label(args.omniglot, args.image_size, where=False)
    plot(results, args, out / "rabo_scalability.png", f"{args.ways}-way, {short}, {backbone}")
    print(f"wrote {out / 'rabo_scalability.md'} and {out / 'rabo_scalability.png'}")


def plot(
    results: dict[tuple[str, int, int], list[tuple[float, float]]],
    args: argparse.Namespace,
    path: Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(name for name, _, _ in results))
    for i, name in enumerate(names):
        for j, shots in enumerate(args.shots):
            points = [
                (n, mean_std([a for a, _ in results[(name, shots, n)]]))
                for n in args.clients
                if (name, shots, n) in results
            ]
            if not points:
                continue
            xs = [n for n, _ in points]
            ax.errorbar(
                xs,
                [m for _, (m, _) in points],
                yerr=[s for _, (_, s) in points],
                marker="os"[j % 2],
                ls=["-", "--"][j % 2],
                color=f"C{i}",
                capsize=3,
                label=f"{name}, {shots}-shot",
            )
    ax.set_xticks(args.clients)
    ax.set_xlabel("clients (not shown: not enough classes per client)")
    ax.set_ylabel(f"final meta-test accuracy (mean of {len(args.seeds)} seeds)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
