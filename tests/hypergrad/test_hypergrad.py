"""Tests of radbo.hypergrad: implicit hypergradients checked against closed forms.

The reference problem is a random quadratic bilevel problem in float64 with named,
multi-shaped x and y and a non-identity SPD inner Hessian A (eigenvalues evenly spaced in
[0.5, 10], condition number 20):

    g(x, y) = ½ yᵀAy − yᵀBx + cᵀy + ½ ρ ||x||²
    f(x, y) = ½ ||Cy − d||² + eᵀx + ½ xᵀDx + yᵀEx

so that ∇_y g = Ay − Bx + c, ∇²_yy g = A, ∇²_xy g = −Bᵀ, y*(x) = A⁻¹(Bx − c) and, at any y,

    ∇_x f − ∇²_xy g [∇²_yy g]⁻¹ ∇_y f = (e + Dx + Eᵀy) + Bᵀ A⁻¹ (Cᵀ(Cy − d) + Ex),

which at y = y*(x) is ∇Φ(x) (cross-checked against autograd through torch.linalg.solve).
"""

from __future__ import annotations

import doctest
import math
import re
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from torch import Tensor, nn
from torch.func import functional_call

import radbo.autodiff
import radbo.hypergrad.base
import radbo.hypergrad.cg
import radbo.hypergrad.neumann
from radbo.autodiff import solve_cg, tuple_axpy, tuple_dot
from radbo.hypergrad import (
    HypergradEstimator,
    HypergradResult,
    ImplicitCG,
    Neumann,
)
from radbo.typing import Params
from tests.helpers import (
    A_EIGS,
    DTYPE,
    X_SHAPES,
    Y_SHAPES,
    P,
    Q,
    Quadratic,
    flat,
    rel_err,
    unflat,
)


@pytest.fixture(scope="module")
def problem() -> Quadratic:
    return Quadratic.random(0)


# ---------------------------------------------------------------- reference sanity


def test_closed_form_equals_autograd_of_phi(problem: Quadratic) -> None:
    x, y = problem.point()
    xf = flat(x).clone().requires_grad_(True)
    phi = problem.outer(unflat(xf, X_SHAPES), unflat(problem.y_star(xf), Y_SHAPES))
    (autograd_phi,) = torch.autograd.grad(phi, xf)
    closed = problem.surrogate(flat(x), flat(y))
    # float64, two routes through a 10x10 solve (κ = 20) on entries up to 49: measured 9.8e-15
    # apart on default/avx2/avx512; bound 1e-12 + 1e-12·|value|
    torch.testing.assert_close(closed, autograd_phi, rtol=1e-12, atol=1e-12)
    # the test problem's inner Hessian is far from the identity
    eig = torch.linalg.eigvalsh(problem.A)
    assert eig.min() == pytest.approx(0.5) and eig.max() == pytest.approx(10.0)


# ---------------------------------------------------------------- ImplicitCG


def test_implicit_cg_default_matches_closed_form(problem: Quadratic) -> None:
    x, y = problem.point()
    result = ImplicitCG()(problem.outer, problem.inner, x, y)
    # float64: 10 CG iterations = dim y reach rounding, measured 4.9e-16 (all three kernels)
    assert rel_err(result.grad, problem.surrogate(flat(x), flat(y))) <= 1e-4


def test_implicit_cg_tight_tolerance_is_exact(problem: Quadratic) -> None:
    x, y = problem.point()
    result = ImplicitCG(max_iter=50, tol=1e-26)(problem.outer, problem.inner, x, y)
    # float64: CG at κ = 20 converged to rounding; measured 4.9e-16 (grad), 5.4e-15 relative
    # (v) on default/avx2/avx512; bounds 1e-10 and 1e-9
    assert rel_err(result.grad, problem.surrogate(flat(x), flat(y))) <= 1e-10
    v_exact = torch.linalg.solve(problem.A, problem.grad_y_f(flat(x), flat(y)))
    torch.testing.assert_close(flat(result.v), v_exact, rtol=1e-9, atol=1e-12)


