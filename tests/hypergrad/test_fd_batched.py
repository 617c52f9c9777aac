"""Finite differences batched over coordinates (issue 30, item 3): ``coordinate_batch = b``
evaluates ``∇_y g`` at ``b`` shifted copies of x in one call (under ``torch.vmap``) instead of
one call per coordinate. The arithmetic is the same, so results agree with ``b = 1`` to the
rounding of the difference quotients, counts and FLOP ledgers exactly.

Tolerance of the estimator-level checks (float64): both sides compute the same gradients of
``g``, whose entries may round differently in batched kernels by a few units of the last place
(``eps = 2^-52``, relative to the largest gradient entry ``G``). A difference quotient divides
such a rounding by the step ``h``, and the contraction with ``w`` sums ``dim y`` of them, so a
coordinate's term can move by about ``2 · dim y · ||w||_∞ · G · eps / h``; the checks allow
``16`` times that (``_quotient_rounding``). Measured on ``QuadraticInX`` at the default steps:
at most 4e-11 (central) and 1e-7 (forward, ``h = 1.5e-8``), both inside.
"""

from __future__ import annotations

import pytest
import torch

from radbo.hypergrad import FiniteDifference
from radbo.problem import at_points
from tests.helpers import flat, load_script
from tests.hypergrad.test_fd_central import QuadraticInX
from tests.simulation.test_batched import FULL, assert_runs_agree, trajectory

pytestmark = pytest.mark.float_sensitive

EPS64 = torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def qx() -> QuadraticInX:
    return QuadraticInX.random(0)


def _quotient_rounding(est: FiniteDifference, qx: QuadraticInX, x, y, result) -> float:
    """The bound of the module docstring for one estimate (``w = −v``)."""
    xf = flat(x)
    mu = est.step(xf.dtype)
    down = xf if est.scheme == "forward" else xf - mu
    step = float(((xf + mu) - down).abs().min())
    with torch.enable_grad():
        yl = {k: t.detach().requires_grad_(True) for k, t in y.items()}
        (g,) = torch.autograd.grad(qx.inner(x, yl), list(yl.values()))
    w = max(float(t.abs().max()) for t in result.v.values())
    dim_y = sum(t.numel() for t in y.values())
    return 16 * 2 * dim_y * w * float(g.abs().max()) * EPS64 / step


@pytest.mark.parametrize("scheme", ["central", "forward"])
@pytest.mark.parametrize("size", [2, 3, 5, 64])
def test_a_batch_of_coordinates_equals_one_at_a_time(qx, scheme, size) -> None:
    """All 5 coordinates of x, in batches of 2 (2 + 2 + 1), 3, 5 and 64 (more than |P|)."""
    x, y = qx.point()
    one = FiniteDifference(scheme=scheme, cg_iters=12)
    many = FiniteDifference(scheme=scheme, cg_iters=12, coordinate_batch=size)
    a, b = one(qx.outer, qx.inner, x, y), many(qx.outer, qx.inner, x, y)
    bound = _quotient_rounding(one, qx, x, y, a)
    assert bound < 1e-4 * float(flat(a.grad).abs().max())  # the check is not vacuous
    for k in x:
        torch.testing.assert_close(a.grad[k], b.grad[k], rtol=0.0, atol=bound)
    for k in y:  # v comes from CG, before any coordinate: the same computation
        assert torch.equal(a.v[k], b.v[k])
    assert (a.n_grad, a.n_hvp) == (b.n_grad, b.n_hvp)
    # and both are the hypergradient (central: exact on this problem up to rounding)
    if scheme == "central":
        exact = qx.exact(flat(x), flat(y))
        torch.testing.assert_close(flat(b.grad), exact, rtol=1e-9, atol=1e-12)


