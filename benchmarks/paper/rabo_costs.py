"""RABO paper, Fig. 4: RABO's and RAFBO's compute and communication as fractions of FedMBO.

Paper: Li et al., "Distributed Bilevel Optimization with Dual Pruning for Resource-limited
Clients" (RABO/RAFBO), Sec. V-A, Fig. 4 (``papers/rabo_rafbo.txt``): on the few-shot task with
the five capacities {1, 1/2, 1/4, 1/8, 1/16} mixed equally over the clients, RABO uses 26.7 % of
FedMBO's computation, RAFBO 17.8 %, and both 26.7 % of its communication (FedMBO trains the full
model on every client).

Here: 5-way 5-shot few-shot learning on digits (28x28; meta-train classes 0-4 split iid over
five clients, one per capacity; meta-test classes 5-9; 15 queries) or, with ``--omniglot PATH``,
on Omniglot (28x28; background alphabets split by character over the five clients, evaluation
alphabets meta-test; 15 = 20 - K queries), Conv-4 and ResNet-12 backbones (x) with a linear
head (y). Seven runs per backbone, same fleet, data and seed:

- RABO: importance masks, CG hypergradient (Alg. 1 as printed);
- RABO, refit S: RABO with ``[algorithm] refit_steps = S`` (``--refit-steps``, default 100;
  radbo's addition: S SGD steps on y before eq. (7), the variant that learns on Omniglot),
  whose S extra gradients per client and iteration are part of its cost;
- RAFBO: importance masks, finite-difference hypergradient on ``--rafbo-coordinates`` sampled
  coordinates of x; and RAFBO exactly as printed (eq. 10, no CG; ``as_printed = true``), to
  show what the printed algorithm would cost;
- FedMBO: ``radbo.experiment.baseline_config`` with ``[baseline] algorithm = "fedmbo"``: FedMBO
  itself (Alg. 1 + randomized Neumann chains) with RABO's T, step sizes and clipping, full model,
  every client at capacity 1; the reference of every fraction;
- full-model RABO round: ``baseline_config`` with ``algorithm = "fedmbo_style"``, RABO's own
  two-phase round on the full model with a Neumann hypergradient. Comparing with it isolates
  what the masks save from what the different round structure of FedMBO costs;
- Static (HeteroFL): single-level FedAvg on ``leading`` submodels, same fleet; the accuracy it
  ends at is the equal-accuracy target.

Costs come from the run ledger (FLOPs measured with torch's FLOP counter, bytes of the tensors
actually sent). (a) Equal rounds: totals after the same number of iterations. (b) Equal
accuracy: cumulative costs at the first evaluated round (every ``--eval-every`` rounds) whose
meta-test accuracy reaches the target (default: the accuracy Static ends at; ``--target``); a
method that never reaches it is reported as "not reached", not as a number.
The analytic expectation for channel pruning is a cost ~ r^2 per client, i.e. the mean of r^2
over the five capacities, (1 + 1/4 + 1/16 + 1/64 + 1/256) / 5 = 0.266.

    # Conv-4 width 32, 10 rounds, evaluated every round, 1 seed (about 5 minutes on 2 cores)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_costs.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_costs.py --omniglot DIR
    # and ResNet-12 widths 16-40-80-160 (6 rounds)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_costs.py --models conv4 resnet12
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/paper/rabo_costs.py --target 0.8
    # Conv-4 width 64 and ResNet-12 64-160-320-640, 100 rounds, 600 episodes, 3 seeds (GPU)
    .venv/bin/python benchmarks/paper/rabo_costs.py --omniglot DIR --full --device cuda

Writes ``<out>/rabo_costs.md`` (the tables, the explanation and the device that produced them)
and ``<out>/rabo_costs.png`` (fractions at equal rounds and at equal accuracy, and accuracy
against cumulative FLOPs).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from radbo.config import parse_config
from radbo.experiment import baseline_config, run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.paper.rabo_common import (  # noqa: E402
    BILEVEL,
    CAPACITIES,
    CAPACITY_NAMES,
    add_common_arguments,
    check_device,
    check_served,
    command_line,
    data_label,
    data_sections,
    default_queries,
    provenance,
    rabo_sections,
    rafbo_sections,
)
from benchmarks.time_to_accuracy import first_reach  # noqa: E402

MEAN_R2 = statistics.fmean(r * r for r in CAPACITIES)
PAPER = {"RABO": (0.267, 0.267), "RAFBO": (0.178, 0.267)}  # (compute, communication)
REFERENCE = "FedMBO"
FULL_ROUND = "full-model RABO round"
AS_PRINTED = "RAFBO as printed (no CG)"
#: the single-level submodel baseline whose final accuracy is the default equal-accuracy target
STATIC = "Static (HeteroFL)"
SHOTS = 5  # Fig. 4 is measured on the 5-way 5-shot task


def refit_name(steps: int) -> str:
    return f"RABO, refit {steps}"


def model_section(name: str, full: bool, width: int | None = None) -> tuple[dict[str, Any], str]:
    if name == "conv4":
        width = width or (64 if full else 32)
        return {"name": "conv4", "width": width}, f"Conv-4, width {width}"
    widths = [64, 160, 320, 640] if full else [16, 40, 80, 160]
    return {"name": "resnet12", "widths": widths}, "ResNet-12, widths " + "-".join(map(str, widths))


def configs(args: argparse.Namespace, model: str, seed: int) -> dict[str, Any]:
    """The run configs of one backbone and seed, in table order."""
    section, _ = model_section(model, args.full, args.width)
    if args.batchnorm:
        section["batchnorm"] = args.batchnorm
    data, partition = data_sections(args.omniglot, 28)
    base = {
        "seed": seed,
        "rounds": args.rounds or (100 if args.full else {"conv4": 10, "resnet12": 6}[model]),
        "eval_every": args.eval_every,
        "partition": partition,
        "data": data,
        "model": section,
        "task": {
            "name": "few_shot",
            "ways": 5,
            "shots": SHOTS,
            "queries": default_queries(args.omniglot, SHOTS),
            "test_episodes": args.episodes,
        },
        "fleet": {"num_clients": len(CAPACITIES), "capacities": CAPACITIES},
        "mask": {"policy": "importance"},
        **rabo_sections(),
        # the baseline section only parametrises baseline_config below (Neumann terms, 1/l)
        "baseline": {"terms": args.neumann_terms, "eta": args.neumann_eta},
        "runtime": {"device": args.device},
    }
    rabo = parse_config(base)
    refit = parse_config({**base, **rabo_sections(args.refit_steps)})
    rafbo = parse_config({**base, **rafbo_sections(args.rafbo_coordinates)})
    static = parse_config(
        {
            **base,
            "mask": {"policy": "leading"},
            "algorithm": {"name": "fedavg", "lr": 0.1, "local_steps": 5},
        }
    )

    def paired(kind: str):
        return baseline_config(
            parse_config({**base, "baseline": {**base["baseline"], "algorithm": kind}})
        )

    printed = {
        "name": "finite_difference",
        "scheme": "forward",
        "num_coordinates": args.rafbo_coordinates,
    }
    out = {"RABO": rabo}
    if args.refit_steps:
        out[refit_name(args.refit_steps)] = refit
    out.update(
        {
            "RAFBO": rafbo,
            # eq. (10) / Alg. 2 exactly as printed: no CG, delta_p contracted with grad_y f
            AS_PRINTED: parse_config(
                {
                    **base,
                    "algorithm": {"name": "rafbo", **BILEVEL},
                    "estimator": {**printed, "as_printed": True},
                }
            ),
            "FedMBO": paired("fedmbo"),
            FULL_ROUND: paired("fedmbo_style"),
            STATIC: static,
        }
    )
    return out


def per_capacity(ledger: list[dict[str, Any]], *keys: str) -> dict[int, float]:
    """Sum of ``keys`` per capacity index (client i has capacity ``CAPACITIES[i % 5]``)."""
    out: dict[int, float] = defaultdict(float)
    for row in ledger:
        out[row["client"] % len(CAPACITIES)] += sum(row[k] for k in keys)
    return out


def per_phase(ledger: list[dict[str, Any]]) -> dict[str, float]:
    """FLOPs per phase kind (``inner.3`` and ``inner.4`` are both ``inner``)."""
    out: dict[str, float] = defaultdict(float)
    for row in ledger:
        out[re.sub(r"(\.\d+)+$", "", row["phase"])] += row["flops"]
    return dict(out)


def summarize(name: str, result: Any) -> dict[str, Any]:
    evaluated = [r for r in result.rounds if "test_accuracy" in r]
    clients = result.totals["client_rounds"] or 1
    return {
        "name": name,
        "rounds": len(result.rounds),
        "accuracy": result.final["test_accuracy"],
        "ci95": result.final.get("test_accuracy_ci95", float("nan")),
        "best": max((r["test_accuracy"] for r in evaluated), default=float("nan")),
        "curve": [
            (r["round"] + 1, r["test_accuracy"], r.get("outer_loss", float("nan")))
            for r in evaluated
        ],
        "cum_flops": _cumulative(result.rounds, "cost_flops", evaluated),
        "rows": result.rounds,
        "totals": result.totals,
        "grads_per_client_round": result.totals["n_grad"] / clients,
        "hvps_per_client_round": result.totals["n_hvp"] / clients,
        "flops_by_capacity": per_capacity(result.ledger, "flops"),
        "bytes_by_capacity": per_capacity(result.ledger, "bytes_down", "bytes_up"),
        "flops_by_phase": per_phase(result.ledger),
    }


def _cumulative(rows: list[dict[str, Any]], key: str, evaluated: list[dict[str, Any]]) -> list:
    total, out, marks = 0.0, {}, {r["round"] for r in evaluated}
    for row in rows:
        total += row[key]
        if row["round"] in marks:
            out[row["round"]] = total
    return [out[r["round"]] for r in evaluated]


def frac(a: float, b: float) -> float:
    return a / b if b else float("nan")


def pct(x: float) -> str:
    return "n/a" if x != x else f"{x:.1%}"


def section_markdown(
    label: str, runs: dict[str, dict[str, Any]], target: float, auto: bool
) -> tuple[list[str], dict[str, Any]]:
    """Tables of one backbone (one seed) and the numbers the summary and the plot need."""
    ref = runs[REFERENCE]["totals"]
    full = runs[FULL_ROUND]["totals"]
    lines = [
        f"### {label}",
        "",
        f"(a) Equal rounds ({runs['RABO']['rounds']} iterations each). Fractions are of the "
        "FedMBO run and of the full-model RABO round on the same fleet, data and seed.",
        "",
        "| method | final acc. ± 95 % CI | best acc. | GFLOP | MB (down + up) | comm. rounds "
        "| grads / HVPs per client and iteration | compute vs FedMBO | bytes vs FedMBO "
        "| compute vs full-model round | bytes vs full-model round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    numbers: dict[str, Any] = {"equal_rounds": {}, "equal_accuracy": {}}
    for name, s in runs.items():
        t = s["totals"]
        cf, bf = frac(t["flops"], ref["flops"]), frac(t["bytes"], ref["bytes"])
        numbers["equal_rounds"][name] = (cf, bf)
        numbers.setdefault("counts", {})[name] = (
            s["grads_per_client_round"],
            s["hvps_per_client_round"],
        )
        numbers.setdefault("equal_rounds_full", {})[name] = (
            frac(t["flops"], full["flops"]),
            frac(t["bytes"], full["bytes"]),
        )
        lines.append(
            f"| {name} | {s['accuracy']:.3f} ± {s['ci95']:.3f} | {s['best']:.3f} "
            f"| {t['flops'] / 1e9:.1f} | {t['bytes'] / 1e6:.2f} | {t['communication_rounds']:.0f} "
            f"| {s['grads_per_client_round']:.1f} / {s['hvps_per_client_round']:.1f} "
            f"| {pct(cf)} | {pct(bf)} | {pct(frac(t['flops'], full['flops']))} "
            f"| {pct(frac(t['bytes'], full['bytes']))} |"
        )
    how = f"the final accuracy of {STATIC}" if auto else "given with --target"
    lines += [
        "",
        f"(b) Equal accuracy: cumulative costs up to the first evaluated round whose meta-test "
        f"accuracy is >= {target:.3f} ({how}).",
        "",
        "| method | round reached | GFLOP | MB | comm. rounds | compute vs FedMBO "
        "| bytes vs FedMBO |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    hits = {name: first_reach(s["rows"], target) for name, s in runs.items()}
    ref_hit = hits[REFERENCE]
    numbers["reached"] = {name: None if hit is None else hit["round"] for name, hit in hits.items()}
    for name, hit in hits.items():
        if hit is None:
            lines.append(f"| {name} | not reached (best {runs[name]['best']:.3f}) | | | | | |")
            continue
        if ref_hit is None:
            cf = bf = float("nan")
        else:
            cf, bf = frac(hit["flops"], ref_hit["flops"]), frac(hit["bytes"], ref_hit["bytes"])
        numbers["equal_accuracy"][name] = (cf, bf)
        lines.append(
            f"| {name} | {hit['round']} | {hit['flops'] / 1e9:.1f} | {hit['bytes'] / 1e6:.2f} "
            f"| {hit['communication_rounds']:.0f} | {pct(cf)} | {pct(bf)} |"
        )
    if ref_hit is None:
        lines += ["", "FedMBO never reaches the target, so (b) has no reference."]

    n = len(CAPACITIES)
    lines += [
        "",
        "(c) Per capacity: each client's compute and bytes as a fraction of one full-model "
        "client's (the reference run's total / 5), at equal rounds.",
        "",
        "| capacity r | r^2 | RABO compute vs full-model round | RAFBO compute vs full-model "
        "round | RABO compute vs FedMBO | RABO bytes vs full-model round |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    per_cap: dict[str, list[float]] = {"RABO": [], "RAFBO": []}
    for i, (r, rname) in enumerate(zip(CAPACITIES, CAPACITY_NAMES, strict=True)):
        rabo_f = frac(runs["RABO"]["flops_by_capacity"][i], full["flops"] / n)
        rafbo_f = frac(runs["RAFBO"]["flops_by_capacity"][i], full["flops"] / n)
        per_cap["RABO"].append(rabo_f)
        per_cap["RAFBO"].append(rafbo_f)
        lines.append(
            f"| {rname} | {r * r:.4f} | {pct(rabo_f)} | {pct(rafbo_f)} "
            f"| {pct(frac(runs['RABO']['flops_by_capacity'][i], ref['flops'] / n))} "
            f"| {pct(frac(runs['RABO']['bytes_by_capacity'][i], full['bytes'] / n))} |"
        )
    lines.append(
        f"| mean | {MEAN_R2:.4f} | {pct(statistics.fmean(per_cap['RABO']))} "
        f"| {pct(statistics.fmean(per_cap['RAFBO']))} | | |"
    )
    numbers["per_capacity"] = per_cap
    numbers["outer_ratio"] = frac(
        runs["RAFBO"]["flops_by_phase"].get("train.outer", 0.0),
        runs["RABO"]["flops_by_phase"].get("train.outer", 0.0),
    )

    lines += [
        "",
        "(d) Where the FLOPs go (share of each run's total, by phase).",
        "",
        "| method | GFLOP per phase (share) |",
        "|---|---|",
    ]
    for name, s in runs.items():
        total = sum(s["flops_by_phase"].values()) or 1.0
        parts = ", ".join(
            f"{phase}: {f / 1e9:.1f} ({f / total:.0%})" for phase, f in s["flops_by_phase"].items()
        )
        lines.append(f"| {name} | {parts} |")
    return lines, numbers


def refit_notes(numbers: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """What the refit adds to RABO's cost (nothing when the run has no refit)."""
    name = refit_name(args.refit_steps)
    ratios = [
        f"{num['equal_rounds'][name][0] / num['equal_rounds']['RABO'][0]:.1f}x RABO's FLOPs and "
        f"{pct(num['equal_rounds'][name][0])} of FedMBO's ({model})"
        for model, num in numbers.items()
        if name in num["equal_rounds"]
    ]
    if not ratios:
        return []
    return [
        f"- **The refit is not free.** {name} costs " + ", ".join(ratios) + ": each of its "
        f"S = {args.refit_steps} steps is one more gradient of g in y per client and iteration "
        "(the grads column), and radbo's refit (radbo.algorithms.rabo.RABO._refit) runs the "
        "submodel's forward pass again for each step (the backward pass stops at the head) "
        "although x, and so the head's input features, stay fixed during the refit. Bytes are "
        "RABO's: the refitted y stays on the client."
    ]