def test_implicit_cg_off_the_inner_solution_matches_surrogate(problem: Quadratic) -> None:
    x, y_opt = problem.point()
    y = {k: t + 0.5 for k, t in y_opt.items()}  # not y*(x): eq. (7) evaluated at (x, y)
    result = ImplicitCG(max_iter=50, tol=1e-26)(problem.outer, problem.inner, x, y)
    assert rel_err(result.grad, problem.surrogate(flat(x), flat(y))) <= 1e-10  # measured 2.2e-16


def test_implicit_cg_result_keys_shapes_and_detached(problem: Quadratic) -> None:
    x, y = problem.point()
    result = ImplicitCG()(problem.outer, problem.inner, x, y)
    assert isinstance(result, HypergradResult)
    assert {k: tuple(t.shape) for k, t in result.grad.items()} == X_SHAPES
    assert {k: tuple(t.shape) for k, t in result.v.items()} == Y_SHAPES
    assert list(result.grad) == list(x) and list(result.v) == list(y)
    assert all(not t.requires_grad and t.dtype == DTYPE for t in result.grad.values())
    assert all(not t.requires_grad for t in result.v.values())


def test_implicit_cg_counts_truncated(problem: Quadratic) -> None:
    x, y = problem.point()
    result = ImplicitCG(max_iter=3, tol=0.0)(problem.outer, problem.inner, x, y)
    assert (result.n_grad, result.n_hvp) == (2, 3 + 1)


def test_implicit_cg_counts_equal_cg_iterations_plus_one(problem: Quadratic) -> None:
    x, y = problem.point()
    estimator = ImplicitCG(max_iter=50, tol=1e-20)
    result = estimator(problem.outer, problem.inner, x, y)
    b = problem.grad_y_f(flat(x), flat(y))
    _, iterations = solve_cg(lambda u: (problem.A @ u[0],), (b,), max_iter=50, tol=1e-20)
    assert 1 <= iterations < 50
    assert result.n_grad == 2
    assert result.n_hvp == iterations + 1


def test_implicit_cg_zero_rhs_makes_no_hvp(problem: Quadratic) -> None:
    x, y = problem.point()
    result = ImplicitCG()(lambda x, y: flat(x).sum(), problem.inner, x, y)  # ∇_y f = 0
    assert (result.n_grad, result.n_hvp) == (2, 1)
    assert torch.count_nonzero(flat(result.v)) == 0
    # exact: ∇_x f = 1 and the mixed term multiplies v = 0
    torch.testing.assert_close(flat(result.grad), torch.ones(P, dtype=DTYPE))


def test_damping_matches_closed_form_with_shifted_hessian(problem: Quadratic) -> None:
    x, y = problem.point()
    for damping in (0.5, 3.0):
        estimator = ImplicitCG(max_iter=50, tol=1e-26, damping=damping)
        result = estimator(problem.outer, problem.inner, x, y)
        reference = problem.surrogate(flat(x), flat(y), damping=damping)
        assert rel_err(result.grad, reference) <= 1e-10  # float64: measured 2.5e-16, 1.8e-16
        # a real bias: measured 0.48 and 0.83 (float64, all three kernels)
        assert rel_err(result.grad, problem.surrogate(flat(x), flat(y))) > 1e-2


# ---------------------------------------------------------------- Neumann

NEUMANN_TERMS = (5, 10, 20, 50, 100, 200)


