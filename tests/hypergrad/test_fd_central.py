"""Central differences and dtype-chosen steps for the finite-difference hypergradient
(issue 15, item 6: ``[estimator] scheme``, ``mu`` default).

Reference problems:

* ``QuadraticInX`` (float64): ``∇_y g = A y − B x − ½ C (x ⊙ x) + c`` is affine in y and
  quadratic in x, so the exact hypergradient is closed form, a central difference in x is
  exact up to rounding, and a forward one is off by exactly ``(h/2) Cᵀ A⁻¹ ∇_y f`` (h the step
  taken); the Hessian-vector products in y are exact in both schemes.
* the tanh network of ``tests/hypergrad/test_hypergrad.py`` (``test_mlp_implicit_cg_...``, same draws),
  against its exact hypergradient from dense float64 matrices: the issue's acceptance bound,
  relative error <= 1e-4 at the default step, for at most 2x the forward scheme's FLOPs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from radbo.config import parse_config
from radbo.experiment import run
from radbo.flops import count_flops
from radbo.hypergrad import FiniteDifference
from radbo.hypergrad.finite_difference import default_step
from radbo.typing import Params
from tests.configs import small_config
from tests.helpers import DTYPE, Quadratic, flat, rel_err
from tests.tolerances import unit_roundoff

# every test here compares estimates against bounds; the float32 ones round with the kernels
pytestmark = pytest.mark.float_sensitive


# ================================================================ a problem quadratic in x


# Not tests.helpers.Quadratic (whose ∇_y g is affine in x, so forward differences are exact
# there too): telling the schemes apart takes a ∇_y g quadratic in x.
@dataclass(frozen=True)
class QuadraticInX:
    """``g = ½ yᵀAy − yᵀBx − ½ yᵀC(x ⊙ x) + cᵀy``, ``f = ½ ||y − d||² + eᵀx``; x is
    ``{"a": (3,), "b": (2,)}``, y is ``{"w": (6,)}``. Losses accept a leading client dim."""

    A: Tensor
    B: Tensor
    C: Tensor
    c: Tensor
    d: Tensor
    e: Tensor

    @staticmethod
    def random(seed: int = 0) -> QuadraticInX:
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=gen, dtype=DTYPE)

        basis, _ = torch.linalg.qr(randn(6, 6))
        a = basis @ torch.diag(torch.linspace(0.5, 5.0, 6, dtype=DTYPE)) @ basis.T
        return QuadraticInX(
            A=(a + a.T) / 2, B=randn(6, 5), C=randn(6, 5), c=randn(6), d=randn(6), e=randn(5)
        )

    def inner(self, x: Params, y: Params) -> Tensor:
        xf, yf = flat(x, x["a"].ndim - 1), y["w"]
        quad = torch.einsum("...i,ij,...j->...", yf, self.A, yf)
        lin = yf * (xf @ self.B.T + 0.5 * (xf * xf) @ self.C.T - self.c)
        return 0.5 * quad - lin.sum(-1)

    def outer(self, x: Params, y: Params) -> Tensor:
        xf = flat(x, x["a"].ndim - 1)
        return 0.5 * (y["w"] - self.d).pow(2).sum(-1) + (xf * self.e).sum(-1)

    def exact(self, xf: Tensor, yf: Tensor) -> Tensor:
        """``∇_x f − ∇²_xy g A⁻¹ ∇_y f = e + (B + C diag x)ᵀ A⁻¹ (y − d)``."""
        return self.e + (self.B + self.C * xf).T @ torch.linalg.solve(self.A, yf - self.d)

    def forward_bias(self, xf: Tensor, yf: Tensor, step: Tensor) -> Tensor:
        """What the forward difference with steps ``step`` adds to the exact value."""
        return 0.5 * step * (self.C.T @ torch.linalg.solve(self.A, yf - self.d))

    def point(self, seed: int = 1) -> tuple[Params, Params]:
        gen = torch.Generator().manual_seed(seed)
        xf = torch.randn(5, generator=gen, dtype=DTYPE)
        yf = torch.randn(6, generator=gen, dtype=DTYPE)
        return {"a": xf[:3], "b": xf[3:]}, {"w": yf}


@pytest.fixture(scope="module")
def qx() -> QuadraticInX:
    return QuadraticInX.random(0)


def test_central_is_exact_where_forward_is_off_by_its_first_order_term(qx: QuadraticInX) -> None:
    x, y = qx.point()
    xf, yf = flat(x), flat(y)
    exact = qx.exact(xf, yf)
    mu = 1e-3
    settings = {"mu": mu, "cg_iters": 12, "tol": 1e-26}

    central = FiniteDifference(scheme="central", **settings)(qx.outer, qx.inner, x, y)
    forward = FiniteDifference(scheme="forward", **settings)(qx.outer, qx.inner, x, y)

    central_error = rel_err(central.grad, exact)
    forward_error = rel_err(forward.grad, exact)
    print(
        f"\nrelative error at mu = 1e-3: central {central_error:.2e}, forward {forward_error:.2e}"
    )
    # rounding only, mostly that of CG's y-differences at hvp_mu = 1e-3 (measured 5e-13)
    assert central_error <= 1e-10
    # forward: exactly the O(mu) term (h/2) Cᵀ A⁻¹ ∇_y f, h the step taken in float64
    bias = qx.forward_bias(xf, yf, (xf + mu) - xf)
    torch.testing.assert_close(flat(forward.grad) - exact, bias, rtol=1e-7, atol=0.0)
    assert forward_error >= 1e-5


def test_central_stays_exact_at_any_step_forward_error_is_linear_in_it(qx: QuadraticInX) -> None:
    x, y = qx.point()
    xf, yf = flat(x), flat(y)
    exact = qx.exact(xf, yf)
    for mu in (1e-1, 1e-2):
        settings = {"mu": mu, "cg_iters": 12, "tol": 1e-26}
        central = FiniteDifference(scheme="central", **settings)(qx.outer, qx.inner, x, y)
        forward = FiniteDifference(scheme="forward", **settings)(qx.outer, qx.inner, x, y)
        assert rel_err(central.grad, exact) <= 1e-10
        bias = qx.forward_bias(xf, yf, (xf + mu) - xf)
        torch.testing.assert_close(flat(forward.grad) - exact, bias, rtol=1e-7, atol=0.0)


def test_a_cohort_matches_its_clients_one_by_one(qx: QuadraticInX) -> None:
    points = [qx.point(seed) for seed in (1, 2)]
    x = {k: torch.stack([p[0][k] for p in points]) for k in ("a", "b")}
    y = {"w": torch.stack([p[1]["w"] for p in points])}
    # CG runs exactly dim y = 6 iterations (tol 0; A's eigenvalues are distinct, so no earlier
    # iteration finds the residual gone): a stopping test at the rounding floor (tol 1e-26 is a
    # relative residual of 1e-13, and the y-differences round at eps / hvp_mu = 2e-13) would
    # stop the cohort and the lone client after different counts on some kernels (it did: 21
    # against 19 gradients with the portable kernels)
    estimator = FiniteDifference(num_coordinates=3, cg_iters=6, tol=0.0)
    draws = [estimator.draw(torch.Generator().manual_seed(s), points[0][0]) for s in (5, 6)]
    coordinates = torch.stack([d["coordinates"] for d in draws])

    cohort = estimator(qx.outer, qx.inner, x, y, draws={"coordinates": coordinates}, lead=1)

    for i, ((xi, yi), d) in enumerate(zip(points, draws, strict=True)):
        alone = estimator(qx.outer, qx.inner, xi, yi, draws=d)
        got = flat({k: cohort.grad[k][i] for k in ("a", "b")})
        # the same up to rounding (a stacked einsum rounds differently; CG carries it along:
        # measured 2e-11 relative); exact on the coordinates of P, ∇_x f elsewhere
        torch.testing.assert_close(got, flat(alone.grad), rtol=1e-9, atol=0.0)
        inside = d["coordinates"]
        exact = qx.exact(flat(xi), flat(yi))
        assert float((got[inside] - exact[inside]).abs().max()) <= 1e-10 * float(exact.norm())
        assert int(cohort.n_grad[i]) == alone.n_grad  # type: ignore[index]


# ================================================================ gradient counts and FLOPs


def test_counts_follow_the_scheme() -> None:
    problem = Quadratic.random(0)
    x, y = problem.point()

    def n_grad(**settings: object) -> int:
        estimator = FiniteDifference.model_validate({"num_coordinates": 3, **settings})
        result = estimator(
            problem.outer, problem.inner, x, y, generator=torch.Generator().manual_seed(0)
        )
        assert result.n_hvp == 0
        return int(result.n_grad)

    # f once; central: two gradients of g per CG iteration and per coordinate, none at (x, y)
    assert n_grad(cg_iters=4, tol=0.0) == 1 + 2 * 4 + 2 * 3
    assert n_grad(cg_iters=4, tol=0.0, scheme="forward") == 2 + 4 + 3
    assert n_grad(as_printed=True, scheme="central") == 1 + 2 * 3
    assert n_grad(as_printed=True) == 2 + 3  # eq. (10) as printed: forward by default


def test_central_flops_are_what_its_gradients_cost() -> None:
    """Exact FLOPs on a logistic regression (as in tests/flops/test_flops.py): one gradient of f or
    g with respect to y is ``4·B·d·C`` (forward and weight-gradient products; x enters only
    through the elementwise regulariser). Central FD(K, |P|) = (1 + 2K + 2|P|) gradients,
    forward (2 + K + |P|): the FLOP counter sees each gradient the scheme computes."""
    batch, d, classes, iters = 16, 6, 3, 5
    gen = torch.Generator().manual_seed(0)
    inputs, val_inputs = (torch.randn(batch, d, generator=gen, dtype=DTYPE) for _ in "ab")
    targets, val_targets = (torch.randint(0, classes, (batch,), generator=gen) for _ in "ab")
    x = {"log_l2": torch.zeros(d, dtype=DTYPE)}
    y = {
        "weight": 0.1 * torch.randn(classes, d, generator=gen, dtype=DTYPE),
        "bias": torch.zeros(classes, dtype=DTYPE),
    }

    def inner(x: Params, y: Params) -> Tensor:
        reg = 0.5 * (torch.exp(x["log_l2"]) * y["weight"].pow(2)).sum()
        return F.cross_entropy(F.linear(inputs, y["weight"], y["bias"]), targets) + reg

    def outer(x: Params, y: Params) -> Tensor:
        return F.cross_entropy(F.linear(val_inputs, y["weight"], y["bias"]), val_targets)

    unit = 4 * batch * d * classes
    for size in (1, 4):
        for scheme, grads in (("central", 1 + 2 * iters + 2 * size), ("forward", 2 + iters + size)):
            estimator = FiniteDifference(
                num_coordinates=size, cg_iters=iters, tol=0.0, scheme=scheme
            )
            results: list = []
            flops = count_flops(
                lambda e=estimator, out=results: out.append(
                    e(outer, inner, x, y, generator=torch.Generator().manual_seed(1))
                )
            )
            assert flops == grads * unit, (scheme, size)
            assert results[0].n_grad == grads


def test_the_run_ledger_charges_the_central_scheme_its_measured_flops() -> None:
    """The engine's FLOP meter measures the client's real work: one RAFBO round with |P| = 4
    costs more in the outer phase with central differences than with forward ones, by less
    than 2x, and the ledger's gradient counts are the scheme's."""

    def outer_entries(scheme: str) -> list[dict]:
        cfg = small_config(
            algorithm={"name": "rafbo"},
            estimator={"name": "finite_difference", "num_coordinates": 4, "scheme": scheme},
            fleet={"num_clients": 2, "capacities": [1.0, 0.5], "devices": None},
            rounds=1,
            baseline={"enabled": False},
        )
        result = run(cfg, progress=False, save=False)
        return [e for e in result.ledger if e["phase"] == "train.outer"]

    forward, central = outer_entries("forward"), outer_entries("central")

    assert [e["client"] for e in forward] == [e["client"] for e in central]
    for f, c in zip(forward, central, strict=True):
        assert f["flops"] < c["flops"] <= 2 * f["flops"]
        forward_cg = f["n_grad"] - 2 - 4
        assert 1 <= forward_cg <= 10 and c["n_grad"] % 2 == 1
        assert 1 + 2 * 1 + 2 * 4 <= c["n_grad"] <= 1 + 2 * 10 + 2 * 4


# ================================================================ the tanh network


@dataclass(frozen=True)
class TanhProblem:
    """The tanh network's losses in ``dtype`` with the float64 quantities that bound its
    finite-difference errors at (x, y): ``exact`` (the hypergradient), ``w = −H⁻¹ ∇_y f``,
    and the norms ``‖∇_y g‖`` and ``‖(∇²_yx g)ᵀ H⁻¹‖₂`` (``H = ∇²_yy g``)."""

    outer: Callable[[Params, Params], Tensor]
    inner: Callable[[Params, Params], Tensor]
    x: Params
    y: Params
    exact: Tensor
    w_norm: float
    grad_y_norm: float
    solve_norm: float


# Roundings on the longest path of one float32 evaluation of ∇_y g for this network: the
# Linear(4, 5) and Linear(5, 1) dot products with their biases (5 + 6), the 24-term batch sum
# of the weight gradient, and the elementwise chain (scale, tanh, softplus, its derivative
# sigmoid, tanh's derivative, the mean's division, the regulariser's exp, product and sum;
# SLEEF's transcendentals are within 1 ulp): 11 + 24 + 9 = 44.
GRAD_ROUNDINGS = 44


def tanh_problem(dtype: torch.dtype) -> TanhProblem:
    """tests/hypergrad/test_hypergrad.py's tanh network (same generator, same draws, in float64), cast
    to ``dtype``; ``exact`` from dense float64 Hessians."""
    gen = torch.Generator().manual_seed(7)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(DTYPE)
    y64 = {name: 0.5 * randn(*p.shape) for name, p in net.named_parameters()}
    x64 = {"feature_scale": 1.0 + 0.2 * randn(4), "log_reg": torch.tensor(-1.0, dtype=DTYPE)}
    data = {"x_train": randn(24, 4), "x_val": randn(16, 4)}
    data.update(t_train=torch.sign(randn(24)), t_val=torch.sign(randn(16)))

    def losses(d: dict[str, Tensor]) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
        def logits(x: Params, y: Params, features: Tensor) -> Tensor:
            return functional_call(net, y, (features * x["feature_scale"],)).squeeze(-1)

        def inner(x: Params, y: Params) -> Tensor:
            fit = F.softplus(-d["t_train"] * logits(x, y, d["x_train"])).mean()
            return fit + 0.5 * torch.exp(x["log_reg"]) * flat(y).pow(2).sum()

        def outer(x: Params, y: Params) -> Tensor:
            return F.softplus(-d["t_val"] * logits(x, y, d["x_val"])).mean()

        return outer, inner

    outer64, inner64 = losses(data)
    y_like = {k: t.shape for k, t in y64.items()}

    def unflat_y(v: Tensor) -> Params:
        out, start = {}, 0
        for k, shape in y_like.items():
            n = shape.numel()
            out[k] = v[start : start + n].reshape(shape)
            start += n
        return out

    xf, yf = flat(x64), flat(y64)
    h_yy = torch.autograd.functional.hessian(lambda b: inner64(x64, unflat_y(b)), yf)

    def grad_y_g(a: Tensor) -> Tensor:
        b = yf.clone().requires_grad_(True)
        xa = {"feature_scale": a[:4], "log_reg": a[4]}
        (gy,) = torch.autograd.grad(inner64(xa, unflat_y(b)), b, create_graph=True)
        return gy

    h_xy = torch.autograd.functional.jacobian(grad_y_g, xf).T
    fx, fy = torch.autograd.functional.jacobian(
        lambda a, b: outer64({"feature_scale": a[:4], "log_reg": a[4]}, unflat_y(b)), (xf, yf)
    )
    w = -torch.linalg.solve(h_yy, fy)
    outer, inner = losses({k: t.to(dtype) for k, t in data.items()})
    return TanhProblem(
        outer,
        inner,
        {k: t.to(dtype) for k, t in x64.items()},
        {k: t.to(dtype) for k, t in y64.items()},
        exact=fx + h_xy @ w,
        w_norm=float(w.norm()),
        grad_y_norm=float(grad_y_g(xf).detach().norm()),
        solve_norm=float(torch.linalg.matrix_norm(torch.linalg.solve(h_yy, h_xy.T).T, ord=2)),
    )


def tanh_error(problem: TanhProblem, estimator: FiniteDifference) -> float:
    result = estimator(problem.outer, problem.inner, problem.x, problem.y)
    return float((flat(result.grad).double() - problem.exact).norm() / problem.exact.norm())


def float32_rounding_bound(problem: TanhProblem, mu: float, hvp_mu: float) -> float:
    """First-order bound on what float32 rounding adds to the central-difference estimate's
    relative error, from float32's unit roundoff and the operation count.

    * One float32 evaluation of ``∇_y g`` carries a relative error ``ρ = √n · u``
      (``u = eps / 2``; the ``n = GRAD_ROUNDINGS`` roundings on its longest path taken as
      independent, so that they add in root-sum-square; the worst case ``n · u`` would make
      the bound 6.6x looser still). Measured: 1.1 u with default, AVX2 and AVX-512 kernels.
    * A central quotient ``(F(+h) − F(−h)) / 2h`` of two such evaluations errs by at most
      ``√2 ρ ‖∇_y g‖ / 2h``: per coordinate (``h = μ``), ``‖Δδ_p‖ <= ρ ‖∇_y g‖ / (√2 μ)``; in
      CG's products (``h = hvp_mu / ‖v‖``), ``‖ΔH‖ <= ρ ‖∇_y g‖ / (√2 hvp_mu)``.
    * CG then solves a system perturbed by ``ΔH``: to first order ``Δw = −H⁻¹ ΔH w``, which
      the indirect term ``(⟨δ_p, w⟩)_p = (∇²_yx g)ᵀ w`` carries as at most
      ``‖(∇²_yx g)ᵀ H⁻¹‖₂ ‖ΔH‖ ‖w‖``; the coordinate quotients add ``√|P| ‖Δδ_p‖ ‖w‖`` over
      the |P| = 5 coordinates.
    * All of it divided by ``‖exact‖``, which is 3.7x smaller than ``‖w‖`` here (the direct
      and indirect terms cancel).
    * The direct term ``∇_x f`` and CG's own arithmetic round at ``O(n u)`` relative, with no
      division by a step: ``n u = 2.6e-6``, added once.

    The bound is 4.4e-3, 37-74x the rounding the three kernels add (what first-order worst-case
    alignments cost); it proves the float32 error is rounding of the size float32 implies,
    not a fault of the estimator, whose accuracy the float64 tests pin down.
    """
    u = unit_roundoff(torch.float32)
    rho = math.sqrt(GRAD_ROUNDINGS) * u
    coordinate = rho * problem.grad_y_norm / (math.sqrt(2) * mu)
    operator = rho * problem.grad_y_norm / (math.sqrt(2) * hvp_mu)
    indirect = math.sqrt(5) * coordinate * problem.w_norm
    indirect += problem.solve_norm * operator * problem.w_norm
    return indirect / float(problem.exact.norm()) + GRAD_ROUNDINGS * u


def test_tanh_network_default_meets_the_issue_bound_in_float64(
    record_property: Callable[[str, object], None],
) -> None:
    """Rounding in float64 is ``eps / μ ≈ 4e-11`` at the default step: the error measured is
    the estimator's truncation (O(μ²) in the coordinates, O(hvp_mu²) in CG's products) and
    CG's, which are the same on every CPU."""
    problem = tanh_problem(torch.float64)

    central = tanh_error(problem, FiniteDifference())
    forward = tanh_error(problem, FiniteDifference(scheme="forward"))

    record_property("central_error", central)
    record_property("forward_error", forward)
    # measured: central 2.9e-6, forward 1.4e-5 (O(μ) truncation at μ = 1.5e-8 and hvp_mu)
    assert central <= 1e-4
    assert central < forward


