"""FLOPs and peak memory of one local hypergradient per estimator (FlopCounterMode; the CPU
allocator's events).

Four tables, all ratios to exact implicit CG on the same (sub)model, so machine speed does not
enter:

1. **One hypergradient** on a fixed batch under ``torch.utils.flop_counter.FlopCounterMode``
   for exact implicit CG (10 iterations), truncated Neumann (10 terms), RAFBO's corrected
   finite-difference estimator (|P| = 1 and 8 coordinates, CG with 10 or 3 finite-difference
   iterations), the printed eq. (10) form, and the first-order penalty estimator (10 inner
   steps). Problems: hyper-representation (backbone = x, linear head = y) on the MLP, SmallCNN
   and a ResNet-18 submodel, and a strongly convex hyperparameter problem (x = one log
   regularization weight per input feature, y = a logistic regression), where CG runs all its
   iterations.
2. **Unit costs** behind table 1, from differences of measured runs: one gradient of ``g``
   with respect to y (``fd |P|=8`` minus ``fd |P|=1``, over 7) and one autograd
   Hessian-vector product (``cg 10`` minus ``cg 3``, over 7). The finite-difference estimator
   makes ``2 + K + |P|`` gradients against CG's 2 gradients and ``K + 1`` products, so it can
   only be cheaper when a product costs more than a gradient.
3. **Engine ledger**: the outer-phase FLOPs each client records in a 3-round run of
   ``examples/demo.toml`` (RABO, CG) with the estimator swapped, per device tier.
4. **Peak memory** of one hypergradient call on the problems of table 1
   (:func:`radbo.devices.budget.measure_peak_memory`: the CPU allocator's events, what the
   call allocates on top of the model and the batch), as a multiple of CG's: the
   finite-difference estimator keeps no graph of the gradient for double backward.

    .venv/bin/python benchmarks/hypergrad_flops.py            # about 2 minutes on 2 cores
"""

from __future__ import annotations

import tomllib
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from radbo.config import parse_config
from radbo.devices.budget import measure_peak_memory
from radbo.experiment import run
from radbo.flops import count_flops
from radbo.hypergrad import FiniteDifference, FirstOrder, ImplicitCG, Neumann
from radbo.masks import LeadingPolicy, StructurePlan
from radbo.models import MLP, ResNet18, SmallCNN
from radbo.problem import Batch, bind_losses
from radbo.tasks import HyperRepresentation

ROOT = Path(__file__).resolve().parents[1]

ESTIMATORS = [
    ("cg (10 it.)", ImplicitCG(max_iter=10, tol=0.0)),
    ("neumann (10)", Neumann(terms=10)),
    (
        "fd |P|=1, cg 10",
        FiniteDifference(scheme="forward", num_coordinates=1, cg_iters=10, tol=0.0),
    ),
    (
        "fd |P|=8, cg 10",
        FiniteDifference(scheme="forward", num_coordinates=8, cg_iters=10, tol=0.0),
    ),
    ("fd |P|=8, cg 3", FiniteDifference(scheme="forward", num_coordinates=8, cg_iters=3, tol=0.0)),
    ("fd |P|=8 as printed", FiniteDifference(num_coordinates=8, as_printed=True)),
    ("first order (10)", FirstOrder(lam=10.0, inner_steps=10)),
]
CG3 = ImplicitCG(max_iter=3, tol=0.0)

# engine-ledger variants: [estimator] sections for examples/demo.toml
LEDGER_VARIANTS = [
    ("cg (RABO)", {"name": "cg", "max_iter": 10, "tol": 0.0}),
    (
        "fd |P|=1",
        {"name": "finite_difference", "scheme": "forward", "num_coordinates": 1, "tol": 0.0},
    ),
    (
        "fd |P|=8 (RAFBO)",
        {"name": "finite_difference", "scheme": "forward", "num_coordinates": 8, "tol": 0.0},
    ),
    (
        "fd |P|=8, cg 3",
        {
            "name": "finite_difference",
            "scheme": "forward",
            "num_coordinates": 8,
            "cg_iters": 3,
            "tol": 0.0,
        },
    ),
    (
        "fd |P|=8 as printed",
        {
            "name": "finite_difference",
            "scheme": "forward",
            "num_coordinates": 8,
            "as_printed": True,
        },
    ),
]


def submodel(model, r: float):
    if r == 1.0:
        return model
    plan = StructurePlan(model, model.example_input(1), model.output_layers)
    kept = LeadingPolicy()(
        plan, dict.fromkeys(plan.groups, r), round=0, client=0, generator=torch.Generator()
    )
    return plan.submodel(plan.index_sets(kept))


def hyper_representation(model, batch: int, gen: torch.Generator):
    inputs = torch.randn(batch, *model.input_shape, generator=gen)
    b = Batch(inputs, torch.randint(0, 10, (batch,), generator=gen))
    state = model.state_dict()
    outer_names, inner_names = model.outer_param_names(), model.inner_param_names()
    x = {n: state[n] for n in outer_names}
    y = {n: state[n] for n in inner_names}
    buffers = {n: t for n, t in state.items() if n not in x and n not in y}
    model.train()
    outer, inner = bind_losses(HyperRepresentation(inner_l2=0.01), model, buffers, b, b)
    return outer, inner, x, y