def test_neumann_error_decreases_with_terms(problem: Quadratic) -> None:
    x, y = problem.point()
    reference = problem.surrogate(flat(x), flat(y))
    errors = []
    for terms in NEUMANN_TERMS:
        result = Neumann(terms=terms, eta=0.1)(problem.outer, problem.inner, x, y)
        assert (result.n_grad, result.n_hvp) == (2, terms)
        errors.append(rel_err(result.grad, reference))
    # The errors are the series' truncation, v_K − v* = −(I − ηA)^K v*, a property of the
    # float64 problem, not rounding (which is ~K·κ·u = 1e-12 relative): measured 0.74, 0.57,
    # 0.33, 7.1e-2, 5.5e-3, 3.3e-5 for 5 ... 200 terms, the same on default/avx2/avx512 to
    # 1e-15. The bounds below sit 1.8x to 7x from them: truncation differences, not noise.
    assert all(later <= earlier for earlier, later in zip(errors, errors[1:], strict=False))
    by_terms = dict(zip(NEUMANN_TERMS, errors, strict=True))
    assert by_terms[100] <= 1e-2  # the number documented in Neumann's docstring
    assert by_terms[50] > 1e-2
    assert by_terms[200] <= 1e-4


def test_neumann_v_is_the_truncated_series(problem: Quadratic) -> None:
    x, y = problem.point()
    b = problem.grad_y_f(flat(x), flat(y))
    eta, terms = 0.15, 7
    m = torch.eye(Q, dtype=DTYPE) - eta * problem.A
    expected = eta * sum(torch.linalg.matrix_power(m, k) @ b for k in range(terms))
    result = Neumann(terms=terms, eta=eta)(problem.outer, problem.inner, x, y)
    # float64, 7 terms summed in two orders: measured 1.8e-15 (v, entries up to 7.4) and
    # 3.6e-15 (grad, up to 25) on default/avx2/avx512; bounds 1e-12 + 1e-12·|value|
    torch.testing.assert_close(flat(result.v), expected, rtol=1e-12, atol=1e-12)
    expected_grad = problem.e + problem.D @ flat(x) + problem.E.T @ flat(y) + problem.B.T @ expected
    torch.testing.assert_close(flat(result.grad), expected_grad, rtol=1e-12, atol=1e-12)


def test_neumann_one_term_is_scaled_gradient(problem: Quadratic) -> None:
    x, y = problem.point()
    result = Neumann(terms=1, eta=0.2)(problem.outer, problem.inner, x, y)
    # float64: one product 0.2·∇_y f; measured equal bit for bit on all three kernels
    torch.testing.assert_close(flat(result.v), 0.2 * problem.grad_y_f(flat(x), flat(y)))
    assert (result.n_grad, result.n_hvp) == (2, 1)


def test_neumann_diverges_when_eta_exceeds_two_over_l(problem: Quadratic) -> None:
    x, y = problem.point()
    reference = problem.surrogate(flat(x), flat(y))
    eta = 2.5 / float(A_EIGS.max())
    errors = [
        rel_err(Neumann(terms=t, eta=eta)(problem.outer, problem.inner, x, y).grad, reference)
        for t in (10, 20, 40)
    ]
    # |1 − η·10| = 1.5 per term: measured 0.74, 49.9, 1.67e5 (float64, all three kernels)
    assert errors[0] < errors[1] < errors[2] and errors[2] > 1e3


# ---------------------------------------------------------------- solve_cg


def _spd(n: int, seed: int, low: float = 0.1, high: float = 10.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=DTYPE))
    eig = low + (high - low) * torch.rand(n, generator=gen, dtype=DTYPE)
    a = basis @ torch.diag(eig) @ basis.T
    return (a + a.T) / 2


def _split_matvec(a: Tensor, k: int) -> Callable[[tuple[Tensor, ...]], tuple[Tensor, ...]]:
    """A u for u stored as (first k entries, the rest reshaped to a column)."""

    def matvec(u: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        out = a @ torch.cat([t.reshape(-1) for t in u])
        return out[:k], out[k:].reshape(-1, 1)

    return matvec


def test_solve_cg_matches_linalg_solve_on_tuples() -> None:
    a = _spd(5, seed=4)
    b_flat = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=DTYPE)
    b = (b_flat[:2], b_flat[2:].reshape(-1, 1))
    v, n_matvec = solve_cg(_split_matvec(a, 2), b, max_iter=30, tol=1e-26)
    assert v[0].shape == (2,) and v[1].shape == (3, 1)
    # float64, κ <= 100: measured 1.7e-15 relative on default/avx2/avx512; bound 1e-10
    torch.testing.assert_close(
        torch.cat([t.reshape(-1) for t in v]), torch.linalg.solve(a, b_flat), rtol=1e-10, atol=0
    )
    assert 1 <= n_matvec <= 30


