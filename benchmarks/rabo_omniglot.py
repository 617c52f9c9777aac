"""Why RABO's exact hypergradient did not teach the backbone on Omniglot (issue 26), measured.

Two parts, both on the RABO paper's few-shot fleet (5-way 5-shot, Conv-4 with static
BatchNorm, five clients at capacities 1, 1/2, 1/4, 1/8, 1/16 with importance masks, the
meta-training characters split by class):

``hypergrad``: the local hypergradient one client computes on one episode, in float64,
against independent references: the dense solve of the episode's head Hessian ``∇²_yy g``
(exact eq. (7)), and a 30-episode "local" hypergradient (the client's mean ``∇_x f``, mean
mixed product, and the inverse of its mean Hessian applied to its mean ``∇_y f``). Reports the
Hessian's spectrum, the sizes of the direct term ``∇_x f`` and the implicit term ``∇²_xy g ·
v``, CG's error against the dense solve, and the cosine of each estimate (exact, CG, damped
CG, Neumann, direct term alone) with the 30-episode reference; clients 0, 1 and 4 (r = 1, 1/2,
1/16), at the initial state.

``variants``: short runs of RABO variants and the Static baseline on the same fleet: meta-test
accuracy every ``rounds / 5`` rounds, the outer loss at the first and the last round, and the
run's FLOPs.

``guard``: RABO without hypergradient clipping under the default divergence guard, round by
round: its losses and each rollback.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rabo_omniglot.py hypergrad --omniglot DIR
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rabo_omniglot.py variants --omniglot DIR
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rabo_omniglot.py guard --omniglot DIR

(``DIR``: Omniglot in the layout ``[data] name = "omniglot"`` reads, e.g. the two minimal
background splits.) Width 32 and 30 rounds by default (``--width``, ``--rounds``); 100 fixed
meta-test episodes.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from radbo.config import parse_config
from radbo.experiment import build, run
from radbo.hypergrad import ImplicitCG, Neumann
from radbo.masks.index import extract
from radbo.problem import Batch

CAPACITIES = [1.0, 0.5, 0.25, 0.125, 0.0625]
BILEVEL = {"inner_lr": 0.5, "outer_lr": 0.1, "inner_steps": 5, "max_hypergrad_norm": 1.0}
#: name -> overrides of the RABO config (or of the fedavg config for "Static")
VARIANTS: dict[str, dict[str, Any]] = {
    "RABO (Alg. 1: CG, clip 1)": {},
    "x fixed (outer_lr 1e-5): the untrained backbone": {"algorithm": {"outer_lr": 1e-5}},
    "Neumann (5 terms, eta 0.5)": {"estimator": {"name": "neumann", "terms": 5, "eta": 0.5}},
    "CG, damping 1": {"estimator": {"name": "cg", "damping": 1.0}},
    "CG, 2 iterations": {"estimator": {"name": "cg", "max_iter": 2}},
    "inner_l2 = 1": {"task": {"inner_l2": 1.0}},
    "inner_steps = 20": {"algorithm": {"inner_steps": 20}},
    "clip 0.1": {"algorithm": {"max_hypergrad_norm": 0.1}},
    "no clip, outer_lr 0.01": {"algorithm": {"max_hypergrad_norm": None, "outer_lr": 0.01}},
    "direct term only (Neumann 1 term, eta 1e-6)": {
        "estimator": {"name": "neumann", "terms": 1, "eta": 1e-6}
    },
    "no masks (every client r = 1)": {
        "mask": {"policy": "none"},
        "fleet": {"capacities": [1.0] * 5},
    },
    "no masks, Neumann (5, 0.5)": {
        "mask": {"policy": "none"},
        "fleet": {"capacities": [1.0] * 5},
        "estimator": {"name": "neumann", "terms": 5, "eta": 0.5},
    },
    "refit_steps = 20": {"algorithm": {"refit_steps": 20}},
    "refit_steps = 100": {"algorithm": {"refit_steps": 100}},
    "refit_steps = 100, outer_lr 0.3": {"algorithm": {"refit_steps": 100, "outer_lr": 0.3}},
    "refit_steps = 100, head = episode": {
        "algorithm": {"refit_steps": 100},
        "task": {"head": "episode"},
    },
    "Static (HeteroFL: FedAvg, leading masks)": {
        "algorithm": {"name": "fedavg", "lr": 0.1, "local_steps": 5},
        "mask": {"policy": "leading"},
    },
}


def config(args: argparse.Namespace, over: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {
        "seed": args.seed,
        "rounds": args.rounds,
        "eval_every": max(1, args.rounds // 5),
        "data": {"name": "omniglot", "root": args.omniglot, "image_size": 28},
        "partition": {"kind": "classes"},
        "model": {"name": "conv4", "width": args.width, "batchnorm": "static"},
        "task": {"name": "few_shot", "ways": 5, "shots": 5, "queries": 15, "test_episodes": 100},
        "fleet": {"num_clients": len(CAPACITIES), "capacities": CAPACITIES},
        "mask": {"policy": "importance"},
        "algorithm": {"name": "rabo", **BILEVEL},
        "runtime": {"backend": "sequential"},  # as BENCHMARKS.md's figures were measured
    }
    for key, value in over.items():
        if key == "algorithm" and value.get("name", "rabo") != "rabo":
            base[key] = value
        else:
            base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def variants(args: argparse.Namespace) -> None:
    chosen = args.only or list(VARIANTS)
    extra = json.loads(args.extra) if args.extra else {}
    for name in chosen:
        start = time.perf_counter()
        over = {k: {**v, **extra.get(k, {})} for k, v in VARIANTS[name].items()}
        over.update({k: v for k, v in extra.items() if k not in over})
        result = run(parse_config(config(args, over)), progress=False, save=False)
        if extra:
            name = f"{name} + {args.extra}"
        path = ", ".join(
            f"r{r['round'] + 1} {r['test_accuracy']:.3f}"
            for r in result.rounds
            if "test_accuracy" in r
        )
        losses = [r.get("outer_loss") for r in result.rounds]
        loss = f"{losses[0]:.2f} -> {losses[-1]:.2f}" if losses[0] is not None else "-"
        took = time.perf_counter() - start
        gflop = result.totals["flops"] / 1e9
        print(f"| {name} | {path} | {loss} | {gflop:.1f} | {took:.0f} s |", flush=True)


def guard(args: argparse.Namespace) -> None:
    """RABO without clipping under the default divergence guard: each round's losses, its
    norm check and what the guard did (see the module docstring)."""
    cfg = config(args, {"algorithm": {"max_hypergrad_norm": None}})
    exp = build(parse_config(cfg))
    sim = exp.simulation
    print("| round | inner loss | outer loss | guard |")
    print("|---:|---:|---:|---|")
    try:
        for _, record in sim.iterate(exp.initial_state, args.rounds):
            row = record.as_dict()
            event = row.get("divergence")
            what = "" if event is None else f"{event['reason']}; step sizes x {event['lr_scale']:g}"
            print(
                f"| {row['round']} | {row['inner_loss']:.3g} | {row['outer_loss']:.3g} | {what} |",
                flush=True,
            )
    except Exception as err:  # the guard gives up after its rollbacks: that is the finding
        print(f"stopped: {err}")


def _flat(tensors: Any) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def hypergrad(args: argparse.Namespace) -> None:
    """See the module docstring."""
    episodes_ref = 30
    exp = build(parse_config(config(args, {})))
    sim, task, train = exp.simulation, exp.config.task, exp.train
    alg = sim.algorithm
    features, labels = train.features.double(), train.labels
    sampler = task.sampler(train, exp.clients)  # type: ignore[union-attr]
    clients = list(range(len(CAPACITIES)))
    index_sets = sim.round_index_sets(exp.initial_state, 0, clients, sim.round_budgets(0, clients))
    full = alg.model_state(exp.initial_state)

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(a @ b / (a.norm() * b.norm()))

    print(
        "| client (r) | dim x, dim y | eig of one episode's H | share < 0.02 | reference: "
        "direct, implicit | per episode: direct, implicit | CG vs dense | cosine with the "
        "reference: exact, CG, damped 1, damped 0.1, Neumann, direct only, mean-H |"
    )
    print("|---|---|---|---:|---|---|---:|---|")

    def report(ci: int) -> None:
        sub = {k: v.double() for k, v in extract(full, index_sets[ci]).items()}
        module = copy.deepcopy(sim.runtime.module_for(index_sets[ci])).double().train()
        x = {n: sub[n] for n in alg.outer_names}
        y = {n: sub[n] for n in alg.inner_names}
        buffers = {n: sub[n] for n in alg.buffer_names}
        gen = torch.Generator().manual_seed(100 + ci)
        draws = [sampler.pair(exp.clients[ci], 0, 0, gen) for _ in range(episodes_ref)]
        names = list(y)
        sizes = [y[n].numel() for n in names]

        def losses(e: int) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
            s, q = draws[e]

            def g(xx: Any, yy: Any) -> torch.Tensor:
                return task.inner_loss(module, xx, yy, buffers, Batch(features[s], labels[s]))

            def f(xx: Any, yy: Any) -> torch.Tensor:
                return task.outer_loss(module, xx, yy, buffers, Batch(features[q], labels[q]))

            return f, g

        def unflat(v: torch.Tensor) -> dict[str, torch.Tensor]:
            return {n: t.reshape(y[n].shape) for n, t in zip(names, v.split(sizes), strict=True)}

        def parts(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            f, g = losses(e)
            h = torch.autograd.functional.hessian(lambda v: g(x, unflat(v)), _flat(y.values()))
            xv = {k: t.clone().requires_grad_(True) for k, t in x.items()}
            yv = {k: t.clone().requires_grad_(True) for k, t in y.items()}
            grads = torch.autograd.grad(f(xv, yv), [*xv.values(), *yv.values()])
            return h, _flat(grads[: len(xv)]), _flat(grads[len(xv) :])

        def mixed(e: int, v: torch.Tensor) -> torch.Tensor:
            _, g = losses(e)
            xv = {k: t.clone().requires_grad_(True) for k, t in x.items()}
            yv = {k: t.clone().requires_grad_(True) for k, t in y.items()}
            gy = torch.autograd.grad(g(xv, yv), list(yv.values()), create_graph=True)
            dot = sum((a.reshape(-1) * b).sum() for a, b in zip(gy, v.split(sizes), strict=True))
            return _flat(torch.autograd.grad(dot, list(xv.values())))

        measured = [parts(e) for e in range(episodes_ref)]
        h_mean = sum(p[0] for p in measured) / episodes_ref
        fx_mean = sum(p[1] for p in measured) / episodes_ref
        fy_mean = sum(p[2] for p in measured) / episodes_ref
        v_mean = torch.linalg.solve(h_mean, fy_mean)
        reference = fx_mean - sum(mixed(e, v_mean) for e in range(episodes_ref)) / episodes_ref
        eig = torch.linalg.eigvalsh(measured[0][0])
        stats: dict[str, list[float]] = {}
        for e in range(6):
            h, fx, fy = measured[e]
            f, g = losses(e)
            implicit = mixed(e, torch.linalg.solve(h, fy))
            exact = fx - implicit

            def estimate(est: Any, f: Any = f, g: Any = g) -> torch.Tensor:
                return _flat(est(f, g, x, y).grad[n] for n in x)

            cg = estimate(ImplicitCG())
            rows = {
                "direct": float(fx.norm()),
                "implicit": float(implicit.norm()),
                "cg_error": float((cg - exact).norm() / exact.norm()),
                "exact": cos(exact, reference),
                "cg": cos(cg, reference),
                "damped1": cos(estimate(ImplicitCG(damping=1.0, max_iter=50)), reference),
                "damped01": cos(estimate(ImplicitCG(damping=0.1, max_iter=50)), reference),
                "neumann": cos(estimate(Neumann(terms=5, eta=0.5)), reference),
                "direct_only": cos(fx, reference),
                "mean_h": cos(fx - mixed(e, torch.linalg.solve(h_mean, fy)), reference),
            }
            for k, val in rows.items():
                stats.setdefault(k, []).append(val)
        m = {k: sum(v) / len(v) for k, v in stats.items()}
        print(
            f"| {ci} ({CAPACITIES[ci]:g}) | {fx_mean.numel()}, {_flat(y.values()).numel()} | "
            f"[{eig[0]:.3g}, {eig[-1]:.3g}] | {float((eig < 0.02).double().mean()):.2f} | "
            f"{fx_mean.norm():.3g}, {(reference - fx_mean).norm():.3g} | "
            f"{m['direct']:.3g}, {m['implicit']:.3g} | {m['cg_error']:.2g} | "
            f"{m['exact']:+.2f}, {m['cg']:+.2f}, {m['damped1']:+.2f}, {m['damped01']:+.2f}, "
            f"{m['neumann']:+.2f}, {m['direct_only']:+.2f}, {m['mean_h']:+.2f} |",
            flush=True,
        )

    for ci in (0, 1, 4):
        report(ci)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["hypergrad", "variants", "guard"])
    parser.add_argument("--omniglot", required=True, help="Omniglot folder")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", default=None, help="variants to run (names)")
    parser.add_argument(
        "--extra", default=None, help='JSON merged into every variant, e.g. {"algorithm": {...}}'
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = shlex.join(sys.argv[1:] if argv is None else argv)
    print(f"OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rabo_omniglot.py {command}")
    {"hypergrad": hypergrad, "variants": variants, "guard": guard}[args.part](args)


if __name__ == "__main__":
    main()
