"""Second-order-free hypergradient by coordinate-wise finite differences (RAFBO, Alg. 2)."""

from __future__ import annotations

import bisect
import math
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from radbo.autodiff import (
    FiniteDifferenceSystem,
    Linearization,
    leaf,
    loss_grads,
    solve_cg,
    tuple_dot,
)
from radbo.hypergrad.base import (
    ESTIMATORS,
    Estimator,
    FiniteFloat,
    HypergradResult,
    MemoryModel,
    require_y,
)
from radbo.typing import BilevelLoss, Params

__all__ = ["FiniteDifference"]


@ESTIMATORS.register
class FiniteDifference(Estimator):
    """Second-order-free local hypergradient on a sampled coordinate set (RAFBO;
    ``[estimator] name = "finite_difference"``).

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
    :meth:`sample_coordinates` returns the set a given generator yields, :meth:`draw` the same
    as a call's ``draws``.

    As products for simultaneous methods (:meth:`linearize`, SimFBO / ShroFBO, FedMSA,
    FedMBO) only ``hvp_mu`` matters: ``∇²_yy g · u`` and ``∇²_xy g · v`` by one difference of
    the gradient along ``u`` (:class:`~radbo.autodiff.FiniteDifferenceSystem`).

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

    name: Literal["finite_difference"] = "finite_difference"
    num_coordinates: int | None = Field(None, ge=1, description="|P|; default all of x")
    fraction: FiniteFloat | None = Field(None, gt=0, le=1, description="|P| as a share of dim(x)")
    mu: FiniteFloat = Field(1e-3, gt=0, description="coordinate step of eq. (10)")
    hvp_mu: FiniteFloat = Field(1e-3, gt=0, description="norm of the y-step of H_yy u")
    cg_iters: int = Field(10, ge=1, description="at most this many CG iterations")
    tol: FiniteFloat = Field(1e-10, ge=0, description="CG's relative squared-residual tolerance")
    damping: FiniteFloat = Field(0.0, ge=0, description="added to the diagonal of H_yy in CG")
    as_printed: bool = Field(
        False, strict=True, description="eq. (10) as printed (not a hypergradient)"
    )
    rescale: bool = Field(
        False, strict=True, description="scale the indirect term by d / |P| (unbiased)"
    )

    capabilities: ClassVar[frozenset[str]] = frozenset({"hypergradient", "products"})
    products_fields: ClassVar[frozenset[str]] = frozenset({"hvp_mu"})
    memory_model: ClassVar[MemoryModel] = "finite_difference"

    @model_validator(mode="after")
    def _one_size(self) -> FiniteDifference:
        if self.num_coordinates is not None and self.fraction is not None:
            raise ValueError("give num_coordinates or fraction, not both")
        return self

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

    def draw(self, generator: torch.Generator | None, x: Params) -> dict[str, Tensor]:
        """``{"coordinates": P}`` for one client at ``x`` (see :meth:`sample_coordinates`)."""
        dim = sum(t.numel() for t in x.values())
        return {"coordinates": self.sample_coordinates(dim, generator)}

    def linearize(
        self, inner_loss: BilevelLoss, x: Params, y: Params, *, lead: int = 0, with_x: bool = True
    ) -> Linearization:
        return FiniteDifferenceSystem(inner_loss, x, y, mu=self.hvp_mu, lead=lead, with_x=with_x)

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
        """The estimate at ``(x, y)``; ``P`` comes from ``draws`` (one row per client for a
        cohort) or is drawn with ``generator``; ``state`` is ignored."""
        require_y(y)
        x_names, y_names = tuple(x), tuple(y)
        xs = tuple(leaf("x", k, t).detach() for k, t in x.items())
        ys = tuple(leaf("y", k, t).detach() for k, t in y.items())
        lead_shape = xs[0].shape[:lead] if xs else torch.Size()
        sizes = [t[(0,) * lead].numel() if lead else t.numel() for t in xs]
        dim = sum(sizes)
        if draws is None:
            draws = self.draw(generator, {k: t[(0,) * lead] for k, t in x.items()})
        coords = draws["coordinates"].to(torch.long)  # [|P|], or [C, |P|] for a cohort
        num = coords.shape[-1]
        scale = dim / num if self.rescale and num else 1.0

        grad_x_f, grad_y_f = loss_grads(
            outer_loss, "outer_loss", x_names, xs, y_names, ys, wrt_x=True, wrt_y=True, lead=lead
        )
        system = FiniteDifferenceSystem(
            inner_loss,
            dict(zip(x_names, xs, strict=True)),
            dict(zip(y_names, ys, strict=True)),
            mu=self.hvp_mu,
            lead=lead,
            with_x=False,
        )
        base = system.grad_y_g
        calls: int | Tensor = 0
        if self.as_printed:
            w = grad_y_f  # Alg. 2 line 7 as printed
        else:
            v, calls = solve_cg(
                system.hvp,
                grad_y_f,
                max_iter=self.cg_iters,
                tol=self.tol,
                damping=self.damping,
                lead=lead,
            )
            w = tuple(-t for t in v)

        # x as one flat vector per client; a coordinate p is perturbed in a copy of it
        flat = torch.cat([t.reshape(*lead_shape, -1) for t in xs], dim=-1)
        grad = torch.cat([t.reshape(*lead_shape, -1) for t in grad_x_f], dim=-1).clone()
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)

        def unflat(values: Tensor) -> tuple[Tensor, ...]:
            parts = values.split(sizes, dim=-1)
            return tuple(p.reshape(t.shape) for p, t in zip(parts, xs, strict=True))

        for k in range(num):
            p = coords[..., k : k + 1]
            old = flat.gather(-1, p)
            new = old + self.mu
            step = new - old  # the step actually taken in floating point
            if bool((step == 0).any()):
                j = int(p.reshape(-1)[int((step == 0).reshape(-1).nonzero()[0])])
                i = bisect.bisect_right(offsets, j) - 1
                value = float(old.reshape(-1)[int((step == 0).reshape(-1).nonzero()[0])])
                raise ValueError(
                    f"FiniteDifference.mu = {self.mu!r} vanishes next to "
                    f"x[{x_names[i]!r}] = {value!r} in {old.dtype}; raise mu."
                )
            _, shifted = loss_grads(
                inner_loss,
                "inner_loss",
                x_names,
                unflat(flat.scatter(-1, p, new)),
                y_names,
                ys,
                wrt_x=False,
                wrt_y=True,
                lead=lead,
            )
            diff = tuple(s - b for s, b in zip(shifted, base, strict=True))
            # in float64, as a plain-float computation would be; then added once in x's dtype
            term = scale * tuple_dot(diff, w, lead).double() / step.reshape(lead_shape).double()
            grad = grad.scatter_add(-1, p, term.to(grad.dtype).reshape(p.shape))

        return HypergradResult(
            grad=dict(zip(x_names, unflat(grad), strict=True)),
            v={k: -t for k, t in zip(y_names, w, strict=True)},
            n_grad=2 + calls + num,
            n_hvp=0,
        )