def test_solve_cg_damping_solves_shifted_system() -> None:
    a = _spd(4, seed=5)
    b = torch.arange(1.0, 5.0, dtype=DTYPE)
    (v,), _ = solve_cg(lambda u: (a @ u[0],), (b,), max_iter=30, tol=1e-26, damping=2.0)
    # float64: measured 1.1e-16 apart (all three kernels); assert_close's float64 default
    # tolerances (rtol 1e-7, atol 1e-7) are 10^9 above
    torch.testing.assert_close(v, torch.linalg.solve(a + 2.0 * torch.eye(4, dtype=DTYPE), b))


def test_solve_cg_counts_warm_start_and_zero_rhs() -> None:
    a = _spd(4, seed=6)
    b = torch.arange(1.0, 5.0, dtype=DTYPE)
    exact = torch.linalg.solve(a, b)
    (v,), n_matvec = solve_cg(lambda u: (a @ u[0],), (b,), max_iter=30, tol=1e-20, x0=(exact,))
    assert n_matvec == 1  # only the initial residual
    torch.testing.assert_close(v, exact)  # the warm start returned unchanged: measured equal
    (v,), n_matvec = solve_cg(lambda u: (a @ u[0],), (torch.zeros(4, dtype=DTYPE),), max_iter=5)
    assert n_matvec == 0 and torch.count_nonzero(v) == 0
    (v,), n_matvec = solve_cg(lambda u: (a @ u[0],), (b,), max_iter=2, tol=0.0)
    assert n_matvec == 2


def test_solve_cg_stops_on_non_positive_curvature() -> None:
    b = torch.tensor([1.0, 2.0], dtype=DTYPE)
    (v,), n_matvec = solve_cg(lambda u: (-u[0],), (b,), max_iter=10)
    assert n_matvec == 1
    assert torch.count_nonzero(v) == 0


def test_solve_cg_rejects_bad_warm_start() -> None:
    b = (torch.ones(3, dtype=DTYPE),)
    with pytest.raises(ValueError, match=r"solve_cg\.x0 must have the shapes of b"):
        solve_cg(lambda u: u, b, max_iter=3, x0=(torch.ones(2, dtype=DTYPE),))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), k=st.integers(0, 6), seed=st.integers(0, 2**31 - 1))
def test_solve_cg_residual_is_small_on_random_spd_systems(n: int, k: int, seed: int) -> None:
    k = min(k, n)
    a = _spd(n, seed=seed)  # condition number <= 100
    gen = torch.Generator().manual_seed(seed + 1)
    b_flat = torch.randn(n, generator=gen, dtype=DTYPE)
    b = (b_flat[:k], b_flat[k:].reshape(-1, 1))
    v, n_matvec = solve_cg(_split_matvec(a, k), b, max_iter=50, tol=1e-24)
    v_flat = torch.cat([t.reshape(-1) for t in v])
    # float64, n <= 6, κ <= 100: the residual's rounding floor is ~n·κ·u = 7e-14; measured at
    # most 2.8e-13 over 1,800 systems drawn like these, on each of default/avx2/avx512; bound 1e-9
    assert torch.linalg.norm(a @ v_flat - b_flat) <= 1e-9 * torch.linalg.norm(b_flat)
    assert n_matvec <= 50