def test_tanh_network_default_in_float32_is_truncation_plus_derived_rounding(
    record_property: Callable[[str, object], None],
) -> None:
    """In float32 the 1e-4 of float64 sits at the rounding floor (measured 6.6e-5 with AVX2
    kernels, 9.3e-5 with the portable ones, 1.25e-4 with AVX-512), so the requirement is "as
    good as float32 allows", stated as a bound: the same estimator with the same steps and
    CG iterations in float64 (its truncation and CG error, no rounding to speak of) plus
    :func:`float32_rounding_bound`."""
    problem32, problem64 = tanh_problem(torch.float32), tanh_problem(torch.float64)
    estimator = FiniteDifference()
    mu = default_step("central", torch.float32)
    result = estimator(problem32.outer, problem32.inner, problem32.x, problem32.y)
    error = float((flat(result.grad).double() - problem32.exact).norm() / problem32.exact.norm())
    # the float64 twin runs exactly the CG iterations the float32 run ran (2 gradients each,
    # 1 for ∇f and 2 per coordinate besides)
    iterations = (int(result.n_grad) - 1 - 2 * 5) // 2
    twin = FiniteDifference(mu=mu, hvp_mu=estimator.hvp_mu, cg_iters=iterations, tol=0.0)
    truncation = tanh_error(problem64, twin)
    rounding = float32_rounding_bound(problem32, mu, estimator.hvp_mu)

    record_property("central_error", error)
    record_property("bound", truncation + rounding)
    print(f"\nfloat32: {error:.2e} <= {truncation:.2e} + {rounding:.2e}")
    # measured: truncation 6.9e-6, rounding bound 4.4e-3, error 6.6e-5 to 1.25e-4 (kernels)
    assert error <= truncation + rounding
    # the truncation alone is within the issue's 1e-4: what float32 adds is rounding
    assert truncation <= 1e-4


