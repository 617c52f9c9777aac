"""Implicit hypergradient with ``v`` solved by conjugate gradient (AID-CG)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from radbo.hypergrad.base import (
    HypergradResult,
    ImplicitSystem,
    TensorTuple,
    _check_finite,
    _check_int,
    tuple_axpy,
    tuple_dot,
)
from radbo.typing import BilevelLoss, Params

__all__ = ["ImplicitCG", "solve_cg"]


def solve_cg(
    matvec: Callable[[TensorTuple], TensorTuple],
    b: Sequence[Tensor],
    *,
    max_iter: int,
    tol: float = 1e-10,
    damping: float = 0.0,
    x0: Sequence[Tensor] | None = None,
) -> tuple[TensorTuple, int]:
    """Solve ``(A + damping·I) v = b`` by conjugate gradient on tuples of tensors.

    ``A`` is given only through ``matvec(u) -> A u`` and must be symmetric positive definite
    (after damping) on the tuple space of ``b``; tensors may have any shapes and are never
    flattened together.

    Args:
        matvec: the product ``u -> A u``; ``u`` and the result are tuples shaped like ``b``.
        b: the right-hand side.
        max_iter: at most this many CG iterations (one ``matvec`` each), ``>= 1``.
        tol: relative stopping tolerance on the *squared* residual norm: CG stops as soon as
            ``||b − (A + damping·I) v||² <= tol · ||b||²`` (so the default ``1e-10`` is a
            relative residual of ``1e-5``). ``>= 0``; default ``1e-10``.
        damping: ``λ >= 0`` added to the diagonal of ``A``; default ``0``.
        x0: optional warm start shaped like ``b`` (default zeros). Computing its residual
            costs one extra ``matvec``.

    Returns:
        ``(v, n_matvec)``: the solution and the number of ``matvec`` calls made (the CG
        iterations, plus one when ``x0`` is given). If ``b`` is zero and no ``x0`` is given,
        ``v`` is zero and no ``matvec`` is made.

    If a search direction ``p`` shows non-positive curvature (``pᵀ(A + λI)p <= 0``, possible
    when ``A`` is indefinite, e.g. a non-convex inner problem with too little damping), CG
    stops there and returns its current iterate -- the truncated CG of Newton-CG (Nocedal &
    Wright, *Numerical Optimization*, Alg. 7.1); raise ``damping`` to avoid it.

    >>> import torch
    >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    >>> (v,), n = solve_cg(lambda u: (A @ u[0],), (torch.tensor([1.0, 2.0], dtype=A.dtype),),
    ...                    max_iter=10, tol=1e-20)
    >>> n, torch.allclose(v, torch.linalg.solve(A, torch.tensor([1.0, 2.0], dtype=A.dtype)))
    (2, True)
    """
    _check_int("solve_cg", "max_iter", max_iter, low=1)
    _check_finite("solve_cg", "tol", tol, low=0, strict=False)
    _check_finite("solve_cg", "damping", damping, low=0, strict=False)
    b = tuple(b)

    def apply(u: TensorTuple) -> TensorTuple:
        au = tuple(matvec(u))
        if len(au) != len(u):
            raise ValueError(
                f"solve_cg: matvec returned {len(au)} tensors for an input of {len(u)}."
            )
        return tuple_axpy(damping, u, au) if damping != 0.0 else au

    n_matvec = 0
    if x0 is None:
        sol: TensorTuple = tuple(torch.zeros_like(bi) for bi in b)
        r: TensorTuple = b
    else:
        sol = tuple(x0)
        if len(sol) != len(b) or any(s.shape != bi.shape for s, bi in zip(sol, b, strict=True)):
            raise ValueError(
                "solve_cg.x0 must have the shapes of b, got "
                f"{[tuple(s.shape) for s in sol]} for b of {[tuple(bi.shape) for bi in b]}."
            )
        r = tuple_axpy(-1.0, apply(sol), b)
        n_matvec += 1

    threshold = tol * float(tuple_dot(b, b))
    rs = float(tuple_dot(r, r))
    p = r
    iterations = 0
    while rs > threshold and iterations < max_iter:
        ap = apply(p)
        n_matvec += 1
        iterations += 1
        curvature = float(tuple_dot(p, ap))
        if not curvature > 0.0:  # non-positive curvature (or NaN): truncate
            break
        alpha = rs / curvature
        sol = tuple_axpy(alpha, p, sol)
        r = tuple_axpy(-alpha, ap, r)
        rs_new = float(tuple_dot(r, r))
        p = tuple_axpy(rs_new / rs, p, r)
        rs = rs_new
    return sol, n_matvec


@dataclass(frozen=True)
class ImplicitCG:
    """Exact implicit hypergradient with ``v`` solved by conjugate gradient.

    Computes eq. (7) of the RABO paper (``papers/rabo_rafbo.txt``; Lemma 1 / eq. (3) of
    FedMBO) at the given ``(x, y)``::

        grad = ∇_x f(x, y) − ∇²_xy g(x, y) · v,     (∇²_yy g(x, y) + damping·I) v = ∇_y f(x, y)

    with ``v`` from :func:`solve_cg`, whose Hessian-vector products are autograd double
    backward through one graph of ``∇_y g(x, y)`` (see :class:`ImplicitSystem`).

    Attributes:
        max_iter: at most this many CG iterations, ``>= 1``; default ``20``.
        tol: CG stops when ``||r||² <= tol · ||∇_y f||²`` (squared residual norm, relative);
            ``>= 0``; default ``1e-10``.
        damping: ``λ >= 0`` added to ``∇²_yy g``, i.e. the estimator is exact for the inner
            problem ``g + (λ/2)||y||²``. It regularises ill-conditioned or non-convex inner
            problems (CG needs ``∇²_yy g + λI`` positive definite) at the price of a bias;
            default ``0`` (exact).

    Cost: ``n_grad = 2`` (one pass of f w.r.t. (x, y), one of g w.r.t. y) and
    ``n_hvp = CG iterations + 1`` (the ``H_yy`` products plus the final ``∇²_xy g · v``).

    >>> import torch
    >>> f = lambda x, y: 0.5 * (y["w"] - 1.0).pow(2).sum()      # outer: pull y to 1
    >>> g = lambda x, y: 0.5 * (2.0 * y["w"] - x["a"]).pow(2).sum()  # y*(x) = x / 2
    >>> r = ImplicitCG()(f, g, {"a": torch.tensor([4.0])}, {"w": torch.tensor([2.0])})
    >>> r.grad["a"], r.n_grad, r.n_hvp   # Φ(a) = (a/2 − 1)²/2, Φ'(4) = 0.5
    (tensor([0.5000]), 2, 2)
    """

    max_iter: int = 20
    tol: float = 1e-10
    damping: float = 0.0

    state_keys: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        _check_int("ImplicitCG", "max_iter", self.max_iter, low=1)
        _check_finite("ImplicitCG", "tol", self.tol, low=0, strict=False)
        _check_finite("ImplicitCG", "damping", self.damping, low=0, strict=False)

    def __call__(
        self,
        outer_loss: BilevelLoss,
        inner_loss: BilevelLoss,
        x: Params,
        y: Params,
        *,
        generator: torch.Generator | None = None,
        state: Params | None = None,
    ) -> HypergradResult:
        """The hypergradient at ``(x, y)``; deterministic and stateless, so ``generator``
        and ``state`` are accepted for the common signature and ignored."""
        system = ImplicitSystem(outer_loss, inner_loss, x, y)
        v, _ = solve_cg(
            system.hvp,
            system.grad_y_f,
            max_iter=self.max_iter,
            tol=self.tol,
            damping=self.damping,
        )
        return system.result(v)
