"""Fully first-order hypergradient of the penalty reformulation (FedSVRBGD-FO)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from radbo.autodiff import axpy, penalty_gradients
from radbo.hypergrad.base import (
    ESTIMATORS,
    Estimator,
    FiniteFloat,
    HypergradResult,
    MemoryFootprint,
    require_y,
    state_blocks,
)
from radbo.limits import Steps, StepSize
from radbo.loops import Work, local_steps
from radbo.typing import BilevelLoss, Params

__all__ = ["FirstOrder"]


@ESTIMATORS.register
class FirstOrder(Estimator):
    """First-order hypergradient of the penalty (value-function) reformulation
    (``[estimator] name = "first_order"``).

    Follows Zhang et al., "Federated Stochastic Bilevel Optimization with Fully First-Order
    Gradients" (FedSVRBGD-FO, IJCAI 2025; ``papers/fedsbo_first_order.txt``, after Kwon et al.,
    "A Fully First-Order Method for Stochastic Bilevel Optimization", ICML 2023,
    arXiv:2301.10945): the problem is rewritten as the constrained problem eq. (2),
    ``min f(x, y) s.t. g(x, y) − g(x, y*(x)) <= 0``, and penalised into the minimax problem
    eq. (3)-(4), ``min_{x,y} max_z L_λ(x, y, z) = f(x, y) + λ (g(x, y) − g(x, z))``. At the
    solutions ``y_λ = argmin_y f + λ g`` and ``z = argmin_y g = y*(x)`` the x-gradient of
    ``L_λ`` -- eq. (6) without the STORM variance reduction, ``m_x = u_1 + λ (u_2 − u_3)`` -- is::

        grad = ∇_x f(x, y_λ) + λ (∇_x g(x, y_λ) − ∇_x g(x, z))

    which uses first-order gradients only (no Hessian, no Jacobian, no double backward).
    By Lemma 4.7 (for ``λ > 2 L_f / μ``) it differs from the true hypergradient by
    ``O(ℓ κ³ / λ)``, *given accurate inner solves*: errors in ``y_λ`` and ``z`` are
    multiplied by ``λ``, so a large ``λ`` needs correspondingly accurate (or warm-started)
    inner variables. On the quadratic test problem of ``tests/hypergrad/test_hypergrad_fd_fo.py``
    (``∇²_yy g`` with eigenvalues in ``[0.5, 10]``, ``L_f ≈ 19``, ``lr = 0.05``, converged
    inner solves) the relative error is 0.94, 0.63, 0.15, 1.7e-2 and 1.7e-3 for
    ``λ = 1, 10, 100, 10³, 10⁴`` -- about ``17 / λ`` -- so it is below ``1e-2`` at
    **λ = 10⁴** (but not yet at ``λ = 10³``).

    Each call runs ``inner_steps`` gradient steps, from the previous call's ``state`` when
    given (else from ``y``), on both auxiliary variables with ``x`` fixed::

        y_λ ← y_λ − lr / (1 + λ) · (∇_y f(x, y_λ) + λ ∇_y g(x, y_λ))
        z   ← z   − lr · ∇_y g(x, z)

    (the gradients are :func:`radbo.autodiff.penalty_gradients`, the one implementation of
    the penalty oracle that SimFBO / ShroFBO's first-order mode and FedSVRBGD-FO use too).

    Scaling the ``y_λ`` step by ``1 / (1 + λ)`` keeps it stable for every ``λ``: ``f + λ g``
    is ``(L_f + λ L_g)``-smooth, and ``(L_f + λ L_g) / (1 + λ) <= max(L_f, L_g)``, so both
    updates are stable whenever ``lr < 2 / max(L_f, L_g)`` (``lr = 1 / max(L_f, L_g)`` is the
    usual choice), and for large ``λ`` the ``y_λ`` update contracts like the ``z`` update
    (rate ``1 − lr · μ_g``), independently of ``λ``.

    Attributes:
        lam: the penalty ``λ > 0``; default ``10``.
        inner_steps: gradient steps on each of ``y_λ`` and ``z`` per call, ``>= 0``; default
            ``10``.
        lr: the step size ``> 0`` (see above); default ``0.1``.

    State: ``state_keys = ("y_lambda", "z")``; ``HypergradResult.state`` holds the updated
    ``y_λ`` and ``z`` (keys ``"y_lambda:<name>"``, ``"z:<name>"``) to pass as ``state=`` to
    the next call. ``HypergradResult.v`` is ``λ (z − y_λ)``, which tends to
    ``[∇²_yy g]⁻¹ ∇_y f`` as ``λ → ∞`` (so ``grad ≈ ∇_x f − ∇²_xy g · v`` as for the
    implicit estimators).

    Cost (``n_hvp = 0``): ``n_grad = 3 · inner_steps + 3``, counting a gradient of each loss
    separately -- per step one of ``f`` and one of ``g`` at ``y_λ`` and one of ``g`` at ``z``;
    then ``∇_x f`` and ``∇_x g`` at ``y_λ`` and ``∇_x g`` at ``z``.

    >>> import torch
    >>> f = lambda x, y: 0.5 * (y["w"] - 1.0).pow(2).sum()
    >>> g = lambda x, y: 0.5 * (2.0 * y["w"] - x["a"]).pow(2).sum()  # y* = a/2, Φ'(4) = 0.5
    >>> x = {"a": torch.tensor([4.0], dtype=torch.float64)}
    >>> y = {"w": torch.tensor([2.0], dtype=torch.float64)}
    >>> r = FirstOrder(lam=100.0, inner_steps=200, lr=0.2)(f, g, x, y)
    >>> round(float(r.grad["a"]), 4), r.n_grad, r.n_hvp, sorted(r.state)  # 0.5 · 400/401
    (0.4988, 603, 0, ['y_lambda:w', 'z:w'])
    """

    name: Literal["first_order"] = "first_order"
    lam: FiniteFloat = Field(10.0, gt=0, description="penalty lambda")
    inner_steps: Steps = Field(
        10, ge=0, description="steps on y_lambda and z per call (<= 10,000 without --force)"
    )
    lr: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="step size of those steps (<= 1000 without --force)",
    )

    capabilities: ClassVar[frozenset[str]] = frozenset({"hypergradient", "penalty"})
    penalty_fields: ClassVar[frozenset[str]] = frozenset({"lam"})
    state_keys: ClassVar[tuple[str, ...]] = ("y_lambda", "z")

    @classmethod
    def hypergradient_bytes(cls, footprint: MemoryFootprint) -> int:
        """The auxiliary copies ``y_λ`` and ``z`` of y (2|y|); no second-order graph."""
        return 2 * footprint.y_bytes

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
        """The estimate at ``x``, warm-started from ``state``; ``generator`` and ``draws``
        are ignored."""
        require_y(y)
        for k, t in {**x, **y}.items():
            if not isinstance(t, Tensor) or not t.is_floating_point():
                kind = type(t).__name__ if not isinstance(t, Tensor) else f"dtype {t.dtype}"
                raise ValueError(f"{k!r} must be a floating-point tensor, got {kind}.")
        y_lam = state_blocks("FirstOrder", "y_lambda", state, y)
        z = state_blocks("FirstOrder", "z", state, y)
        lam = self.lam
        step_y = self.lr / (1.0 + lam)

        def step(t: int, carry: tuple[Params, Params]) -> tuple[tuple[Params, Params], Work]:
            y_lam, z = carry
            oracle = penalty_gradients(
                outer_loss, inner_loss, x, y_lam, z, lam, with_x=False, lead=lead
            )
            moved = (axpy(-step_y, oracle.y, y_lam), axpy(-self.lr, oracle.z, z))
            return moved, Work(oracle.n_grad)

        steps = local_steps(step, (y_lam, z), self.inner_steps, name="first_order.inner")
        y_lam, z = steps.carry
        oracle = penalty_gradients(outer_loss, inner_loss, x, y_lam, z, lam, lead=lead)
        new_state = {f"y_lambda:{k}": t for k, t in y_lam.items()}
        new_state.update({f"z:{k}": t for k, t in z.items()})
        return HypergradResult(
            grad=oracle.x,
            v={k: lam * (z[k] - y_lam[k]) for k in y},
            n_grad=steps.n_grad[0] + oracle.n_grad,
            n_hvp=0,
            state=new_state,
        )