def test_forward_differences_miss_the_bound_in_float32_before_any_rounding() -> None:
    """Why central is the default: at float32's forward step (eps^(1/2)) the forward scheme's
    O(μ) truncation alone, computed in float64, is above 1e-4 (measured 1.8e-4), while the
    central scheme's at its float32 step is 6.9e-6. Exact arithmetic up to float64 rounding,
    so the same on every CPU; comparing the two float32 runs would compare rounding noise."""
    problem = tanh_problem(torch.float64)

    def truncation(scheme: str) -> float:
        mu = default_step(scheme, torch.float32)  # type: ignore[arg-type]
        return tanh_error(problem, FiniteDifference(scheme=scheme, mu=mu))  # type: ignore[arg-type]

    assert truncation("forward") > 1e-4
    assert truncation("central") <= 1e-4 / 10


def test_tanh_network_central_costs_at_most_twice_the_forward_flops() -> None:
    problem = tanh_problem(DTYPE)

    def flops(estimator: FiniteDifference) -> int:
        return count_flops(lambda: estimator(problem.outer, problem.inner, problem.x, problem.y))

    forward, central = flops(FiniteDifference(scheme="forward")), flops(FiniteDifference())
    print(f"\nFLOPs: forward {forward:,}, central {central:,} ({central / forward:.2f}x)")
    assert forward < central <= 2 * forward  # measured 42,000 and 76,320 (1.82x)