def explanation(numbers: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Why the measured fractions differ from mean r^2 = 0.266 and from the paper."""
    lines = ["", "## Why the fractions differ from 0.266 and from the paper", ""]
    fedmbo_vs_full, rafbo_vs_rabo, rafbo_outer, printed_vs_rabo = [], [], [], []
    first = next(iter(numbers.values()))
    (rafbo_g, rafbo_h), (rabo_g, rabo_h) = first["counts"]["RAFBO"], first["counts"]["RABO"]
    for model, num in numbers.items():
        fedmbo_vs_full.append(f"{1 / num['equal_rounds'][FULL_ROUND][0]:.2f}x ({model})")
        ratio = num["equal_rounds"]["RAFBO"][0] / num["equal_rounds"]["RABO"][0]
        rafbo_vs_rabo.append(f"{ratio:.2f}x ({model})")
        rafbo_outer.append(f"{num['outer_ratio']:.2f}x ({model})")
        ratio = num["equal_rounds"][AS_PRINTED][0] / num["equal_rounds"]["RABO"][0]
        printed_vs_rabo.append(f"{ratio:.2f}x ({model})")
        rabo_c = num["equal_rounds"]["RABO"][0]
        rabo_b = num["equal_rounds"]["RABO"][1]
        full_c = num["equal_rounds"][FULL_ROUND][0]
        full_b = num["equal_rounds"][FULL_ROUND][1]
        per_cap = num["per_capacity"]["RABO"]
        lines.append(
            f"- **{model}**: RABO's compute is {pct(rabo_c)} of FedMBO's and "
            f"{pct(frac(rabo_c, full_c))} of the full-model RABO round's (mean r^2 = "
            f"{MEAN_R2:.1%}); per capacity, against the full-model round, "
            + ", ".join(
                f"r = {n}: {pct(f)} (r^2 = {r * r:.1%})"
                for n, f, r in zip(CAPACITY_NAMES, per_cap, CAPACITIES, strict=True)
            )
            + f". Bytes: {pct(rabo_b)} of FedMBO's, {pct(frac(rabo_b, full_b))} of the "
            "full-model round's."
        )
    lines += [
        "- **Structured pruning is not exactly r^2.** A conv layer whose input and output "
        "channels are both pruned costs ~r^2, but the first conv keeps its one input channel "
        "(~r), the head keeps its outputs (~r), BatchNorm scales and shifts scale ~r, and kept "
        "channels are rounded up (ceil(C r): at r = 1/16 a ResNet-12 block of 40 channels keeps "
        "3, not 2.5). All of this pushes the small capacities above r^2. Elementwise ops, "
        "BatchNorm and pooling are not counted by the FLOP counter at all (they would scale ~r).",
        "- **The reference is FedMBO, not the same round on the full model.** FedMBO's "
        "iteration is T minibatch-gradient rounds on y plus randomized Neumann chains "
        f"(N = {args.neumann_terms} terms, N_i uniform on 0..N-1, one Hessian-vector product per "
        "link, one fresh client per link), while RABO runs T local steps plus a CG "
        "hypergradient (10 Hessian-vector products) on every client. The grads / HVPs column "
        "shows the counts. Measured, a FedMBO iteration costs "
        + ", ".join(fedmbo_vs_full)
        + " the FLOPs of a full-model RABO iteration, so the fraction against FedMBO is the r^2 "
        "saving divided by that ratio; the 'vs full-model round' column is the one to compare "
        "with 0.266.",
        "- **Communication.** FedMBO sends the full model (or a full-size vector) in each of its "
        "T + max N_i + 2 communication rounds per iteration; RABO has 2 per iteration and sends "
        "submodels. The bytes fraction against FedMBO is therefore far below r^2; against the "
        "full-model RABO round it is the parameter fraction (mean over clients of the kept "
        "parameters, plus the int32 index metadata of each submodel), close to r^2 for the same "
        "reasons as compute (first conv, head and BatchNorm scale ~r).",
        "- **RAFBO costs more FLOPs than RABO here, not fewer** ("
        + ", ".join(rafbo_vs_rabo)
        + f" RABO's FLOPs; its outer phase {', '.join(rafbo_outer)} RABO's, table (d)). The 10 "
        "Hessian-vector products of its CG are forward differences of grad_y g, each a fresh "
        "gradient evaluation with its own forward pass through the submodel, and each of the "
        f"|P| = {args.rafbo_coordinates} sampled coordinates of x costs one more ({rafbo_g:.0f} "
        f"gradients and {rafbo_h:.0f} HVPs per client and iteration, against RABO's "
        f"{rabo_g:.0f} and {rabo_h:.1f}). An autograd "
        "Hessian-vector product differentiates the graph of grad_y g built once per client "
        "and round (radbo.autodiff.InnerSystem), so it needs no new forward pass and costs at "
        "most about one "
        "gradient (README, 'Algorithms and estimators'). RAFBO saves second-order machinery "
        "and memory, not FLOPs. Even RAFBO exactly as printed (eq. 10, no CG: its indirect "
        "term contracts delta_p with grad_y f and is not a hypergradient) costs "
        + ", ".join(printed_vs_rabo)
        + " RABO's FLOPs: each sampled coordinate needs grad_y g at a perturbed x, a forward "
        "pass through the whole submodel. The paper's 17.8 % (below RABO's 26.7 %) does not "
        "say how computation was counted; with measured FLOPs it is not reproduced. Note "
        f"also that with |P| = {args.rafbo_coordinates} of the tens of thousands of "
        "coordinates of x, the indirect term touches almost none of x "
        "(examples/rafbo.toml discusses |P| and rescale).",
        *refit_notes(numbers, args),
        "- **Equal accuracy** moves the fractions by the ratio of rounds each method needs to "
        "reach the target (by default the accuracy Static ends at: what the single-level "
        "submodel baseline achieves on the same fleet). A method that never reaches it in the "
        "run's rounds has no equal-accuracy fraction, and neither has any method when FedMBO "
        "does not reach it. At this size it is noisy: few seeds, a few hundred meta-test "
        "episodes (CI about +-0.01-0.02), and accuracy curves that are not monotone (compare "
        "'best' and 'final' in table (a)). Treat (b) as indicative and use --full (more seeds, "
        "longer runs, 600 episodes) or --target for a firmer comparison.",
    ]
    return lines


def summary_markdown(
    summary: dict[str, dict[str, list[tuple[Any, ...]]]], args: argparse.Namespace
) -> list[str]:
    """Fractions of FedMBO's compute and bytes at equal rounds and at equal meta-test
    accuracy, per backbone and method (mean over seeds; at equal accuracy over the seeds in
    which both the method and FedMBO reach the target)."""
    what = (
        f"the accuracy {STATIC} ends at" if args.target is None else f"{args.target:.3f} (--target)"
    )
    lines = [
        "## Summary: fractions of FedMBO (mean over seeds)",
        "",
        f"Equal accuracy: the cumulative costs up to the first evaluated round (every "
        f"{args.eval_every}) whose meta-test accuracy reaches {what}, against FedMBO's up to its "
        "own first such round. 'not reached': the method (or FedMBO) never reaches it in the "
        "run's rounds, so there is no fraction.",
        "",
        "| backbone | method | compute, equal rounds | bytes, equal rounds | target "
        "| first round reaching it, per seed | compute, equal acc. | bytes, equal acc. |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        "| paper (Omniglot, ResNet-12) | RABO | 26.7 % | 26.7 % | | | | |",
        "| paper (Omniglot, ResNet-12) | RAFBO | 17.8 % | 26.7 % | | | | |",
        f"| analytic mean r^2 | masked methods | {MEAN_R2:.1%} | {MEAN_R2:.1%} | | | | |",
    ]

    def mean(values: list[float]) -> str:
        values = [v for v in values if v == v]
        return pct(statistics.fmean(values)) if values else "n/a"

    for label, methods in summary.items():
        for method, seeds in methods.items():
            rounds = [r for r, _, _, _, _ in seeds]
            both = [acc for _, acc, own, ref, _ in seeds if own is not None and ref is not None]
            reached = "; ".join(
                f"{'not reached' if own is None else own} "
                f"(FedMBO {'not reached' if ref is None else ref})"
                for _, _, own, ref, _ in seeds
            )
            if both:
                acc_c, acc_b = mean([c for c, _ in both]), mean([b for _, b in both])
                if len(both) < len(seeds):
                    acc_c += f" ({len(both)} of {len(seeds)} seeds)"
                    acc_b += f" ({len(both)} of {len(seeds)} seeds)"
            elif all(own is None for _, _, own, _, _ in seeds):
                acc_c = acc_b = "not reached"
            else:
                acc_c = acc_b = "n/a (FedMBO not reached)"
            targets = ", ".join(f"{t:.3f}" for _, _, _, _, t in seeds)
            lines.append(
                f"| {label} | {method} | {mean([c for c, _ in rounds])} "
                f"| {mean([b for _, b in rounds])} | {targets} | {reached} | {acc_c} | {acc_b} |"
            )
    return lines


def plot(numbers: dict[str, dict[str, Any]], curves: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    models = list(numbers)
    for ax, which, title in (
        (axes[0], "equal_rounds", "(a) equal rounds"),
        (axes[1], "equal_accuracy", "(b) equal accuracy"),
    ):
        bars = [(m, k, which) for m in ("RABO", "RAFBO") for k in ("compute", "bytes")]
        if which == "equal_rounds":  # and against the full-model RABO round (hatched)
            bars += [("RABO", k, "equal_rounds_full") for k in ("compute", "bytes")]
        width = 0.8 / len(bars)
        tallest = MEAN_R2
        for j, (method, kind, key) in enumerate(bars):
            heights = []
            for model in models:
                pair = numbers[model][key].get(method)
                heights.append(float("nan") if pair is None else pair[kind == "bytes"])
            xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(models))]
            full_round = key == "equal_rounds_full"
            tallest = max([tallest, *(h for h in heights if h == h)])
            ax.bar(
                xs,
                heights,
                width,
                color=f"C{j % 4}",
                hatch="//" if full_round else None,
                alpha=0.6 if full_round else 1.0,
                label=f"{method} {kind}" + (" vs full-model RABO round" if full_round else ""),
            )
        ax.axhline(MEAN_R2, color="k", ls="--", lw=1, label="mean r^2 = 0.266")
        ax.axhline(PAPER["RAFBO"][0], color="grey", ls=":", lw=1, label="paper RAFBO compute 0.178")
        ax.set_xticks(range(len(models)), models)
        hatched = " (hatched: of the full-model RABO round)" if which == "equal_rounds" else ""
        ax.set_ylabel("fraction of FedMBO" + hatched)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, tallest * 1.7)  # room for the legend above the bars
        ax.legend(fontsize=6, ncol=2, loc="upper left")
    ax = axes[2]
    styles = ["-", "--", ":"]
    for (model, runs), style in zip(curves.items(), styles, strict=False):
        for k, (name, s) in enumerate(runs.items()):
            ax.plot(
                [f / 1e9 for f in s["cum_flops"]],
                [a for _, a, _ in s["curve"]],
                ls=style,
                marker="o",
                ms=3,
                color=f"C{k}",
                label=f"{model}: {name}",
            )
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("cumulative GFLOP (all clients)")
    ax.set_ylabel("meta-test accuracy")
    ax.set_title("(c) accuracy against compute (first seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--full",
        action="store_true",
        help="the paper's size: Conv-4 width 64 and ResNet-12, 100 rounds, 600 episodes, 3 seeds",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["conv4", "resnet12"],
        default=None,
        help="backbones (default: conv4; --full: both)",
    )
    parser.add_argument("--width", type=int, default=None, help="Conv-4 channels (32; --full 64)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=None, help="iterations (every model)")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--episodes", type=int, default=None, help="meta-test episodes")
    parser.add_argument("--target", type=float, default=None, help="equal-accuracy target")
    parser.add_argument(
        "--refit-steps", type=int, default=100, help="S of the 'RABO, refit S' run (0: none)"
    )
    parser.add_argument("--rafbo-coordinates", type=int, default=8, help="RAFBO's |P|")
    parser.add_argument("--neumann-terms", type=int, default=10, help="FedMBO's N")
    parser.add_argument("--neumann-eta", type=float, default=0.1, help="FedMBO's 1/l")
    parser.add_argument("--batchnorm", choices=["aggregate", "static"], default=None)
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    if args.refit_steps < 0:
        parser.error(f"--refit-steps must be >= 0, got {args.refit_steps}")
    args.models = args.models or (["conv4", "resnet12"] if args.full else ["conv4"])
    args.seeds = args.seeds or ([0, 1, 2] if args.full else [0])
    # "the first round reaching the target" is defined up to this many rounds
    args.eval_every = args.eval_every or (5 if args.full else 1)
    args.episodes = args.episodes or (600 if args.full else 200)
    command = command_line(__file__, argv)
    print(command, flush=True)
    check_device(args.device)
    every = [
        cfg
        for model in args.models
        for seed in args.seeds
        for cfg in configs(args, model, seed).values()
    ]
    check_served(every)
    print(
        f"analytic expectation (cost ~ r^2 per client): mean r^2 over {CAPACITY_NAMES} = "
        f"{MEAN_R2:.4f}; mean r = {statistics.fmean(CAPACITIES):.4f}",
        flush=True,
    )

    md = [
        "# RABO / RAFBO compute and communication as fractions of FedMBO (RABO paper, Fig. 4)",
        "",
        f"5-way 5-shot few-shot learning on {data_label(args.omniglot, 28)}, "
        f"{len(CAPACITIES)} clients at "
        f"capacities {CAPACITY_NAMES} (one each), importance masks, RAFBO |P| = "
        f"{args.rafbo_coordinates}, FedMBO N = {args.neumann_terms}, 1/l = {args.neumann_eta}; "
        f"{args.episodes} meta-test episodes every {args.eval_every} rounds; seeds {args.seeds}. "
        f"Paper: RABO 26.7 % compute, RAFBO 17.8 %, both 26.7 % communication. Analytic "
        f"(cost ~ r^2): mean r^2 = {MEAN_R2:.3f}.",
        "",
        provenance(args.device),
        "",
    ]
    numbers: dict[str, dict[str, Any]] = {}
    curves: dict[str, dict[str, Any]] = {}
    summary: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for model in args.models:
        _, label = model_section(model, args.full, args.width)
        for seed in args.seeds:
            runs = {}
            for name, cfg in configs(args, model, seed).items():
                start = time.perf_counter()
                runs[name] = summarize(name, run(cfg, progress=False, save=False))
                print(
                    f"{label}, seed {seed}, {name}: acc {runs[name]['accuracy']:.3f}, "
                    f"{runs[name]['totals']['flops'] / 1e9:.1f} GFLOP, "
                    f"{runs[name]['totals']['bytes'] / 1e6:.2f} MB "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
            auto = args.target is None
            target = runs[STATIC]["accuracy"] if auto else float(args.target)
            lines, num = section_markdown(f"{label}, seed {seed}", runs, target, auto)
            md += [*lines, ""]
            for method in runs:
                if method in (REFERENCE, FULL_ROUND):
                    continue
                summary.setdefault(label, {}).setdefault(method, []).append(
                    (
                        num["equal_rounds"][method],
                        num["equal_accuracy"].get(method),
                        num["reached"][method],
                        num["reached"][REFERENCE],
                        target,
                    )
                )
            if seed == args.seeds[0]:
                numbers[label] = num
                curves[label] = runs

    md += summary_markdown(summary, args)
    md += explanation(numbers, args)
    md += ["", f"    {command}"]
    markdown = "\n".join(md)
    print(markdown)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rabo_costs.md").write_text(markdown + "\n")
    plot(numbers, curves, out / "rabo_costs.png")
    print(f"wrote {out / 'rabo_costs.md'} and {out / 'rabo_costs.png'}")


if __name__ == "__main__":
    main()
