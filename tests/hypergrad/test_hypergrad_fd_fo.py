"""Tests of the second-order-free estimators and the product oracles of radbo.hypergrad.

* FiniteDifference (RAFBO, Alg. 2 / eq. (10), corrected) and its ``as_printed`` form;
* FirstOrder (the penalty estimator of FedSVRBGD-FO, eq. (3)-(6));
* the second-order products of the ``autograd`` and ``finite_difference`` estimators
  (``estimator.linearize``, used by SimFBO/ShroFBO, FedMSA and FedMBO).

Reference problem: the random float64 quadratic bilevel problem of tests/hypergrad/test_hypergrad.py
(dim x = 7, dim y = 10, inner Hessian A with eigenvalues evenly spaced in [0.5, 10]), whose
exact hypergradient is ``Quadratic.surrogate`` (= ∇Φ(x) at y = y*(x)). Measured numbers are
quoted next to the assertions that pin them.
"""

from __future__ import annotations

import doctest
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor, nn
from torch.func import functional_call

import radbo.hypergrad.autograd
import radbo.hypergrad.finite_difference
import radbo.hypergrad.first_order
from radbo.autodiff import FiniteDifferenceSystem, InnerSystem
from radbo.hypergrad import (
    Autograd,
    Estimator,
    FiniteDifference,
    FirstOrder,
    HypergradEstimator,
    ImplicitCG,
    Neumann,
    init_state,
)
from radbo.typing import Params
from tests.helpers import DTYPE, X_SHAPES, Y_SHAPES, P, Q, Quadratic, flat, rel_err, unflat


@pytest.fixture(scope="module")
def problem() -> Quadratic:
    return Quadratic.random(0)


def grad_x_f(problem: Quadratic, x: Params, y: Params) -> Tensor:
    """∇_x f by autograd, computed as the estimators compute it (same ops, same order)."""
    xl = {k: t.clone().requires_grad_(True) for k, t in x.items()}
    yl = {k: t.clone().requires_grad_(True) for k, t in y.items()}
    grads = torch.autograd.grad(problem.outer(xl, yl), [*xl.values(), *yl.values()])
    return torch.cat([g.reshape(-1) for g in grads[: len(xl)]])


# ================================================================ FiniteDifference


def test_fd_all_coordinates_matches_closed_form(problem: Quadratic) -> None:
    x, y = problem.point()
    result = FiniteDifference(cg_iters=20, tol=1e-26)(problem.outer, problem.inner, x, y)
    error = rel_err(result.grad, problem.surrogate(flat(x), flat(y)))
    # float64: central differences of an affine gradient have no truncation; their rounding is
    # u·|∇g| / μ = 1.1e-16 / 6.1e-6 = 1.8e-11 relative. Measured 2.15e-11 (grad) and 8.1e-12
    # (v, absolute) on default/avx2/avx512; bounds 1e-8 and 1e-10 + 1e-8·|v|
    assert error <= 1e-8, f"FiniteDifference relative error {error:.3e}"
    v_exact = torch.linalg.solve(problem.A, problem.grad_y_f(flat(x), flat(y)))
    torch.testing.assert_close(flat(result.v), v_exact, rtol=1e-8, atol=1e-10)
    assert {k: tuple(t.shape) for k, t in result.grad.items()} == X_SHAPES
    assert list(result.v) == list(Y_SHAPES)
    assert all(not t.requires_grad for t in (*result.grad.values(), *result.v.values()))
    assert result.state == {}


def test_fd_default_config_is_accurate_on_the_quadratic(problem: Quadratic) -> None:
    x, y = problem.point()
    result = FiniteDifference()(problem.outer, problem.inner, x, y)  # cg_iters = 10 = dim y
    # float64: 10 CG steps = dim y reach rounding, which is that of the test above: measured
    # 2.15e-11 on default/avx2/avx512, as with 20 steps; bound tightened from 1e-3 to 1e-8
    assert rel_err(result.grad, problem.surrogate(flat(x), flat(y))) <= 1e-8
    assert result.n_hvp == 0


def test_fd_off_the_inner_solution_matches_surrogate(problem: Quadratic) -> None:
    x, y_opt = problem.point()
    y = {k: t - 0.3 for k, t in y_opt.items()}
    result = FiniteDifference(cg_iters=30, tol=1e-26)(problem.outer, problem.inner, x, y)
    # float64, rounding u·|∇g| / μ as above: measured 2.14e-11 (all three kernels)
    assert rel_err(result.grad, problem.surrogate(flat(x), flat(y))) <= 1e-8


def test_fd_damping_matches_shifted_hessian(problem: Quadratic) -> None:
    x, y = problem.point()
    result = FiniteDifference(cg_iters=30, tol=1e-26, damping=2.0)(
        problem.outer, problem.inner, x, y
    )
    # float64, rounding u·|∇g| / μ as above: measured 2.25e-11 (all three kernels)
    assert rel_err(result.grad, problem.surrogate(flat(x), flat(y), damping=2.0)) <= 1e-8


