"""Second-order-free hypergradient by coordinate-wise finite differences (RAFBO, Alg. 2)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from radbo.hypergrad.base import (
    HypergradResult,
    TensorTuple,
    _check_finite,
    _check_int,
    _leaf,
    _loss_grads,
    tuple_axpy,
    tuple_dot,
)
from radbo.hypergrad.cg import solve_cg
from radbo.typing import BilevelLoss, Params

__all__ = ["FiniteDifference"]


def _norm(u: TensorTuple) -> float:
    return math.sqrt(float(tuple_dot(u, u))) if u else 0.0


@dataclass(frozen=True)
class FiniteDifference:
    """Second-order-free local hypergradient on a sampled coordinate set (RAFBO).

    Follows Alg. 2 and eq. (10) of the RABO paper (``papers/rabo_rafbo.txt``): for every
    coordinate ``p`` of a set ``P`` sampled from the coordinates of ``x``, the column
    ``∇²_{y x_p} g`` is replaced by the deterministic forward difference::

        δ_p = (∇_y g(x + μ e_p, y) − ∇_y g(x, y)) / μ                       (eq. (10))

    **Correction of the printed formula.** Alg. 2 line 7 contracts ``δ_p`` with ``∇_y f``,
    which approximates ``(∇²_xy g · ∇_y f)_p``; but the hypergradient (eq. (9)) needs
    ``∂y*/∂x_p = −[∇²_yy g]⁻¹ ∇²_{y x_p} g``, so the sign and the inverse Hessian are missing.
    By default this estimator computes the correct contraction::

        w = −[∇²_yy g + damping·I]⁻¹ ∇_y f                   (CG, ``cg_iters`` iterations)
        grad_p = ∇_{x_p} f + scale · ⟨δ_p, w⟩    for p ∈ P
        grad_p = ∇_{x_p} f                       for p ∉ P

    where the Hessian-vector products inside CG are themselves forward differences of
    ``∇_y g`` (no double backward anywhere)::

        H u ≈ (∇_y g(x, y + ε u) − ∇_y g(x, y)) / ε,      ε = hvp_mu / max(||u||, tiny)

    so the y-step ``ε u`` always has norm ``hvp_mu`` (``||·||`` is the norm over all
    tensors of ``y``; ``u = 0`` gives ``H u = 0``). With ``as_printed=True`` the estimator
    instead returns eq. (10) / Alg. 2 exactly as printed, ``grad_p = ∇_{x_p} f + scale ·
    ⟨δ_p, ∇_y f⟩`` (no CG); this is *not* a hypergradient and is kept only to reproduce the
    paper -- on the quadratic test problem of ``tests/test_hypergrad_fd_fo.py`` its relative
    error is 1.65 (165 %), against about ``6e-13`` for the corrected form.

    **Coordinates outside P** get the direct term ``∇_x f`` only. With ``scale = 1``
    (``rescale=False``, the paper's choice) the estimate is biased whenever ``|P| < dim x``:
    its expectation over ``P`` is ``∇_x f + (|P| / d) · (indirect term)``. ``rescale=True``
    uses ``scale = d / |P|``, which makes the estimate unbiased over the draw of ``P`` (up to
    the finite-difference and CG errors) at the price of a variance growing like ``d / |P|``.
    On a quadratic ``g`` both differences are exact up to rounding, so with ``|P| = d`` the
    estimator matches the implicit hypergradient of eq. (7) to CG accuracy.

    Attributes:
        num_coordinates: ``|P|``, the number of coordinates perturbed, ``>= 1``; ``|P|`` is
            ``min(num_coordinates, dim x)``. Default ``None``: all coordinates.
        fraction: alternatively ``|P| = ceil(fraction · dim x)``, ``0 < fraction <= 1``. At
            most one of ``num_coordinates`` and ``fraction`` may be set (neither: all).
        mu: the coordinate step ``μ > 0`` of eq. (10); the quotient uses the step actually
            representable, ``(x_p + μ) − x_p``. Default ``1e-3``.
        hvp_mu: the norm ``> 0`` of the y-step of the finite-difference Hessian-vector
            products. Default ``1e-3``.
        cg_iters: at most this many CG iterations (each one gradient of ``g``), ``>= 1``;
            default ``10``.
        tol: CG's relative squared-residual tolerance (see :func:`solve_cg`), ``>= 0``;
            default ``1e-10``.
        damping: ``>= 0`` added to ``∇²_yy g`` in CG, as in :class:`ImplicitCG`; default ``0``.
        as_printed: use ``∇_y f`` in place of ``w`` (eq. (10) as printed); default ``False``.
        rescale: multiply the indirect term by ``d / |P|`` (unbiased over ``P``); default
            ``False``.

    ``P`` is drawn uniformly without replacement from the ``d = dim x`` coordinates of all
    tensors of ``x`` (flattened in dict order) with ``torch.randperm(d, generator=...)``;
    coordinates are evaluated in increasing order. When ``|P| = d`` no random number is
    drawn and ``generator`` may be ``None``; otherwise it is required.
    :meth:`sample_coordinates` returns the set a given generator yields.

    Cost (``n_hvp = 0``, second-order free): ``n_grad = 2 + (CG iterations) + |P|`` -- one
    gradient of ``f`` with respect to ``(x, y)``, one of ``g`` at ``(x, y)``, one of ``g`` per
    CG iteration and one per coordinate of ``P`` (``as_printed``: ``2 + |P|``). That is *more*
    FLOPs than :class:`ImplicitCG` with as many iterations, for every ``|P| >= 1``: an autograd
    Hessian-vector product costs at most about one gradient (far less when y is a small head,
    since it reuses the saved activations), and autograd's mixed product covers all of x in
    one backward pass where a difference covers one coordinate per gradient
    (``tests/test_flops.py`` has the exact count; ``benchmarks/hypergrad_flops.py``). What the
    estimator saves is second-order machinery: no ``create_graph``, no double backward.

    Precision: the differences are accurate when ``∇_y g`` is smooth in y (a linear head or a
    logistic regression: about ``4e-4`` relative error per product at the default steps in
    float32). When y holds ReLU layers, a step can cross activation kinks and float32 cancels
    digits; raise ``hvp_mu`` or work in float64 there.

    ``HypergradResult.v`` is ``−w = [∇²_yy g]⁻¹ ∇_y f`` as solved by CG (``−∇_y f`` with
    ``as_printed``), so that ``grad_p = ∇_{x_p} f − scale · ⟨δ_p, v⟩`` for ``p ∈ P``.

    >>> import torch
    >>> f = lambda x, y: 0.5 * (y["w"] - 1.0).pow(2).sum()          # outer: pull y to 1
    >>> g = lambda x, y: 0.5 * (2.0 * y["w"] - x["a"]).pow(2).sum()  # y*(x) = x / 2
    >>> x, y = {"a": torch.tensor([4.0], dtype=torch.float64)}, {"w": torch.tensor([2.0],
    ...                                                                dtype=torch.float64)}
    >>> r = FiniteDifference()(f, g, x, y)      # Φ(a) = (a/2 − 1)²/2, Φ'(4) = 0.5
    >>> round(float(r.grad["a"]), 8), r.n_grad, r.n_hvp
    (0.5, 4, 0)
    >>> round(float(FiniteDifference(as_printed=True)(f, g, x, y).grad["a"]), 8)  # wrong
    -2.0
    """

    num_coordinates: int | None = None
    fraction: float | None = None
    mu: float = 1e-3
    hvp_mu: float = 1e-3
    cg_iters: int = 10
    tol: float = 1e-10
    damping: float = 0.0
    as_printed: bool = False
    rescale: bool = False

    state_keys: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.num_coordinates is not None and self.fraction is not None:
            raise ValueError(
                "FiniteDifference: set at most one of num_coordinates and fraction, got "
                f"num_coordinates={self.num_coordinates!r} and fraction={self.fraction!r}."
            )
        if self.num_coordinates is not None:
            _check_int("FiniteDifference", "num_coordinates", self.num_coordinates, low=1)
        if self.fraction is not None:
            _check_finite("FiniteDifference", "fraction", self.fraction, low=0, strict=True)
            if self.fraction > 1:
                raise ValueError(
                    f"FiniteDifference.fraction must be in (0, 1], got {self.fraction!r}."
                )
        _check_finite("FiniteDifference", "mu", self.mu, low=0, strict=True)
        _check_finite("FiniteDifference", "hvp_mu", self.hvp_mu, low=0, strict=True)
        _check_int("FiniteDifference", "cg_iters", self.cg_iters, low=1)
        _check_finite("FiniteDifference", "tol", self.tol, low=0, strict=False)
        _check_finite("FiniteDifference", "damping", self.damping, low=0, strict=False)
        for name in ("as_printed", "rescale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"FiniteDifference.{name} must be a bool, got {getattr(self, name)!r}."
                )

    def num_sampled(self, dim: int) -> int:
        """``|P|`` for ``dim`` coordinates of ``x``.

        >>> FiniteDifference(fraction=0.25).num_sampled(10), FiniteDifference().num_sampled(10)
        (3, 10)
        """
        if self.num_coordinates is not None:
            return min(self.num_coordinates, dim)
        if self.fraction is not None:
            return min(math.ceil(self.fraction * dim), dim)
        return dim

    def sample_coordinates(self, dim: int, generator: torch.Generator | None) -> Tensor:
        """The sorted flat indices ``P ⊂ {0, …, dim − 1}`` that a call would perturb.

        Uses (and advances) ``generator`` exactly as :meth:`__call__` does; with
        ``|P| = dim`` it returns all indices and draws nothing.

        >>> FiniteDifference(num_coordinates=3).sample_coordinates(
        ...     10, torch.Generator().manual_seed(0)).tolist()
        [1, 4, 7]
        """
        size = self.num_sampled(dim)
        if size >= dim:
            return torch.arange(dim)
        if generator is None:
            raise ValueError(
                f"FiniteDifference samples |P| = {size} of {dim} coordinates of x and needs a "
                "random source: pass generator=torch.Generator().manual_seed(...)."
            )
        perm = torch.randperm(dim, generator=generator, device=generator.device)
        return torch.sort(perm[:size].cpu()).values

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
        """The estimate at ``(x, y)``; ``generator`` draws ``P``, ``state`` is ignored."""
        if len(y) == 0:
            raise ValueError("y must hold at least one tensor, got an empty dict.")
        x_names, y_names = tuple(x), tuple(y)
        # private contiguous copies: x_work is perturbed in place, one coordinate at a time
        x_work = tuple(_leaf("x", k, t).detach().contiguous() for k, t in x.items())
        y_base = tuple(_leaf("y", k, t).detach() for k, t in y.items())
        sizes = [t.numel() for t in x_work]
        dim = sum(sizes)
        coords = self.sample_coordinates(dim, generator).tolist()
        scale = dim / len(coords) if self.rescale and coords else 1.0

        def grad_y_g(xs: TensorTuple, ys: TensorTuple) -> TensorTuple:
            _, gy = _loss_grads(
                inner_loss, "inner_loss", x_names, xs, y_names, ys, wrt_x=False, wrt_y=True
            )
            return gy

        grad_x_f, grad_y_f = _loss_grads(
            outer_loss, "outer_loss", x_names, x_work, y_names, y_base, wrt_x=True, wrt_y=True
        )
        base = grad_y_g(x_work, y_base)
        n_grad = 2

        if self.as_printed:
            w = grad_y_f  # Alg. 2 line 7 as printed
        else:

            def matvec(u: TensorTuple) -> TensorTuple:
                nonlocal n_grad
                norm = _norm(u)
                if norm == 0.0:
                    return tuple(torch.zeros_like(t) for t in u)
                eps = self.hvp_mu / norm
                shifted = grad_y_g(x_work, tuple_axpy(eps, u, y_base))
                n_grad += 1
                return tuple((s - b) / eps for s, b in zip(shifted, base, strict=True))

            v, _ = solve_cg(
                matvec, grad_y_f, max_iter=self.cg_iters, tol=self.tol, damping=self.damping
            )
            w = tuple(-t for t in v)

        grad = [t.clone().reshape(-1) for t in grad_x_f]
        flats = [t.view(-1) for t in x_work]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        for p in coords:
            i = bisect.bisect_right(offsets, p) - 1
            j = p - offsets[i]
            flat = flats[i]
            old = flat[j].clone()
            flat[j] = old + self.mu
            step = float(flat[j] - old)  # the step actually taken in floating point
            if step == 0.0:
                flat[j] = old
                raise ValueError(
                    f"FiniteDifference.mu = {self.mu!r} vanishes next to "
                    f"x[{x_names[i]!r}] = {float(old)!r} in {old.dtype}; raise mu."
                )
            shifted = grad_y_g(x_work, y_base)
            flat[j] = old
            n_grad += 1
            diff = tuple(s - b for s, b in zip(shifted, base, strict=True))
            grad[i][j] += scale * float(tuple_dot(diff, w)) / step

        return HypergradResult(
            grad={k: g.reshape(t.shape) for k, g, t in zip(x_names, grad, x_work, strict=True)},
            v={k: -t for k, t in zip(y_names, w, strict=True)},
            n_grad=n_grad,
            n_hvp=0,
        )
