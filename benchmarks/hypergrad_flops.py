"""FLOPs of one local hypergradient per estimator, measured with FlopCounterMode.

For each model of the hyper-representation task (backbone = x, linear head = y) and for a
hyperparameter problem (x = one log weight decay per tensor, y = all weights of an MLP), one
hypergradient on a fixed batch is run under ``torch.utils.flop_counter.FlopCounterMode`` for:
exact implicit CG (10 iterations), truncated Neumann (10 terms), RAFBO's corrected finite
difference estimator (|P| = 8 coordinates, CG with 10 or 3 finite-difference iterations), the
printed eq. (10) form, and the first-order penalty estimator (10 inner steps). Ratios are to CG
on the same (sub)model, so machine speed does not enter; each cell also gives the estimator's
gradient (g) and Hessian-vector (h) evaluation counts.

    .venv/bin/python benchmarks/hypergrad_flops.py            # about a minute on 2 cores
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from radbo.flops import count_flops
from radbo.hypergrad import FiniteDifference, FirstOrder, ImplicitCG, Neumann
from radbo.masks import LeadingPolicy, StructurePlan
from radbo.models import MLP, ResNet18, SmallCNN
from radbo.problem import Batch, bind_losses
from radbo.tasks import HyperRepresentation

ESTIMATORS = [
    ("cg (10 it.)", ImplicitCG(max_iter=10, tol=0.0)),
    ("neumann (10)", Neumann(terms=10)),
    ("fd |P|=8, cg 10", FiniteDifference(num_coordinates=8, cg_iters=10, tol=0.0)),
    ("fd |P|=8, cg 3", FiniteDifference(num_coordinates=8, cg_iters=3, tol=0.0)),
    ("fd |P|=8 as printed", FiniteDifference(num_coordinates=8, as_printed=True)),
    ("first order (10)", FirstOrder(lam=10.0, inner_steps=10)),
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
    outer, inner = bind_losses(HyperRepresentation(0.01), model, buffers, b, b)
    return outer, inner, x, y


def weight_decay_problem(batch: int, gen: torch.Generator):
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    inputs = torch.randn(batch, 64, generator=gen)
    targets = torch.randint(0, 10, (batch,), generator=gen)
    y = {k: v.detach() for k, v in net.named_parameters()}
    x = {"log_weight_decay": torch.zeros(len(y))}

    def inner(x, y):
        reg = sum(
            torch.exp(x["log_weight_decay"][i]) * (t * t).sum() for i, t in enumerate(y.values())
        )
        return F.cross_entropy(functional_call(net, y, (inputs,)), targets) + 1e-3 * reg

    def outer(x, y):
        return F.cross_entropy(functional_call(net, y, (inputs,)), targets)

    return outer, inner, x, y


def measure(est, outer, inner, x, y) -> tuple[int, tuple[int, int]]:
    """FLOPs of one call and its (gradient, Hessian-vector) evaluation counts."""
    results = []

    def call() -> None:
        gen = torch.Generator().manual_seed(1)
        results.append(est(outer, inner, x, y, generator=gen))

    flops = count_flops(call)
    return flops, (results[0].n_grad, results[0].n_hvp)


def main() -> None:
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
            ("weight decay of MLP 64-256-10", weight_decay_problem(32, gen)),
        ]
    names = [n for n, _ in ESTIMATORS]
    print("| problem | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, (outer, inner, x, y) in cases:
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


if __name__ == "__main__":
    main()
