"""Error against FLOPs of the finite-difference hypergradient: forward vs central differences.

The problem is the small tanh network of ``tests/hypergrad/test_hypergrad.py`` (and
``tests/hypergrad/test_fd_central.py``): y = the weights of a 4-5-1 tanh network (31 numbers), x = a
scale per input feature and a log L2 weight (5 numbers); g is the mean softplus loss on 24
training examples plus the L2 term, f the mean softplus loss on 16 validation examples. The
reference is the exact implicit hypergradient ``∇_x f − ∇²_xy g [∇²_yy g]⁻¹ ∇_y f`` from dense
float64 matrices (``torch.autograd.functional``). Every estimate uses all 5 coordinates of x and
the estimator's default CG (10 iterations, tol 1e-10); errors are ``||estimate − exact|| /
||exact||``; FLOPs are those :func:`radbo.flops.count_flops` measures for one call (the FLOP
ledger of a run measures the same way), with the ratio to the forward scheme at the same
settings.

Table 1 sweeps the coordinate step ``mu`` at the default ``hvp_mu = 1e-3`` (``default`` is the
dtype-chosen step: ``eps^(1/3)`` central, ``eps^(1/2)`` forward). Table 2 compares the schemes
at equal FLOPs: the forward scheme given the central one's gradient count (29) as 12 more CG
iterations, at the default steps and at the best ``mu`` x ``hvp_mu`` of a grid.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fd_scheme.py     # about 2 minutes on one core
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from radbo.flops import count_flops
from radbo.hypergrad import FiniteDifference
from radbo.hypergrad.finite_difference import default_step
from radbo.typing import Params

MUS = [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8]
HVP_MUS = [1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-8]
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def flat(params: Params) -> Tensor:
    return torch.cat([t.reshape(-1) for t in params.values()])


@dataclass(frozen=True)
class TanhProblem:
    """The tanh network problem in one dtype, with the float64 exact hypergradient."""

    outer: Callable[[Params, Params], Tensor]
    inner: Callable[[Params, Params], Tensor]
    x: Params
    y: Params
    exact: Tensor


def tanh_problem(dtype: torch.dtype, seed: int = 7) -> TanhProblem:
    """Built as ``tests/hypergrad/test_hypergrad.py`` builds it in
    ``test_mlp_implicit_cg_matches_dense_hessian_solution`` (same generator, same draws, in
    float64), then cast to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(torch.float64)
    y64 = {name: 0.5 * randn(*p.shape) for name, p in net.named_parameters()}
    x64 = {"feature_scale": 1.0 + 0.2 * randn(4), "log_reg": torch.tensor(-1.0).double()}
    data = {"x_train": randn(24, 4), "x_val": randn(16, 4)}
    data.update(t_train=torch.sign(randn(24)), t_val=torch.sign(randn(16)))

    def losses(d: dict[str, Tensor]) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
        def logits(x: Params, y: Params, features: Tensor) -> Tensor:
            return functional_call(net, y, (features * x["feature_scale"],)).squeeze(-1)

        def inner(x: Params, y: Params) -> Tensor:
            fit = nn.functional.softplus(-d["t_train"] * logits(x, y, d["x_train"])).mean()
            return fit + 0.5 * torch.exp(x["log_reg"]) * flat(y).pow(2).sum()

        def outer(x: Params, y: Params) -> Tensor:
            return nn.functional.softplus(-d["t_val"] * logits(x, y, d["x_val"])).mean()

        return outer, inner

    outer64, inner64 = losses(data)
    exact = exact_hypergradient(outer64, inner64, x64, y64)
    outer, inner = losses({k: t.to(dtype) for k, t in data.items()})
    return TanhProblem(
        outer=outer,
        inner=inner,
        x={k: t.to(dtype) for k, t in x64.items()},
        y={k: t.to(dtype) for k, t in y64.items()},
        exact=exact,
    )