# ================================================================ steps chosen from the dtype


@pytest.mark.parametrize(
    ("scheme", "dtype", "power"),
    [
        ("central", torch.float32, 1 / 3),
        ("central", torch.float64, 1 / 3),
        ("forward", torch.float32, 1 / 2),
        ("forward", torch.float64, 1 / 2),
    ],
)
def test_default_step_is_a_power_of_the_dtype_epsilon(
    scheme: str, dtype: torch.dtype, power: float
) -> None:
    expected = torch.finfo(dtype).eps ** power
    estimator = FiniteDifference(scheme=scheme)  # type: ignore[arg-type]

    assert estimator.mu is None
    assert estimator.step(dtype) == expected == default_step(scheme, dtype)  # type: ignore[arg-type]
    assert FiniteDifference(scheme=scheme, mu=0.25).step(dtype) == 0.25  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("scheme", ["central", "forward"])
def test_the_call_perturbs_x_by_the_dtype_step(scheme: str, dtype: torch.dtype) -> None:
    seen: list[Tensor] = []

    def inner(x: Params, y: Params) -> Tensor:
        seen.append(x["a"].detach().clone())
        return 0.5 * (y["w"] - x["a"]).pow(2).sum() + 0.5 * x["a"].pow(2).sum() * y["w"].sum()

    x = {"a": torch.zeros(2, dtype=dtype)}
    y = {"w": torch.ones(2, dtype=dtype)}
    FiniteDifference(scheme=scheme)(lambda x, y: y["w"].sum(), inner, x, y)  # type: ignore[arg-type]

    mu = torch.tensor(default_step(scheme, dtype), dtype=dtype)  # type: ignore[arg-type]
    moved = [v for v in seen if bool(v.any())]
    signs = [1, -1] if scheme == "central" else [1]
    expected = [
        torch.zeros(2, dtype=dtype).index_fill(0, torch.tensor([p]), s * mu)
        for p in range(2)
        for s in signs
    ]
    assert len(moved) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(moved, expected, strict=True))


