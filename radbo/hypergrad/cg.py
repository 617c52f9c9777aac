"""Implicit hypergradient with ``v`` solved by conjugate gradient (AID-CG)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from radbo.autodiff import ImplicitSystem, solve_cg
from radbo.hypergrad.base import (
    ESTIMATORS,
    Estimator,
    FiniteFloat,
    HypergradResult,
    implicit_result,
    require_y,
)
from radbo.limits import Steps
from radbo.loops import cg_product
from radbo.typing import BilevelLoss, Params

__all__ = ["ImplicitCG", "solve_cg"]


@ESTIMATORS.register
class ImplicitCG(Estimator):
    """Exact implicit hypergradient with ``v`` solved by conjugate gradient
    (``[estimator] name = "cg"``).

    Computes eq. (7) of the RABO paper (``papers/rabo_rafbo.txt``; Lemma 1 / eq. (3) of
    FedMBO) at the given ``(x, y)``::

        grad = ∇_x f(x, y) − ∇²_xy g(x, y) · v,     (∇²_yy g(x, y) + damping·I) v = ∇_y f(x, y)

    with ``v`` from :func:`~radbo.autodiff.solve_cg`, whose Hessian-vector products are
    autograd double backward through one graph of ``∇_y g(x, y)`` (see
    :class:`~radbo.autodiff.ImplicitSystem`).

    Attributes:
        max_iter: at most this many CG iterations, ``>= 1``; default ``10``.
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

    name: Literal["cg"] = "cg"
    max_iter: Steps = Field(
        10, ge=1, description="at most this many CG iterations (<= 10,000 without --force)"
    )
    tol: FiniteFloat = Field(1e-10, ge=0, description="relative squared-residual tolerance")
    damping: FiniteFloat = Field(0.0, ge=0, description="added to the diagonal of H_yy")

    capabilities: ClassVar[frozenset[str]] = frozenset({"hypergradient"})

    def __call__(
        self,
        outer_loss: BilevelLoss,
        inner_loss: BilevelLoss,
        x: Params,
        y: Params,
        *,
        generator: torch.Generator | None = None,
        state: Params | None = None,
        draws: dict[str, Tensor] | None = None,
        lead: int = 0,
    ) -> HypergradResult:
        """The hypergradient at ``(x, y)``; deterministic and stateless, so ``generator``,
        ``draws`` and ``state`` are accepted for the common signature and ignored."""
        require_y(y)
        system = ImplicitSystem(outer_loss, inner_loss, x, y, lead=lead)
        v, calls = solve_cg(
            cg_product(system.hvp),  # the same product every iteration: a FLOP count counts one
            system.grad_y_f,
            max_iter=self.max_iter,
            tol=self.tol,
            damping=self.damping,
            lead=lead,
        )
        correction = system.mixed(v)
        return implicit_result(
            system.x_names, system.y_names, system.grad_x_f, correction, v, 2, calls + 1
        )