def test_tuple_helpers() -> None:
    # float32, but exact: small integers and halves, whose products and sums are representable
    a = (torch.tensor([1.0, 2.0]), torch.ones(2, 2))
    b = (torch.tensor([3.0, 4.0]), torch.full((2, 2), 0.5))
    assert float(tuple_dot(a, b)) == 13.0
    out = tuple_axpy(-2.0, a, b)
    torch.testing.assert_close(out[0], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out[1], torch.full((2, 2), -1.5))
    with pytest.raises(ValueError, match="equal length"):
        tuple_dot(a, b[:1])


# ---------------------------------------------------------------- input handling

ESTIMATORS: list[HypergradEstimator] = [ImplicitCG(max_iter=50, tol=1e-26), Neumann(terms=300)]


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=["cg", "neumann"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_estimators_do_not_mutate_inputs(
    problem: Quadratic, estimator: HypergradEstimator, requires_grad: bool
) -> None:
    assert isinstance(estimator, HypergradEstimator)
    x, y = problem.point()
    x = {k: t.clone().requires_grad_(requires_grad) for k, t in x.items()}
    y = {k: t.clone().requires_grad_(requires_grad) for k, t in y.items()}
    x_before = {k: t.detach().clone() for k, t in x.items()}
    y_before = {k: t.detach().clone() for k, t in y.items()}
    x_ids, y_ids = {k: id(t) for k, t in x.items()}, {k: id(t) for k, t in y.items()}

    result = estimator(problem.outer, problem.inner, x, y)

    assert {k: id(t) for k, t in x.items()} == x_ids and {k: id(t) for k, t in y.items()} == y_ids
    for params, before in ((x, x_before), (y, y_before)):
        for k, t in params.items():
            assert torch.equal(t.detach(), before[k])
            assert t.requires_grad is requires_grad and t.grad is None
    # float64: CG measured 4.9e-16; Neumann(terms=300, eta=0.1) is its truncation, at most
    # (1 − 0.1·0.5)^300 = 2.1e-7 of v* (measured 1.9e-7 on default/avx2/avx512), not rounding
    assert rel_err(result.grad, problem.surrogate(flat(x_before), flat(y_before))) <= 1e-6


def test_x_tensors_that_g_ignores_get_zero_mixed_term(problem: Quadratic) -> None:
    x, y = problem.point()
    x = {**x, "h": torch.tensor([0.5, -1.0], dtype=DTYPE), "unused": torch.ones(2, 2, dtype=DTYPE)}

    def outer(x: Params, y: Params) -> Tensor:  # h enters f only; "unused" enters nothing
        core = {k: x[k] for k in X_SHAPES}
        return problem.outer(core, y) + (x["h"] ** 3).sum() * flat(y).sum()

    def inner(x: Params, y: Params) -> Tensor:
        return problem.inner({k: x[k] for k in X_SHAPES}, y)

    result = ImplicitCG(max_iter=50, tol=1e-26)(outer, inner, x, y)
    expected_h = 3 * x["h"] ** 2 * flat(y).sum()  # ∇_h f, no mixed term
    # float64: measured equal bit for bit; the core below measured 2.8e-16 (all three kernels)
    torch.testing.assert_close(result.grad["h"], expected_h, rtol=1e-12, atol=1e-12)
    assert torch.equal(result.grad["unused"], torch.zeros(2, 2, dtype=DTYPE))
    # the h-term adds (Σ h³)·1 to ∇_y f, which reaches the core x through Bᵀ A⁻¹
    extra_grad_y_f = (x["h"] ** 3).sum() * torch.ones(Q, dtype=DTYPE)
    reference = problem.surrogate(flat({k: x[k] for k in X_SHAPES}), flat(y))
    reference = reference + problem.B.T @ torch.linalg.solve(problem.A, extra_grad_y_f)
    assert rel_err({k: result.grad[k] for k in X_SHAPES}, reference) <= 1e-10


def test_inner_loss_independent_of_x_gives_outer_gradient(problem: Quadratic) -> None:
    x, y = problem.point()

    def inner(x: Params, y: Params) -> Tensor:  # no x at all: ∇²_xy g = 0
        yf = flat(y)
        return 0.5 * yf @ problem.A @ yf

    result = ImplicitCG()(problem.outer, inner, x, y)
    expected = problem.e + problem.D @ flat(x) + problem.E.T @ flat(y)
    # float64: measured 4.4e-16 apart on default/avx2/avx512
    torch.testing.assert_close(flat(result.grad), expected, rtol=1e-12, atol=1e-12)
    assert result.n_hvp >= 2  # v was still solved for, then multiplied by a zero block


def test_rejects_non_scalar_loss_integer_tensor_and_empty_y(problem: Quadratic) -> None:
    x, y = problem.point()
    with pytest.raises(ValueError, match=r"outer_loss must return a scalar tensor, got \(10,\)"):
        ImplicitCG()(lambda x, y: flat(y), problem.inner, x, y)
    with pytest.raises(ValueError, match=r"x\['step'\] must be a floating-point tensor"):
        ImplicitCG()(problem.outer, problem.inner, {**x, "step": torch.tensor(3)}, y)
    with pytest.raises(ValueError, match="y must hold at least one tensor"):
        Neumann()(lambda x, y: flat(x).sum(), lambda x, y: flat(x).sum(), x, {})


# ---------------------------------------------------------------- a small neural network


def test_mlp_implicit_cg_matches_dense_hessian_solution() -> None:
    gen = torch.Generator().manual_seed(7)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=DTYPE)

    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(DTYPE)
    y = {name: 0.5 * randn(*p.shape) for name, p in net.named_parameters()}
    y_shapes = {k: tuple(t.shape) for k, t in y.items()}
    x = {"feature_scale": 1.0 + 0.2 * randn(4), "log_reg": torch.tensor(-1.0, dtype=DTYPE)}
    x_shapes = {k: tuple(t.shape) for k, t in x.items()}
    x_train, x_val = randn(24, 4), randn(16, 4)
    t_train, t_val = torch.sign(randn(24)), torch.sign(randn(16))

    def logits(x: Params, y: Params, features: Tensor) -> Tensor:
        return functional_call(net, y, (features * x["feature_scale"],)).squeeze(-1)

    def inner(x: Params, y: Params) -> Tensor:
        data = nn.functional.softplus(-t_train * logits(x, y, x_train)).mean()
        return data + 0.5 * torch.exp(x["log_reg"]) * flat(y).pow(2).sum()

    def outer(x: Params, y: Params) -> Tensor:
        return nn.functional.softplus(-t_val * logits(x, y, x_val)).mean()

    # dense reference: H_yy by torch.autograd.functional.hessian on the flattened y
    xf, yf = flat(x), flat(y)
    h_yy = torch.autograd.functional.hessian(lambda v: inner(x, unflat(v, y_shapes)), yf)
    assert torch.linalg.eigvalsh(h_yy).min() > 0.05  # strongly convex here: measured 0.254

    def grad_y_g(xv: Tensor) -> Tensor:
        yv = yf.clone().requires_grad_(True)
        (gy,) = torch.autograd.grad(
            inner(unflat(xv, x_shapes), unflat(yv, y_shapes)), yv, create_graph=True
        )
        return gy

    h_xy = torch.autograd.functional.jacobian(grad_y_g, xf).T  # (dim x, dim y)
    fx, fy = torch.autograd.functional.jacobian(
        lambda a, b: outer(unflat(a, x_shapes), unflat(b, y_shapes)), (xf, yf)
    )
    reference = fx - h_xy @ torch.linalg.solve(h_yy, fy)

    result = ImplicitCG(max_iter=200, tol=1e-26)(outer, inner, x, y)
    # float64, 26 unknowns, κ(H_yy) = 3.3: rounding ~n·κ·u = 1e-14. Measured 8.1e-15 to 8.6e-15
    # (grad, relative) and 5.9e-15 (v, absolute; entries 6e-4 to 0.27) on default/avx2/avx512;
    # bounds tightened from 1e-6 to 1e-10 and 1e-12 + 1e-10·|v|
    assert rel_err(result.grad, reference) <= 1e-10
    torch.testing.assert_close(flat(result.v), torch.linalg.solve(h_yy, fy), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ImplicitCG(max_iter=0), "max_iter\n  Input should be greater than or equal to 1"),
        (lambda: ImplicitCG(max_iter=2.5), "max_iter\n  Input should be a valid integer"),
        (lambda: ImplicitCG(tol=-1e-3), "tol\n  Input should be greater than or equal to 0"),
        (lambda: ImplicitCG(tol=math.nan), "tol\n  Input should be a finite number"),
        (lambda: ImplicitCG(damping=-0.5), "damping\n  Input should be greater than or equal to 0"),
        (lambda: ImplicitCG(damping=math.inf), "damping\n  Input should be a finite number"),
        (lambda: Neumann(terms=0), "terms\n  Input should be greater than or equal to 1"),
        (lambda: Neumann(eta=0.0), "eta\n  Input should be greater than 0"),
        (lambda: Neumann(eta=-0.1), "eta\n  Input should be greater than 0"),
        (lambda: Neumann(eta=math.inf), "eta\n  Input should be a finite number"),
        (lambda: ImplicitCG(maxiter=3), "maxiter\n  Extra inputs are not permitted"),
        (
            lambda: solve_cg(lambda u: u, (torch.ones(2),), max_iter=0),
            "solve_cg.max_iter must be an integer >= 1, got 0",
        ),
        (
            lambda: solve_cg(lambda u: u, (torch.ones(2),), max_iter=3, damping=-1.0),
            "solve_cg.damping must be a finite number >= 0, got -1.0",
        ),
    ],
)
def test_invalid_configuration_raises_with_a_sentence(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_estimators_are_frozen_and_hashable() -> None:
    estimator = ImplicitCG()
    with pytest.raises(ValidationError, match="frozen"):
        estimator.max_iter = 3  # type: ignore[misc]
    assert {ImplicitCG(), ImplicitCG(), Neumann()} == {ImplicitCG(), Neumann()}


# the examples print float32 results rounded to 4 to 6 decimals
@pytest.mark.float_sensitive
@pytest.mark.parametrize(
    "module", [radbo.autodiff, radbo.hypergrad.base, radbo.hypergrad.cg, radbo.hypergrad.neumann]
)
def test_docstring_examples(module: object) -> None:
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0


def test_empty_x_gives_empty_gradient(problem: Quadratic) -> None:
    _, y = problem.point()

    def inner(x: Params, y: Params) -> Tensor:
        yf = flat(y)
        return 0.5 * yf @ problem.A @ yf

    result = Neumann(terms=3)(lambda x, y: flat(y).sum(), inner, {}, y)
    assert result.grad == {} and (result.n_grad, result.n_hvp) == (2, 3)
    assert list(result.v) == list(Y_SHAPES)


def test_implicit_estimators_accept_generator_and_state_keywords(problem: Quadratic) -> None:
    x, y = problem.point()
    for estimator in (ImplicitCG(max_iter=50, tol=1e-26), Neumann(terms=5)):
        assert estimator.state_keys == ()
        plain = estimator(problem.outer, problem.inner, x, y)
        keyed = estimator(
            problem.outer,
            problem.inner,
            x,
            y,
            generator=torch.Generator().manual_seed(0),
            state={"ignored:w": torch.zeros(4, dtype=DTYPE)},
        )
        assert plain.state == {} and keyed.state == {}
        assert all(torch.equal(plain.grad[k], keyed.grad[k]) for k in x)
    legacy = HypergradResult(grad={}, v={}, n_grad=0, n_hvp=0)  # positional fields unchanged
    assert legacy.state == {}