def test_a_cohort_batched_over_coordinates_equals_one_at_a_time(qx) -> None:
    """Two clients, each its own 3 of the 5 coordinates, in batches of 2."""
    points = [qx.point(seed) for seed in (1, 2)]
    x = {k: torch.stack([p[0][k] for p in points]) for k in ("a", "b")}
    y = {"w": torch.stack([p[1]["w"] for p in points])}
    one = FiniteDifference(num_coordinates=3, cg_iters=12)
    many = FiniteDifference(num_coordinates=3, cg_iters=12, coordinate_batch=2)
    gen = torch.Generator().manual_seed(0)
    draws = {"coordinates": torch.stack([one.sample_coordinates(5, gen) for _ in points])}
    assert not torch.equal(draws["coordinates"][0], draws["coordinates"][1])
    a = one(qx.outer, qx.inner, x, y, draws=draws, lead=1)
    b = many(qx.outer, qx.inner, x, y, draws=draws, lead=1)
    for c, (xc, yc) in enumerate(points):
        ac = type(a)({k: t[c] for k, t in a.grad.items()}, {k: t[c] for k, t in a.v.items()}, 0, 0)
        bound = _quotient_rounding(one, qx, xc, yc, ac)
        for k in x:
            torch.testing.assert_close(a.grad[k][c], b.grad[k][c], rtol=0.0, atol=bound)
    assert torch.equal(a.n_grad, b.n_grad)


def test_at_points_evaluates_each_point() -> None:
    def loss(x, y):
        return (x["a"] * y["b"]).sum()

    x = {"a": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])}
    y = {"b": torch.tensor([[1.0, 1.0], [0.5, 0.5], [2.0, 0.0]])}
    assert at_points(loss)(x, y).tolist() == [3.0, 3.5, 10.0]


def test_a_vanishing_step_is_refused_in_a_batch_too() -> None:
    """The one-line error of ``mu`` lost in rounding names the coordinate in a batch as well."""

    def g(x, y):
        return 0.5 * (y["w"] - x["a"].sum()).pow(2).sum()

    def f(x, y):
        return y["w"].pow(2).sum()

    x = {"a": torch.tensor([1.0, 1e9], dtype=torch.float32)}
    y = {"w": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"vanishes next to x\['a'\] = 1000000000.0"):
        FiniteDifference(mu=1e-3, coordinate_batch=2)(f, g, x, y)


# ------------------------------------------------------------------- whole runs (float64)
# A CNN with BatchNorm in x, so that the batched evaluation runs the model's BatchNorm layers
# under torch.vmap on per-point copies of the running statistics (radbo.problem.BoundLoss).
RAFBO_CNN = dict(
    FULL,
    model={"name": "cnn", "channels": [4, 8]},
    algorithm={"name": "rafbo", "inner_steps": 2, "batch_size": 8, "outer_batch_size": 8},
)


@pytest.mark.parametrize("backend", ["sequential", "batched"])
@pytest.mark.parametrize("scheme", ["central", "forward"])
def test_rafbo_runs_batched_over_coordinates_agree_with_one_at_a_time(backend, scheme) -> None:
    """Three rounds of RAFBO on the CNN, 20 sampled coordinates per client in batches of 8
    (8 + 8 + 4): states to float64 rounding amplified by the quotient (rtol 1e-8: with mu =
    1e-3 a rounding of eps in a gradient moves a term by about eps / 1e-3 = 2e-13 relative,
    and three rounds of training carry it), ledgers (FLOPs included) and counts exactly."""
    estimator = {
        "name": "finite_difference",
        "scheme": scheme,
        "num_coordinates": 20,
        "mu": 1e-3,
        "cg_iters": 3,
    }
    runtime = {**FULL["runtime"], "backend": backend}
    one = trajectory(dict(RAFBO_CNN, estimator=estimator, runtime=runtime))
    many = trajectory(
        dict(RAFBO_CNN, estimator={**estimator, "coordinate_batch": 8}, runtime=runtime)
    )
    assert_runs_agree(one, many, rtol=1e-8)


def test_the_benchmark_script_runs_and_its_ledgers_agree() -> None:
    """benchmarks/fd_batch.py at its smallest: two rounds of examples/rafbo.toml, batch 1 and
    64, the same FLOP ledger."""
    import argparse
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "fd_batch.py"
    script = load_script(path, "fd_batch")
    args = argparse.Namespace(rounds=2, device="cpu", all_coordinates=False)
    (_, one), (_, many) = script.one_run(1, args), script.one_run(64, args)
    assert one == many > 0
