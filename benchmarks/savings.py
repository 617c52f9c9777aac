"""Compute, communication and simulated-time savings of a run against its full-model baseline.

Runs a config (default: the demo) with ``baseline.enabled = true`` for several seeds and prints
a Markdown table of RABO's FLOPs, bytes and simulated time as fractions of the full-model
FedMBO-style baseline on the same fleet (all ratios are measured within one run, so machine
noise does not enter), plus the per-tier compute fractions.

    .venv/bin/python benchmarks/savings.py                       # demo config, seeds 0 1 2
    .venv/bin/python benchmarks/savings.py --baseline fedmbo     # against FedMBO itself
    .venv/bin/python benchmarks/savings.py --config my.toml --seeds 0 --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from radbo.config import load_config, parse_config
from radbo.experiment import run

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "demo.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    parser.add_argument(
        "--baseline",
        choices=["fedmbo_style", "fedmbo"],
        default=None,
        help="baseline algorithm (default: the config's [baseline] algorithm)",
    )
    args = parser.parse_args()

    base = load_config(args.config).model_dump()
    base["baseline"] = {**base["baseline"], "enabled": True}
    base["runtime"]["backend"] = "sequential"  # as BENCHMARKS.md's figures were measured
    if args.baseline is not None:
        base["baseline"]["algorithm"] = args.baseline
    if args.rounds is not None:
        base["rounds"] = args.rounds
    rows = []
    print(
        "| seed | acc RABO | acc baseline | compute | bytes (up+down) | bytes up | sim. time "
        "| comm. rounds RABO / baseline |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed in args.seeds:
        result = run(parse_config({**base, "seed": seed}), progress=False, save=False)
        sv, b = result.savings, result.baseline
        tiers = {
            tier: t["flops"] / b.totals_by_tier[tier]["flops"]
            for tier, t in result.totals_by_tier.items()
            if b.totals_by_tier.get(tier, {}).get("flops")
        }
        row = {
            "seed": seed,
            "accuracy": result.final["test_accuracy"],
            "baseline_accuracy": b.final["test_accuracy"],
            **sv,
            "compute_fraction_by_tier": tiers,
            "totals": result.totals,
            "baseline_totals": b.totals,
        }
        rows.append(row)
        print(
            f"| {seed} | {row['accuracy']:.3f} | {row['baseline_accuracy']:.3f} "
            f"| {sv['compute_fraction']:.1%} | {sv['bytes_fraction']:.1%} "
            f"| {sv['bytes_up_fraction']:.1%} | {sv['time_fraction']:.1%} "
            f"| {result.totals['communication_rounds']:.0f} / "
            f"{b.totals['communication_rounds']:.0f} |",
            flush=True,
        )
    print()
    print("compute fraction per device tier (seed, tier: fraction)")
    for row in rows:
        by_tier = sorted(row["compute_fraction_by_tier"].items())
        parts = ", ".join(f"{t}: {f:.1%}" for t, f in by_tier)
        print(f"- seed {row['seed']}: {parts}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