def test_fd_as_printed_is_what_eq_10_says_and_its_error_is_large(
    problem: Quadratic, record_property: Callable[[str, object], None]
) -> None:
    x, y = problem.point()
    xf, yf = flat(x), flat(y)
    result = FiniteDifference(as_printed=True, mu=1e-3)(problem.outer, problem.inner, x, y)
    # eq. (10) / Alg. 2 line 7 as printed: ∇_x f + ∇²_xy g ∇_y f = ∇_x f − Bᵀ ∇_y f
    printed = problem.e + problem.D @ xf + problem.E.T @ yf - problem.B.T @ problem.grad_y_f(xf, yf)
    # float64, forward quotients at μ = 1e-3 of an affine gradient: rounding u·|∇g| / μ ≈ 1e-13
    # relative; measured 8.5e-12 absolute (entries up to 50) on default/avx2/avx512
    torch.testing.assert_close(flat(result.grad), printed, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(flat(result.v), -problem.grad_y_f(xf, yf))
    assert (result.n_grad, result.n_hvp) == (2 + P, 0)  # no CG at all

    error = rel_err(result.grad, problem.surrogate(xf, yf))
    record_property("as_printed_relative_error", error)
    print(
        f"\nFiniteDifference(as_printed=True): relative error {error:.4f} vs the exact hypergradient"
    )
    # the printed form misses the sign and the inverse Hessian: 1.6513274 (165 %) on default,
    # avx2 and avx512, a float64 property of the problem (the rounding above is 1e-12 of it)
    assert error > 0.1, f"as_printed relative error {error:.4f}"
    assert error == pytest.approx(1.6513, abs=1e-3), f"as_printed relative error {error:.4f}"


def test_fd_sampled_subset_exact_inside_direct_term_outside(problem: Quadratic) -> None:
    x, y = problem.point()
    estimator = FiniteDifference(num_coordinates=3, cg_iters=20, tol=1e-26)
    coords = estimator.sample_coordinates(P, torch.Generator().manual_seed(11))
    assert coords.tolist() == sorted(set(coords.tolist())) and len(coords) == 3

    result = estimator(
        problem.outer, problem.inner, x, y, generator=torch.Generator().manual_seed(11)
    )

    got, reference = flat(result.grad), problem.surrogate(flat(x), flat(y))
    direct = grad_x_f(problem, x, y)
    outside = torch.ones(P, dtype=torch.bool)
    outside[coords] = False
    # float64, rounding u·|∇g| / μ as above: measured 7.5e-10 = 9.8e-12·|reference|
    # (default/avx2/avx512)
    torch.testing.assert_close(got[coords], reference[coords], rtol=0, atol=1e-3)
    assert float((got[coords] - reference[coords]).abs().max()) <= 1e-8 * float(reference.norm())
    # ∇_x f only, bit for bit: the same autograd call on the same inputs, so the same kernels
    # in the same order on any one machine
    assert torch.equal(got[outside], direct[outside])
    # P is visible in the output: exactly the coordinates that got an indirect term
    assert torch.nonzero(got != direct).reshape(-1).tolist() == coords.tolist()


def test_fd_coordinate_set_is_reproducible_and_seed_dependent(problem: Quadratic) -> None:
    x, y = problem.point()
    estimator = FiniteDifference(fraction=0.4)  # |P| = ceil(0.4 · 7) = 3
    assert estimator.num_sampled(P) == 3

    def run(seed: int) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return flat(estimator(problem.outer, problem.inner, x, y, generator=gen).grad)

    assert torch.equal(run(5), run(5))
    sets = [
        estimator.sample_coordinates(P, torch.Generator().manual_seed(s)).tolist() for s in range(8)
    ]
    assert len({tuple(c) for c in sets}) >= 4  # different seeds draw different sets
    assert sets[0] != sets[1] and not torch.equal(run(0), run(1))


def test_fd_rescale_is_unbiased_over_the_coordinate_draw(problem: Quadratic) -> None:
    x, y = problem.point()
    reference = problem.surrogate(flat(x), flat(y))
    direct = grad_x_f(problem, x, y)
    k, seeds = 4, range(150)

    def average(estimator: FiniteDifference) -> Tensor:
        total = torch.zeros(P, dtype=DTYPE)
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            total += flat(estimator(problem.outer, problem.inner, x, y, generator=gen).grad)
        return total / len(seeds)

    rescaled = average(FiniteDifference(num_coordinates=k, rescale=True))
    plain = average(FiniteDifference(num_coordinates=k))
    scale = float(reference.norm())
    # E_P[rescaled] = exact; E_P[plain] = ∇_x f + (|P|/d)·indirect (the documented bias)
    rescaled_error = float((rescaled - reference).norm()) / scale
    plain_error = float((plain - reference).norm()) / scale
    plain_expected = direct + (k / P) * (reference - direct)
    print(f"\nrescaled average error {rescaled_error:.3f}, plain average error {plain_error:.3f}")
    # Monte Carlo over 150 draws of P, not rounding: the draws are integers (randperm) and the
    # estimates float64 (rounding 2e-11, see above), so every CPU sees the same numbers.
    # Measured 0.0726 (rescaled), 0.414 (plain), 0.0415 (plain vs its expectation) on default,
    # avx2 and avx512 alike; the bounds leave 0.08, 0.11 and 0.06, 10^9 times that rounding
    assert rescaled_error <= 0.15, f"rescaled average off by {rescaled_error:.3f}"
    assert plain_error >= 0.3, f"plain average off by {plain_error:.3f}"
    assert float((plain - plain_expected).norm()) / scale <= 0.1
    # both use the same draws: the indirect terms differ by exactly d/|P| (float64: measured
    # 1.5e-13 apart; assert_close's float64 default tolerance is 1e-7)
    torch.testing.assert_close(rescaled - direct, (P / k) * (plain - direct))


def test_fd_counts(problem: Quadratic) -> None:
    x, y = problem.point()
    gen = torch.Generator().manual_seed(0)
    result = FiniteDifference(num_coordinates=3, cg_iters=4, tol=0.0, scheme="forward")(
        problem.outer, problem.inner, x, y, generator=gen
    )
    assert (result.n_grad, result.n_hvp) == (2 + 4 + 3, 0)  # f, g base, 4 CG matvecs, |P|
    result = FiniteDifference(cg_iters=4, tol=0.0, scheme="forward")(
        problem.outer, problem.inner, x, y
    )
    assert (result.n_grad, result.n_hvp) == (2 + 4 + 7, 0)
    gen = torch.Generator().manual_seed(0)
    result = FiniteDifference(num_coordinates=5, as_printed=True)(
        problem.outer, problem.inner, x, y, generator=gen
    )
    assert (result.n_grad, result.n_hvp) == (2 + 5, 0)
    result = FiniteDifference(num_coordinates=50, scheme="forward")(
        problem.outer, problem.inner, x, y
    )
    assert result.n_grad == 2 + 10 + 7  # |P| = min(50, 7); CG converges in dim y = 10


def test_fd_needs_a_generator_only_when_sampling(problem: Quadratic) -> None:
    x, y = problem.point()
    with pytest.raises(
        ValueError, match=r"samples \|P\| = 3 of 7 coordinates of x and needs a random source"
    ):
        FiniteDifference(num_coordinates=3)(problem.outer, problem.inner, x, y)
    gen = torch.Generator().manual_seed(3)
    before = gen.get_state()
    FiniteDifference(fraction=1.0)(problem.outer, problem.inner, x, y, generator=gen)
    assert torch.equal(gen.get_state(), before)  # |P| = d draws nothing


def test_fd_x_tensors_outside_g(problem: Quadratic) -> None:
    x, y = problem.point()
    x = {**x, "h": torch.tensor([0.5, -1.0], dtype=DTYPE), "unused": torch.ones(2, 2, dtype=DTYPE)}

    def outer(x: Params, y: Params) -> Tensor:
        return problem.outer({k: x[k] for k in X_SHAPES}, y) + (x["h"] ** 3).sum()

    def inner(x: Params, y: Params) -> Tensor:
        return problem.inner({k: x[k] for k in X_SHAPES}, y)

    result = FiniteDifference(cg_iters=20, tol=1e-26)(outer, inner, x, y)
    # exact in any order: h = (0.5, -1) makes 3h² = (0.75, 3) and every step representable
    torch.testing.assert_close(result.grad["h"], 3 * x["h"] ** 2, rtol=0, atol=0)
    assert torch.equal(result.grad["unused"], torch.zeros(2, 2, dtype=DTYPE))
    core = {k: result.grad[k] for k in X_SHAPES}
    # float64, rounding u·|∇g| / μ as above: measured 2.15e-11 (all three kernels)
    assert rel_err(core, problem.surrogate(flat({k: x[k] for k in X_SHAPES}), flat(y))) <= 1e-8


# ================================================================ FirstOrder

LAMBDAS = (1.0, 10.0, 100.0, 1000.0, 10000.0)


def penalty_gradient(problem: Quadratic, xf: Tensor, lam: float) -> Tensor:
    """Closed form of ∇_x f(x, y_λ) + λ(∇_x g(x, y_λ) − ∇_x g(x, y*)) with exact y_λ, y*."""
    h = problem.C.T @ problem.C + lam * problem.A
    y_lam = torch.linalg.solve(
        h, problem.C.T @ problem.d - problem.E @ xf + lam * (problem.B @ xf - problem.c)
    )
    y_opt = problem.y_star(xf)
    return problem.e + problem.D @ xf + problem.E.T @ y_lam - lam * problem.B.T @ (y_lam - y_opt)


def test_first_order_error_falls_like_one_over_lambda(
    problem: Quadratic, record_property: Callable[[str, object], None]
) -> None:
    x, y = problem.point()
    xf = flat(x)
    reference = problem.surrogate(xf, flat(y))
    lipschitz_f = float(torch.linalg.eigvalsh(problem.C.T @ problem.C).max())  # ≈ 19.0
    lr = 0.05
    assert lr <= 1 / max(lipschitz_f, 10.0)  # the step rule of the docstring
    errors, state = [], None
    for lam in LAMBDAS:  # warm-started: each λ continues from the previous y_λ and z
        result = FirstOrder(lam=lam, inner_steps=500, lr=lr)(
            problem.outer, problem.inner, x, y, state=state
        )
        state = result.state
        assert (result.n_grad, result.n_hvp) == (3 * 500 + 3, 0)
        # the inner solves are converged: the estimate is the exact penalty gradient. float64;
        # what is left is the 500 steps' optimization error (λ·u = 1e-12 is the rounding):
        # measured 8.6e-13, 3.0e-12, 1.6e-6, 1.9e-5, 2.6e-5 for λ = 1 ... 1e4, the same on
        # default/avx2/avx512; bound 1e-4
        assert rel_err(result.grad, penalty_gradient(problem, xf, lam)) <= 1e-4
        errors.append(rel_err(result.grad, reference))
    record_property("first_order_relative_errors", dict(zip(LAMBDAS, errors, strict=True)))
    print(
        "\nFirstOrder relative error per λ:",
        {lam: f"{e:.3e}" for lam, e in zip(LAMBDAS, errors, strict=True)},
    )
    assert all(later < earlier for earlier, later in zip(errors, errors[1:], strict=False))
    by_lam = dict(zip(LAMBDAS, errors, strict=True))
    # measured 0.936, 0.635, 0.149, 1.716e-2, 1.719e-3: O(1/λ) (Lemma 4.7), ≈ 17/λ here. These
    # are the penalty's bias in float64, identical on default/avx2/avx512 (the optimization
    # error above is at most 1.5 % of them, rounding, λ·u = 1e-12, 6e-10 of them): the 1.7x
    # and 5.8x margins to 1e-2 are the O(1/λ) law's, and the ratio 1.002 (λ·error at 1e4 over
    # that at 1e3; bound 5 %) is the O(1/λ²) term and that optimization error
    assert by_lam[1000.0] > 1e-2
    assert by_lam[10000.0] <= 1e-2  # the λ documented in FirstOrder's docstring
    assert by_lam[10000.0] * 10000 == pytest.approx(by_lam[1000.0] * 1000, rel=0.05)


def test_first_order_v_tends_to_the_implicit_v(problem: Quadratic) -> None:
    x, y = problem.point()
    result = FirstOrder(lam=1e4, inner_steps=1500, lr=0.05)(problem.outer, problem.inner, x, y)
    v_exact = torch.linalg.solve(problem.A, problem.grad_y_f(flat(x), flat(y)))
    # float64: the O(1/λ) bias of λ·(z − y_λ), measured 1.76e-3 on default/avx2/avx512
    assert float((flat(result.v) - v_exact).norm() / v_exact.norm()) <= 1e-2


def inner_residuals(
    problem: Quadratic, x: Params, state: Params, lam: float
) -> tuple[float, float]:
    """(||∇_y(f + λg)(x, y_λ)||, ||∇_y g(x, z)||) for the state of a FirstOrder call."""
    xf = flat(x)
    y_lam = torch.cat([state[f"y_lambda:{k}"].reshape(-1) for k in Y_SHAPES])
    z = torch.cat([state[f"z:{k}"].reshape(-1) for k in Y_SHAPES])

    def grad_y_g(yf: Tensor) -> Tensor:
        return problem.A @ yf - problem.B @ xf + problem.c

    r_lam = problem.grad_y_f(xf, y_lam) + lam * grad_y_g(y_lam)
    return float(r_lam.norm()), float(grad_y_g(z).norm())


def test_first_order_state_round_trip_reduces_the_inner_residual(problem: Quadratic) -> None:
    x, y_opt = problem.point()
    y = {k: t + 0.5 for k, t in y_opt.items()}
    estimator = FirstOrder(lam=10.0, inner_steps=20, lr=0.05)
    first = estimator(problem.outer, problem.inner, x, y)
    assert sorted(first.state) == sorted(
        f"{key}:{k}" for key in ("y_lambda", "z") for k in Y_SHAPES
    )
    assert all(not t.requires_grad for t in first.state.values())
    assert {k: tuple(t.shape) for k, t in first.state.items()} == {
        f"{key}:{k}": s for key in ("y_lambda", "z") for k, s in Y_SHAPES.items()
    }
    second = FirstOrder(lam=10.0, inner_steps=200, lr=0.05)(
        problem.outer, problem.inner, x, y, state=first.state
    )
    r1, r2 = (
        inner_residuals(problem, x, first.state, 10.0),
        inner_residuals(problem, x, second.state, 10.0),
    )
    # float64 optimization progress, not rounding: measured ratios 4.3e-5 and 3.7e-3; errors
    # against the penalty gradient 0.40 -> 0.0015 and against ∇Φ 0.78 -> 0.64 (all kernels)
    assert r2[0] < 0.1 * r1[0] and r2[1] < 0.1 * r1[1]
    reference = problem.surrogate(flat(x), flat(y_opt))
    assert rel_err(second.grad, penalty_gradient(problem, flat(x), 10.0)) < rel_err(
        first.grad, penalty_gradient(problem, flat(x), 10.0)
    )
    assert rel_err(second.grad, reference) < rel_err(first.grad, reference)
    # zero further steps: the state passes through unchanged, y is not used
    again = FirstOrder(lam=10.0, inner_steps=0)(
        problem.outer, problem.inner, x, y_opt, state=second.state
    )
    assert all(torch.equal(again.state[k], second.state[k]) for k in second.state)
    # the same state through the same code: measured bit for bit equal on all three kernels
    torch.testing.assert_close(flat(again.grad), flat(second.grad), rtol=1e-12, atol=1e-12)
    assert (again.n_grad, again.n_hvp) == (3, 0)


def test_first_order_init_state_equals_no_state(problem: Quadratic) -> None:
    x, y = problem.point()
    estimator = FirstOrder(lam=5.0, inner_steps=7, lr=0.05)
    state = init_state(estimator, y)
    assert sorted(state) == sorted(f"{key}:{k}" for key in ("y_lambda", "z") for k in Y_SHAPES)
    assert all(torch.equal(state[f"z:{k}"], y[k]) and state[f"z:{k}"] is not y[k] for k in y)
    a = estimator(problem.outer, problem.inner, x, y)
    b = estimator(problem.outer, problem.inner, x, y, state=state)
    assert all(torch.equal(a.grad[k], b.grad[k]) for k in a.grad)
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert all(torch.equal(state[f"z:{k}"], y[k]) for k in y)  # the passed state is not mutated


def test_first_order_rejects_incomplete_or_misshaped_state(problem: Quadratic) -> None:
    x, y = problem.point()
    estimator = FirstOrder(inner_steps=1)
    state = init_state(estimator, y)
    partial = {k: t for k, t in state.items() if k != "z:u"}
    with pytest.raises(ValueError, match=re.escape("FirstOrder: state lacks 'z:u'")):
        estimator(problem.outer, problem.inner, x, y, state=partial)
    bad = {**state, "y_lambda:w": torch.zeros(5, dtype=DTYPE)}
    with pytest.raises(
        ValueError,
        match=re.escape("state['y_lambda:w'] must have the shape of y['w'], (4,), got (5,)"),
    ):
        estimator(problem.outer, problem.inner, x, y, state=bad)


# ================================================================ shared conformance

ESTIMATORS: dict[str, HypergradEstimator] = {
    "fd": FiniteDifference(cg_iters=20, tol=1e-26),
    "fd_sampled": FiniteDifference(num_coordinates=4, rescale=True),
    "first_order": FirstOrder(lam=10.0, inner_steps=5, lr=0.05),
}


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("requires_grad", [False, True])
def test_estimators_do_not_mutate_inputs(
    problem: Quadratic, name: str, requires_grad: bool
) -> None:
    estimator = ESTIMATORS[name]
    assert isinstance(estimator, HypergradEstimator)
    x, y = problem.point()
    x = {k: t.clone().requires_grad_(requires_grad) for k, t in x.items()}
    y = {k: t.clone().requires_grad_(requires_grad) for k, t in y.items()}
    before = {k: t.detach().clone() for k, t in (*x.items(), *y.items())}
    state = init_state(estimator, {k: t.detach() for k, t in y.items()})
    state_before = {k: t.clone() for k, t in state.items()}

    result = estimator(
        problem.outer, problem.inner, x, y, generator=torch.Generator().manual_seed(0), state=state
    )

    for k, t in (*x.items(), *y.items()):
        assert torch.equal(t.detach(), before[k]) and t.requires_grad is requires_grad
        assert t.grad is None
    assert all(torch.equal(state[k], state_before[k]) for k in state)
    assert all(
        not t.requires_grad
        for t in (*result.grad.values(), *result.v.values(), *result.state.values())
    )
    assert sorted(result.state) == sorted(init_state(estimator, y))


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_second_order_free_estimators_never_build_a_gradient_graph(
    problem: Quadratic, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    original = torch.autograd.grad

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(bool(kwargs.get("create_graph", False)))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.autograd, "grad", spy)
    x, y = problem.point()
    result = ESTIMATORS[name](
        problem.outer, problem.inner, x, y, generator=torch.Generator().manual_seed(0)
    )
    assert calls and not any(calls)  # create_graph=False everywhere: no double backward
    assert result.n_hvp == 0
    if name == "first_order":  # per step a gradient of f and of g at y_λ and of g at z
        steps = ESTIMATORS[name].inner_steps  # type: ignore[attr-defined]
        assert (len(calls), result.n_grad) == (3 * steps + 3, 3 * steps + 3)
    else:
        assert len(calls) == result.n_grad  # one autograd pass per gradient evaluation


def test_stateless_estimators_accept_generator_and_state(problem: Quadratic) -> None:
    x, y = problem.point()
    for estimator in (ImplicitCG(), Neumann(), FiniteDifference()):
        assert estimator.state_keys == () and init_state(estimator, y) == {}
        plain = estimator(problem.outer, problem.inner, x, y)
        keyed = estimator(
            problem.outer, problem.inner, x, y, generator=torch.Generator().manual_seed(1), state={}
        )
        assert keyed.state == {} and all(torch.equal(plain.grad[k], keyed.grad[k]) for k in x)
    assert FirstOrder.state_keys == ("y_lambda", "z")


# ================================================================ products


def dense_products(
    inner: Callable[[Params, Params], Tensor], x: Params, y: Params, v: Params
) -> tuple[Tensor, Tensor]:
    """(H_yy v, ∇²_xy g v) from dense matrices built by torch.autograd.functional."""
    x_shapes = {k: tuple(t.shape) for k, t in x.items()}
    y_shapes = {k: tuple(t.shape) for k, t in y.items()}
    xf, yf = flat(x), flat(y)
    h_yy = torch.autograd.functional.hessian(lambda b: inner(x, unflat(b, y_shapes)), yf)

    def grad_y_g(a: Tensor) -> Tensor:
        b = yf.clone().requires_grad_(True)
        (gy,) = torch.autograd.grad(
            inner(unflat(a, x_shapes), unflat(b, y_shapes)), b, create_graph=True
        )
        return gy

    h_xy = torch.autograd.functional.jacobian(grad_y_g, xf).T  # (dim x, dim y)
    return h_yy @ flat(v), h_xy @ flat(v)


@dataclass(frozen=True)
class TanhNet:
    """A small tanh network: x = (feature scale, log L2 weight), y = the network weights."""

    net: nn.Module
    x: Params
    y: Params
    features: Tensor
    targets: Tensor

    @staticmethod
    def build(seed: int = 7) -> TanhNet:
        gen = torch.Generator().manual_seed(seed)
        net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1)).to(DTYPE)
        y = {
            n: 0.5 * torch.randn(p.shape, generator=gen, dtype=DTYPE)
            for n, p in net.named_parameters()
        }
        x = {
            "feature_scale": 1.0 + 0.2 * torch.randn(4, generator=gen, dtype=DTYPE),
            "log_reg": torch.tensor(-1.0, dtype=DTYPE),
        }
        features = torch.randn(24, 4, generator=gen, dtype=DTYPE)
        targets = torch.sign(torch.randn(24, generator=gen, dtype=DTYPE))
        return TanhNet(net, x, y, features, targets)

    def inner(self, x: Params, y: Params) -> Tensor:
        logits = functional_call(self.net, y, (self.features * x["feature_scale"],)).squeeze(-1)
        data = nn.functional.softplus(-self.targets * logits).mean()
        return data + 0.5 * torch.exp(x["log_reg"]) * flat(y).pow(2).sum()

    def direction(self, seed: int = 8) -> Params:
        gen = torch.Generator().manual_seed(seed)
        return {k: torch.randn(t.shape, generator=gen, dtype=DTYPE) for k, t in self.y.items()}