def feature_regularization(batch: int, gen: torch.Generator, features: int = 64):
    """x = log of one L2 weight per input feature, y = a 10-class logistic regression.

    The inner problem is strongly convex, so CG runs all its iterations (no early stop on
    non-positive curvature, which would make the comparison unequal).
    """
    inputs, val_inputs = (torch.randn(batch, features, generator=gen) for _ in range(2))
    targets, val_targets = (torch.randint(0, 10, (batch,), generator=gen) for _ in range(2))
    x = {"log_l2": torch.full((features,), -3.0)}
    y = {"weight": torch.zeros(10, features), "bias": torch.zeros(10)}

    def inner(x, y):
        logits = F.linear(inputs, y["weight"], y["bias"])
        reg = 0.5 * (torch.exp(x["log_l2"]) * y["weight"].pow(2)).sum()
        return F.cross_entropy(logits, targets) + reg

    def outer(x, y):
        return F.cross_entropy(F.linear(val_inputs, y["weight"], y["bias"]), val_targets)

    return outer, inner, x, y


def cell(label: str) -> str:
    """A table label with its pipes escaped (``|P|`` would split a Markdown cell)."""
    return label.replace("|", "\\|")


def measure(est, outer, inner, x, y) -> tuple[int, tuple[int, int]]:
    """FLOPs of one call and its (gradient, Hessian-vector) evaluation counts."""
    results = []

    def call() -> None:
        gen = torch.Generator().manual_seed(1)
        results.append(est(outer, inner, x, y, generator=gen))

    flops = count_flops(call)
    return flops, (results[0].n_grad, results[0].n_hvp)


def cases() -> list[tuple[str, tuple]]:
    """The (label, (outer, inner, x, y)) problems of tables 1, 2 and 4."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        cases = [
            ("MLP 64-128-10, r=1", hyper_representation(MLP(64, [128], 10), 32, gen)),
            (
                "MLP 64-128-10, r=1/4",
                hyper_representation(submodel(MLP(64, [128], 10), 0.25), 32, gen),
            ),
            ("SmallCNN, r=1", hyper_representation(SmallCNN(), 32, gen)),
            (
                "ResNet-18 (1/4 width), r=1/2",
                hyper_representation(submodel(ResNet18(widths=(16, 32, 64, 128)), 0.5), 8, gen),
            ),
            ("feature L2 of logistic regression (64 x)", feature_regularization(256, gen)),
        ]
    return cases


def micro_tables() -> None:
    names = [n for n, _ in ESTIMATORS]
    print("| problem | " + " | ".join(cell(n) for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    units = []
    for label, (outer, inner, x, y) in cases():
        flops, counts = {}, {}
        for name, est in ESTIMATORS:
            flops[name], counts[name] = measure(est, outer, inner, x, y)
        base = flops[names[0]]
        cells = [
            (f"{flops[n] / 1e6:.2f} M" if n == names[0] else f"{flops[n] / base:.2f}x")
            + f" ({counts[n][0]} g, {counts[n][1]} h)"
            for n in names
        ]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
        grad = (flops["fd |P|=8, cg 10"] - flops["fd |P|=1, cg 10"]) / 7
        hvp = (flops["cg (10 it.)"] - measure(CG3, outer, inner, x, y)[0]) / 7
        units.append((label, grad, hvp))
    print()
    print("| problem | gradient of g wrt y | autograd HVP | HVP / gradient |")
    print("|---|---:|---:|---:|")
    for label, grad, hvp in units:
        print(f"| {label} | {grad / 1e6:.3f} M | {hvp / 1e6:.3f} M | {hvp / grad:.2f} |")


def memory_table() -> None:
    """Measured peak memory of one hypergradient call (allocator events; what the call
    allocates on top of the model and the batch), as a multiple of exact CG's."""
    names = [n for n, _ in ESTIMATORS]
    print()
    print("| problem | " + " | ".join(cell(n) for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, (outer, inner, x, y) in cases():
        peaks = {}
        for name, est in ESTIMATORS:

            def call(est=est, problem=(outer, inner, x, y)) -> None:
                est(*problem, generator=torch.Generator().manual_seed(1))

            call()  # warm-up: first-call allocations of the kernels
            peaks[name] = measure_peak_memory(call)
        base = peaks[names[0]]
        cells = [
            f"{peaks[n] / 1e6:.2f} MB" if n == names[0] else f"{peaks[n] / base:.2f}x"
            for n in names
        ]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def ledger_table(rounds: int = 3) -> None:
    """Outer-phase FLOPs per client hypergradient in the engine's ledger, by device tier."""
    base = tomllib.loads((ROOT / "examples" / "demo.toml").read_text())
    base.update(rounds=rounds, eval_every=rounds)
    base["baseline"] = {"enabled": False}
    rows, counts = {}, {}
    for label, estimator in LEDGER_VARIANTS:
        config = parse_config({**base, "estimator": estimator})
        result = run(config, progress=False, save=False)
        per_tier = defaultdict(list)
        outer = [e for e in result.ledger if e["phase"] == "train.outer"]
        for entry in outer:
            per_tier[entry["tier"]].append(entry["flops"])
        rows[label] = {t: sum(v) / len(v) for t, v in per_tier.items()}
        counts[label] = {(e["n_grad"], e["n_hvp"]) for e in outer}
    reference = rows[LEDGER_VARIANTS[0][0]]
    tiers = sorted(reference, key=lambda t: -reference[t])
    print()
    print("| estimator | " + " | ".join(tiers) + " | (g, h) per hypergradient |")
    print("|---|" + "---:|" * len(tiers) + "---|")
    for label, _ in LEDGER_VARIANTS:
        cells = [
            f"{reference[t] / 1e6:.2f} M"
            if rows[label] is reference
            else f"{rows[label][t] / reference[t]:.2f}x"
            for t in tiers
        ]
        seen = ", ".join(f"({g}, {h})" for g, h in sorted(counts[label]))
        print(f"| {cell(label)} | " + " | ".join(cells) + f" | {seen} |", flush=True)


def main() -> None:
    micro_tables()
    ledger_table()
    memory_table()


if __name__ == "__main__":
    main()