def test_a_default_step_that_vanishes_names_itself() -> None:
    x = {"a": torch.tensor([1.0e6], dtype=torch.float32)}
    y = {"w": torch.tensor([0.0], dtype=torch.float32)}
    mu = default_step("central", torch.float32)
    message = (
        f"FiniteDifference.mu = {mu!r} (the default of scheme 'central') vanishes next to "
        "x['a'] = 1000000.0 in torch.float32; raise mu."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        FiniteDifference()(
            lambda x, y: y["w"].sum(), lambda x, y: (y["w"] - x["a"]).pow(2).sum(), x, y
        )


# ================================================================ configuration


def test_scheme_and_mu_defaults_and_the_printed_form() -> None:
    assert (FiniteDifference().scheme, FiniteDifference().mu) == ("central", None)
    assert FiniteDifference(as_printed=True).scheme == "forward"  # eq. (10) as printed
    assert FiniteDifference(as_printed=True, scheme="central").scheme == "central"
    cfg = parse_config({"algorithm": {"name": "rafbo"}})
    assert (cfg.estimator.scheme, cfg.estimator.mu) == ("central", None)  # type: ignore[union-attr]
    cfg = parse_config(
        {"algorithm": {"name": "rafbo"}, "estimator": {"scheme": "forward", "mu": 1e-3}}
    )
    assert (cfg.estimator.scheme, cfg.estimator.mu) == ("forward", 1e-3)  # type: ignore[union-attr]
    dumped = parse_config(cfg.model_dump(mode="json"))
    assert dumped.estimator == cfg.estimator


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"scheme": "backward"}, "scheme\n  Input should be 'forward' or 'central'"),
        ({"mu": 0.0}, "mu\n  Input should be greater than 0"),
        ({"mu": float("inf")}, "mu\n  Input should be a finite number"),
    ],
)
def test_bad_scheme_or_step_is_refused_with_a_sentence(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        FiniteDifference.model_validate(settings)