@dataclass(frozen=True)
class Products:
    """The products of an estimator's linearization at (x, y) along v, keyed like x and y."""

    grad_y: Params
    hvp_yy: Params
    jvp_xy: Params
    n_grad: int
    n_hvp: int


def products(
    estimator: Estimator, inner: Callable[[Params, Params], Tensor], x: Params, y: Params, v: Params
) -> Products:
    system = estimator.linearize(inner, x, y)
    jxy, hyy = system.both(tuple(v[k] for k in y))
    return Products(
        grad_y=dict(zip(y, system.grad_y_g, strict=True)),
        hvp_yy=dict(zip(y, hyy, strict=True)),
        jvp_xy=dict(zip(x, jxy, strict=True)),
        n_grad=system.n_grad,
        n_hvp=system.n_hvp,
    )


def test_autograd_products_match_closed_form_on_quadratic(problem: Quadratic) -> None:
    x, y = problem.point()
    v = unflat(torch.linspace(-1.0, 2.0, Q, dtype=DTYPE), Y_SHAPES)
    result = products(Autograd(), problem.inner, x, y, v)
    assert isinstance(Autograd().linearize(problem.inner, x, y), InnerSystem)
    assert (result.n_grad, result.n_hvp) == (1, 1)
    # float64 products of a 10x10 matrix: measured at most 1.8e-15 apart (all three kernels)
    torch.testing.assert_close(flat(result.hvp_yy), problem.A @ flat(v), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(flat(result.jvp_xy), -problem.B.T @ flat(v), rtol=1e-10, atol=1e-10)
    grad_y = problem.A @ flat(y) - problem.B @ flat(x) + problem.c
    torch.testing.assert_close(flat(result.grad_y), grad_y, rtol=1e-10, atol=1e-10)
    dense_hvp, dense_jvp = dense_products(problem.inner, x, y, v)
    torch.testing.assert_close(flat(result.hvp_yy), dense_hvp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(flat(result.jvp_xy), dense_jvp, rtol=1e-10, atol=1e-10)


def test_autograd_products_match_dense_on_tanh_network() -> None:
    task = TanhNet.build()
    v = task.direction()
    result = products(Autograd(), task.inner, task.x, task.y, v)
    dense_hvp, dense_jvp = dense_products(task.inner, task.x, task.y, v)
    # float64: measured 1.1e-16 (hvp) and 2.2e-16 (jvp) apart, entries up to 0.85
    torch.testing.assert_close(flat(result.hvp_yy), dense_hvp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(flat(result.jvp_xy), dense_jvp, rtol=1e-10, atol=1e-10)
    assert list(result.jvp_xy) == list(task.x) and list(result.hvp_yy) == list(task.y)


def test_separate_products_equal_the_joint_one(problem: Quadratic) -> None:
    x, y = problem.point()
    v = tuple(unflat(torch.linspace(-1.0, 2.0, Q, dtype=DTYPE), Y_SHAPES).values())
    for estimator in (Autograd(), FiniteDifference()):
        system = estimator.linearize(problem.inner, x, y)
        jxy, hyy = system.both(v)
        # float64: measured bit for bit equal on default/avx2/avx512; bound 1e-12
        for a, b in zip(system.hvp(v), hyy, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        for a, b in zip(system.mixed(v), jxy, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fd_products_exact_on_quadratic(problem: Quadratic) -> None:
    x, y = problem.point()
    v = unflat(torch.linspace(-1.0, 2.0, Q, dtype=DTYPE), Y_SHAPES)
    exact = products(Autograd(), problem.inner, x, y, v)
    approx = products(FiniteDifference(), problem.inner, x, y, v)
    assert isinstance(FiniteDifference().linearize(problem.inner, x, y), FiniteDifferenceSystem)
    assert (approx.n_grad, approx.n_hvp) == (2, 0)
    # float64 forward quotients of an affine gradient: no truncation, rounding u·|∇g| / ε with
    # ε = hvp_mu / |v| = 1e-3 / 3.4, so 4e-13·|∇g|; measured 4.2e-12 (hvp), 1.7e-12 (jvp)
    # absolute, 0 (grad) on default/avx2/avx512; bounds 1e-9 + 1e-6·|value|
    for field in ("hvp_yy", "jvp_xy", "grad_y"):
        torch.testing.assert_close(
            flat(getattr(approx, field)), flat(getattr(exact, field)), rtol=1e-6, atol=1e-9
        )


def test_fd_products_close_on_tanh_network(record_property: Callable[[str, object], None]) -> None:
    task = TanhNet.build()
    v = task.direction()
    exact = products(Autograd(), task.inner, task.x, task.y, v)
    errors = {}
    for mu in (1e-2, 1e-3, 1e-4):
        approx = products(FiniteDifference(hvp_mu=mu), task.inner, task.x, task.y, v)
        errors[mu] = max(
            rel_err(approx.hvp_yy, flat(exact.hvp_yy)), rel_err(approx.jvp_xy, flat(exact.jvp_xy))
        )
    record_property("fd_products_relative_errors", errors)
    print(
        "\nfinite-difference products: relative error per hvp_mu:",
        {m: f"{e:.2e}" for m, e in errors.items()},
    )
    # The default's O(mu) forward-difference truncation, in float64: measured 1.0953e-2,
    # 1.0953e-3, 1.0953e-4 (exactly linear in mu) on default/avx2/avx512 alike; rounding,
    # u·|∇g| / mu ≈ 1e-12 at mu = 1e-4, cannot move them, so the 1.8x margin and the
    # factors of 10 in the ordering are the truncation law's, not noise
    assert errors[1e-3] <= 2e-3
    assert errors[1e-4] < errors[1e-3] < errors[1e-2]


@pytest.mark.parametrize("estimator", [Autograd(), FiniteDifference()], ids=["autograd", "fd"])
def test_products_contract(problem: Quadratic, estimator: Estimator) -> None:
    assert "products" in estimator.capabilities
    x, y = problem.point()
    x = {
        **{k: t.clone().requires_grad_(True) for k, t in x.items()},
        "unused": torch.ones(3, dtype=DTYPE),
    }
    before = {k: t.detach().clone() for k, t in (*x.items(), *y.items())}
    v = unflat(torch.ones(Q, dtype=DTYPE), Y_SHAPES)

    def inner(x: Params, y: Params) -> Tensor:
        return problem.inner({k: x[k] for k in X_SHAPES}, y)

    result = products(estimator, inner, x, y, v)
    assert torch.equal(result.jvp_xy["unused"], torch.zeros(3, dtype=DTYPE))
    for k, t in (*x.items(), *y.items()):
        assert torch.equal(t.detach(), before[k]) and t.grad is None
    for out in (result.grad_y, result.hvp_yy, result.jvp_xy):
        assert all(not t.requires_grad for t in out.values())
    zero = products(estimator, inner, x, y, {k: torch.zeros_like(t) for k, t in v.items()})
    assert all(torch.count_nonzero(t) == 0 for t in (*zero.hvp_yy.values(), *zero.jvp_xy.values()))


def test_fd_products_never_build_a_gradient_graph(
    problem: Quadratic, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    original = torch.autograd.grad

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(bool(kwargs.get("create_graph", False)))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.autograd, "grad", spy)
    x, y = problem.point()
    result = products(
        FiniteDifference(), problem.inner, x, y, unflat(torch.ones(Q, dtype=DTYPE), Y_SHAPES)
    )
    assert calls == [False, False] and result.n_grad == 2


# ================================================================ validation


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: FiniteDifference(num_coordinates=3, fraction=0.5),
            "give num_coordinates or fraction, not both",
        ),
        (
            lambda: FiniteDifference(num_coordinates=0),
            "num_coordinates\n  Input should be greater than or equal to 1",
        ),
        (lambda: FiniteDifference(fraction=0.0), "fraction\n  Input should be greater than 0"),
        (
            lambda: FiniteDifference(fraction=1.5),
            "fraction\n  Input should be less than or equal to 1",
        ),
        (lambda: FiniteDifference(mu=0.0), "mu\n  Input should be greater than 0"),
        (lambda: FiniteDifference(hvp_mu=-1.0), "hvp_mu\n  Input should be greater than 0"),
        (
            lambda: FiniteDifference(cg_iters=0),
            "cg_iters\n  Input should be greater than or equal to 1",
        ),
        (
            lambda: FiniteDifference(damping=-1.0),
            "damping\n  Input should be greater than or equal to 0",
        ),
        (lambda: FiniteDifference(as_printed=1), "as_printed\n  Input should be a valid boolean"),
        (lambda: FirstOrder(lam=0.0), "lam\n  Input should be greater than 0"),
        (
            lambda: FirstOrder(inner_steps=-1),
            "inner_steps\n  Input should be greater than or equal to 0",
        ),
        (lambda: FirstOrder(lr=float("nan")), "lr\n  Input should be a finite number"),
        (
            lambda: FiniteDifferenceSystem(
                lambda x, y: y["w"].sum(), {}, {"w": torch.ones(1)}, mu=0.0
            ),
            "FiniteDifferenceSystem.mu must be a finite number > 0",
        ),
    ],
)
def test_invalid_configuration_raises_with_a_sentence(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_fd_rejects_a_step_that_vanishes_in_float32() -> None:
    x = {"a": torch.tensor([1.0e6], dtype=torch.float32)}
    y = {"w": torch.tensor([0.0], dtype=torch.float32)}
    with pytest.raises(ValueError, match=r"FiniteDifference.mu = 0.001 vanishes next to x\['a'\]"):
        FiniteDifference(mu=1e-3)(
            lambda x, y: y["w"].sum(), lambda x, y: (y["w"] - x["a"]).pow(2).sum(), x, y
        )
    assert torch.equal(x["a"], torch.tensor([1.0e6]))


def test_new_estimators_are_frozen_and_hashable() -> None:
    with pytest.raises(ValidationError, match="frozen"):
        FirstOrder().lam = 3.0  # type: ignore[misc]
    assert {FiniteDifference(), FiniteDifference(), FirstOrder(), Autograd()} == {
        FiniteDifference(),
        FirstOrder(),
        Autograd(),
    }


# the examples print float results rounded to 4 to 8 decimals
@pytest.mark.float_sensitive
@pytest.mark.parametrize(
    "module",
    [radbo.hypergrad.finite_difference, radbo.hypergrad.first_order, radbo.hypergrad.autograd],
)
def test_docstring_examples(module: object) -> None:
    failures, tried = doctest.testmod(module)
    assert tried > 0 and failures == 0