def exact_hypergradient(
    outer: Callable[..., Tensor], inner: Callable[..., Tensor], x: Params, y: Params
) -> Tensor:
    """``∇_x f − ∇²_xy g [∇²_yy g]⁻¹ ∇_y f`` from dense matrices (float64)."""

    def unflat(vec: Tensor, like: Params) -> Params:
        out, start = {}, 0
        for name, t in like.items():
            out[name] = vec[start : start + t.numel()].reshape(t.shape)
            start += t.numel()
        return out

    xf, yf = flat(x), flat(y)
    h_yy = torch.autograd.functional.hessian(lambda b: inner(x, unflat(b, y)), yf)

    def grad_y_g(a: Tensor) -> Tensor:
        b = yf.clone().requires_grad_(True)
        (gy,) = torch.autograd.grad(inner(unflat(a, x), unflat(b, y)), b, create_graph=True)
        return gy

    h_xy = torch.autograd.functional.jacobian(grad_y_g, xf).T
    fx, fy = torch.autograd.functional.jacobian(
        lambda a, b: outer(unflat(a, x), unflat(b, y)), (xf, yf)
    )
    return fx - h_xy @ torch.linalg.solve(h_yy, fy)


def measure(problem: TanhProblem, estimator: FiniteDifference) -> tuple[float, int, int]:
    """(relative error, n_grad, FLOPs) of one call; the error is NaN where the step vanishes
    next to x in its dtype (the estimator refuses it)."""
    out = []
    try:
        flops = count_flops(
            lambda: out.append(estimator(problem.outer, problem.inner, problem.x, problem.y))
        )
    except ValueError as refused:
        if "vanishes" not in str(refused):
            raise
        return math.nan, 0, 0
    estimate = flat(out[0].grad).double()
    error = float((estimate - problem.exact).norm() / problem.exact.norm())
    return error, int(out[0].n_grad), flops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    args = parser.parse_args(argv)
    problems = {name: tanh_problem(DTYPES[name]) for name in args.dtypes}
    forward_flops = {}
    for name, problem in problems.items():
        _, _, forward_flops[name] = measure(problem, FiniteDifference(scheme="forward"))

    print("Table 1: error vs FLOPs over mu (hvp_mu = 1e-3, default CG, all 5 coordinates)\n")
    print("| dtype | scheme | mu | n_grad | FLOPs | FLOPs / forward | relative error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, problem in problems.items():
        for scheme in ("forward", "central"):
            steps: list[float | None] = [None, *MUS]
            for mu in steps:
                est = FiniteDifference(scheme=scheme, mu=mu)
                error, n_grad, flops = measure(problem, est)
                if not math.isfinite(error) and n_grad == 0:
                    print(f"| {name} | {scheme} | {mu:.0e} | | | | step vanishes in {name} |")
                    continue
                label = (
                    f"default {default_step(scheme, DTYPES[name]):.2e}"
                    if mu is None
                    else f"{mu:.0e}"
                )
                print(
                    f"| {name} | {scheme} | {label} | {n_grad} | {flops:,} "
                    f"| {flops / forward_flops[name]:.2f} | {error:.2e} |"
                )

    print(
        "\nTable 2: at equal gradient counts: the forward scheme with 22 CG iterations makes"
        " as many gradients (29) as the central one with 10; error at the default steps"
        " (mu from the dtype, hvp_mu = 1e-3) and the best error over mu x hvp_mu\n"
    )
    print(
        "| dtype | variant | n_grad | FLOPs / forward | error at defaults "
        "| best error | best mu | best hvp_mu |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, problem in problems.items():
        variants: list[tuple[str, dict[str, object]]] = [
            ("forward, cg_iters = 10", {"scheme": "forward"}),
            ("forward, cg_iters = 22", {"scheme": "forward", "cg_iters": 22, "tol": 0.0}),
            ("central, cg_iters = 10", {"scheme": "central"}),
        ]
        for label, settings in variants:
            default_error, n_grad, flops = measure(
                problem, FiniteDifference.model_validate(settings)
            )
            runs = [
                (measure(problem, FiniteDifference.model_validate({**settings, **grid}))[0], grid)
                for grid in ({"mu": mu, "hvp_mu": hvp} for mu in MUS for hvp in HVP_MUS)
            ]
            error, best = min((r for r in runs if math.isfinite(r[0])), key=lambda r: r[0])
            print(
                f"| {name} | {label} | {n_grad} | {flops / forward_flops[name]:.2f} "
                f"| {default_error:.2e} | {error:.2e} | {best['mu']:.0e} | {best['hvp_mu']:.0e} |"
            )
    print(
        f"\nOMP_NUM_THREADS=1 .venv/bin/python benchmarks/fd_scheme.py  (torch {torch.__version__})"
    )


if __name__ == "__main__":
    main()
