"""Cost to reach a test accuracy: RABO against the full-model baselines on the demo fleet.

Equal numbers of iterations are not equal accuracy (FedMBO gets further per iteration but pays
~10x the communication rounds), so this benchmark evaluates every round and reports, for each
method and threshold, the cumulative FLOPs, bytes, simulated time and communication rounds at
the first round whose test accuracy reaches the threshold. All methods run on the same fleet,
data split and seed (``examples/demo.toml`` and the baseline examples), evaluated every round.
Ratios to RABO are measured within one invocation.

    .venv/bin/python benchmarks/time_to_accuracy.py                     # seeds 0 1, ~2 min
    .venv/bin/python benchmarks/time_to_accuracy.py --thresholds 0.8 0.85 --seeds 0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from radbo.config import load_config, parse_config
from radbo.experiment import run

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "RABO (demo)": ("demo.toml", 60),
    "ShroFBO (masked)": ("demo.toml", 60),
    "FedMBO (full model)": ("fedmbo.toml", 40),
    "FedMSA (full model)": ("fedmsa.toml", 60),
}


def config_for(method: str, seed: int):
    name, rounds = METHODS[method]
    data = load_config(ROOT / "examples" / name).model_dump()
    if method.startswith("ShroFBO"):
        # the demo's fleet and masks with ShroFBO (examples/shrofbo.toml's step sizes), tau = 10
        shro = load_config(ROOT / "examples" / "shrofbo.toml").model_dump()["algorithm"]
        data["algorithm"] = {**shro, "local_steps": 10}
        data.pop("estimator")  # ShroFBO's own default: exact (autograd) second-order products
    data.update(seed=seed, rounds=rounds, eval_every=1)
    data["baseline"] = {"enabled": False}
    data["runtime"]["backend"] = "sequential"  # as BENCHMARKS.md's figures were measured
    return parse_config(data)


def first_reach(rows: list[dict], threshold: float) -> dict | None:
    """Cumulative costs at the first round whose test accuracy is >= threshold."""
    flops = nbytes = comm = 0.0
    for row in rows:
        flops += row["cost_flops"]
        nbytes += row["cost_bytes"]
        comm += row["communication_rounds"]
        if row.get("test_accuracy", -1.0) >= threshold:
            return {
                "round": row["round"] + 1,
                "flops": flops,
                "bytes": nbytes,
                "sim_time_s": row["sim_clock_s"],
                "communication_rounds": comm,
            }
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.80, 0.85])
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args()

    out = []
    for seed in args.seeds:
        reached = {}
        for method in METHODS:
            result = run(config_for(method, seed), progress=False, save=False)
            best = max(r.get("test_accuracy", 0.0) for r in result.rounds)
            reached[method] = ({t: first_reach(result.rounds, t) for t in args.thresholds}, best)
        for t in args.thresholds:
            ref = reached["RABO (demo)"][0][t]
            print(f"\nseed {seed}, test accuracy >= {t:.2f} (ratios to RABO):")
            print("| method | best acc. | rounds | comm. rounds | GFLOP | MB | sim. time s |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for method, (hits, best) in reached.items():
                hit = hits[t]
                if hit is None:
                    print(f"| {method} | {best:.3f} | not reached | | | | |")
                    continue

                base = None if method == "RABO (demo)" else ref

                def cell(key: str, scale: float, digits: int, hit=hit, base=base) -> str:
                    value = f"{hit[key] / scale:.{digits}f}"
                    if base is not None and base[key]:
                        value += f" ({hit[key] / base[key]:.2f}x)"
                    return value

                print(
                    f"| {method} | {best:.3f} | {hit['round']} "
                    f"| {cell('communication_rounds', 1, 0)} | {cell('flops', 1e9, 2)} "
                    f"| {cell('bytes', 1e6, 1)} | {cell('sim_time_s', 1, 2)} |",
                    flush=True,
                )
            out.append({"seed": seed, "threshold": t, **{m: h[0][t] for m, h in reached.items()}})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
