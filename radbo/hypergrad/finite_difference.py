"""Second-order-free hypergradient by coordinate-wise finite differences (RAFBO, Alg. 2)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal, NoReturn

import torch
from pydantic import Field, model_validator
from torch import Tensor

from radbo.autodiff import (
    FiniteDifferenceSystem,
    Linearization,
    Scalar,
    TensorTuple,
    broadcast,
    leaf,
    loss_grads,
    solve_cg,
    tuple_axpy,
    tuple_dot,
    tuple_norm,
)
from radbo.graphs import check
from radbo.hypergrad.base import (
    ESTIMATORS,
    Estimator,
    FiniteFloat,
    HypergradResult,
    MemoryFootprint,
    require_y,
)
from radbo.limits import Steps
from radbo.loops import cg_product
from radbo.problem import at_points
from radbo.typing import BilevelLoss, Params

__all__ = ["FiniteDifference", "default_step"]

Scheme = Literal["forward", "central"]


def default_step(scheme: Scheme, dtype: torch.dtype) -> float:
    """The coordinate step ``μ`` a difference scheme gets by default in ``dtype``:
    ``eps^(1/3)`` for ``"central"``, ``eps^(1/2)`` for ``"forward"`` (``eps`` the dtype's
    machine epsilon), the steps that balance each scheme's truncation error (``O(μ²)``,
    ``O(μ)``) against its rounding error (``O(eps / μ)``) for unit-scale derivatives.

    >>> [f"{default_step(s, t):.3e}" for s in ("central", "forward")
    ...  for t in (torch.float32, torch.float64)]
    ['4.922e-03', '6.055e-06', '3.453e-04', '1.490e-08']
    """
    eps = torch.finfo(dtype).eps
    return eps ** (1 / 3) if scheme == "central" else eps ** (1 / 2)


@ESTIMATORS.register
class FiniteDifference(Estimator):
    """Second-order-free local hypergradient on a sampled coordinate set (RAFBO;
    ``[estimator] name = "finite_difference"``).

    Follows Alg. 2 and eq. (10) of the RABO paper (``papers/rabo_rafbo.txt``): for every
    coordinate ``p`` of a set ``P`` sampled from the coordinates of ``x``, the column
    ``∇²_{y x_p} g`` is replaced by a deterministic difference of ``∇_y g``. The paper's is
    the forward difference (``scheme = "forward"``)::

        δ_p = (∇_y g(x + μ e_p, y) − ∇_y g(x, y)) / μ                       (eq. (10))

    whose error is ``O(μ)``; the default ``scheme = "central"`` takes the central difference::

        δ_p = (∇_y g(x + μ e_p, y) − ∇_y g(x − μ e_p, y)) / (2μ)

    whose error is ``O(μ²)``, for two gradients per coordinate where the forward difference
    needs one (plus one at ``(x, y)`` shared by all coordinates). Both quotients divide by the
    step actually representable in x's dtype (``(x_p + μ) − x_p``, or
    ``(x_p + μ) − (x_p − μ)``).

    **Correction of the printed formula.** Alg. 2 line 7 contracts ``δ_p`` with ``∇_y f``,
    which approximates ``(∇²_xy g · ∇_y f)_p``; but the hypergradient (eq. (9)) needs
    ``∂y*/∂x_p = −[∇²_yy g]⁻¹ ∇²_{y x_p} g``, so the sign and the inverse Hessian are missing.
    By default this estimator computes the correct contraction::

        w = −[∇²_yy g + damping·I]⁻¹ ∇_y f                   (CG, ``cg_iters`` iterations)
        grad_p = ∇_{x_p} f + scale · ⟨δ_p, w⟩    for p ∈ P
        grad_p = ∇_{x_p} f                       for p ∉ P

    where the Hessian-vector products inside CG are themselves differences of ``∇_y g`` (no
    double backward anywhere), of the same scheme as the coordinates::

        forward:  H u ≈ (∇_y g(x, y + ε u) − ∇_y g(x, y)) / ε
        central:  H u ≈ (∇_y g(x, y + ε u) − ∇_y g(x, y − ε u)) / (2ε)
        ε = hvp_mu / max(||u||, tiny)

    so the y-step ``ε u`` always has norm ``hvp_mu`` (``||·||`` is the norm over all
    tensors of ``y``; ``u = 0`` gives ``H u = 0``). With ``as_printed=True`` the estimator
    instead returns eq. (10) / Alg. 2 exactly as printed, ``grad_p = ∇_{x_p} f + scale ·
    ⟨δ_p, ∇_y f⟩`` (no CG), with the forward difference unless ``scheme`` is given; this is
    *not* a hypergradient and is kept only to reproduce the paper -- on the quadratic test
    problem of ``tests/hypergrad/test_hypergrad_fd_fo.py`` its relative error is 1.65 (165 %),
    against about ``6e-13`` for the corrected form.

    **Accuracy and cost of the two schemes** (``benchmarks/fd_scheme.py``; the tanh network of
    ``tests/hypergrad/test_hypergrad.py``, all 5 coordinates of x, default CG; relative error
    against the exact hypergradient, FLOPs measured by the ledger's :class:`radbo.cost.FlopMeter`):
    at their default steps, central 2.9e-6 (float64) and 6.6e-5 to 1.25e-4 (float32, by the CPU's
    kernels) for 1.82x the forward scheme's FLOPs, forward 1.4e-5 and 4.6e-4 to 5.7e-4. In float32
    the error is rounding, mostly of CG's finite-difference products at the fixed ``hvp_mu = 1e-3``
    (central reaches 6e-6 to 1.1e-5 at ``hvp_mu = 1e-2``); before rounding, the forward scheme's
    truncation at float32's step is 1.8e-4, the central one's 6.9e-6. Given the same FLOPs as 12
    more CG iterations, forward stays at 1.4e-5 in float64. (In float64, with both steps tuned down
    to 1e-8 and 1e-6, forward with those extra iterations reaches 1.7e-8, where central with 10
    iterations is held at 2.8e-6 by CG.) When ``|P|`` is a small sample of x, the sampling of ``P``
    dominates instead: on ``examples/rafbo.toml`` (5 % of x, float32, 10 rounds) the two schemes end
    within 0.003 test accuracy of each other (seeds 0, 1, 2), central for 1.96x the FLOPs; there
    ``scheme = "forward"`` is the better use of compute.

    **Coordinates outside P** get the direct term ``∇_x f`` only. With ``scale = 1``
    (``rescale=False``, the paper's choice) the estimate is biased whenever ``|P| < dim x``:
    its expectation over ``P`` is ``∇_x f + (|P| / d) · (indirect term)``. ``rescale=True``
    uses ``scale = d / |P|``, which makes the estimate unbiased over the draw of ``P`` (up to
    the finite-difference and CG errors) at the price of a variance growing like ``d / |P|``.
    On a quadratic ``g`` both schemes are exact up to rounding, so with ``|P| = d`` the
    estimator matches the implicit hypergradient of eq. (7) to CG accuracy.

    Attributes:
        num_coordinates: ``|P|``, the number of coordinates perturbed, ``>= 1``; ``|P|`` is
            ``min(num_coordinates, dim x)``. Default ``None``: all coordinates.
        fraction: alternatively ``|P| = ceil(fraction · dim x)``, ``0 < fraction <= 1``. At
            most one of ``num_coordinates`` and ``fraction`` may be set (neither: all).
        scheme: ``"central"`` (default) or ``"forward"`` (eq. (10)), for the coordinate
            differences and CG's Hessian-vector products alike; with ``as_printed`` the
            default is ``"forward"``.
        mu: the coordinate step ``μ > 0``. Default ``None``: chosen from x's dtype by
            :func:`default_step`, ``eps^(1/3)`` for central differences (4.9e-3 in float32,
            6.1e-6 in float64) and ``eps^(1/2)`` for forward ones (3.5e-4, 1.5e-8).
        hvp_mu: the norm ``> 0`` of the y-step of the finite-difference Hessian-vector
            products. Default ``1e-3``.
        cg_iters: at most this many CG iterations (one Hessian-vector product each), ``>= 1``;
            default ``10``.
        tol: CG's relative squared-residual tolerance (see :func:`solve_cg`), ``>= 0``;
            default ``1e-10``.
        damping: ``>= 0`` added to ``∇²_yy g`` in CG, as in :class:`ImplicitCG`; default ``0``.
        as_printed: use ``∇_y f`` in place of ``w`` (eq. (10) as printed); default ``False``.
        rescale: multiply the indirect term by ``d / |P|`` (unbiased over ``P``); default
            ``False``.
        coordinate_batch: how many coordinates of ``P`` share one evaluation of ``∇_y g``:
            their shifted points are stacked on a new leading dim and the inner loss runs
            once over them (:func:`radbo.problem.at_points`, under ``torch.vmap``), so a
            GPU sees ``|P| / coordinate_batch`` launches of larger kernels instead of one
            small sequence per coordinate. Default ``1``: one coordinate at a time, the
            float32 results of every earlier release. Any value gives the same arithmetic
            (the same products and sums, the same FLOPs in the ledger and the same
            ``n_grad``); batched kernels may round float32 in the last bits differently
            (equal to rounding in float64, ``tests/hypergrad/test_fd_batched.py``). Memory
            grows with it: each evaluation holds ``coordinate_batch`` copies of x, y and
            the inner loss's activations, which the device memory model counts
            (:meth:`memory_bytes`). The loss must run under ``torch.vmap``: every loss
            radbo binds does (BatchNorm statistics go to per-point copies that are
            dropped); a loss of your own must be a pure function of its inputs.

    ``P`` is drawn uniformly without replacement from the ``d = dim x`` coordinates of all
    tensors of ``x`` (flattened in dict order) with ``torch.randperm(d, generator=...)``;
    coordinates are evaluated in increasing order. When ``|P| = d`` no random number is
    drawn and ``generator`` may be ``None``; otherwise it is required.
    :meth:`sample_coordinates` returns the set a given generator yields, :meth:`draw` the same
    as a call's ``draws``.

    As products for simultaneous methods (:meth:`linearize`, SimFBO / ShroFBO, FedMSA,
    FedMBO) only ``hvp_mu`` matters: ``∇²_yy g · u`` and ``∇²_xy g · v`` by one forward
    difference of the gradient along ``u`` (:class:`~radbo.autodiff.FiniteDifferenceSystem`);
    ``scheme`` and ``mu`` do not apply there.

    Cost (``n_hvp = 0``, second-order free), in gradient evaluations ``n_grad``: one gradient
    of ``f`` with respect to ``(x, y)``, then

    - forward: ``n_grad = 2 + (CG iterations) + |P|`` -- one gradient of ``g`` at ``(x, y)``,
      one per CG iteration and one per coordinate of ``P`` (``as_printed``: ``2 + |P|``);
    - central: ``n_grad = 1 + 2·(CG iterations) + 2|P|`` -- two gradients of ``g`` per CG
      iteration and per coordinate, none at ``(x, y)`` (``as_printed``: ``1 + 2|P|``);

    so central costs less than twice forward for the same iterations and ``|P|``. Each
    gradient of ``g`` is taken with respect to y only. Either scheme costs *more* FLOPs than
    :class:`ImplicitCG` with as many iterations, for every ``|P| >= 1``: an autograd
    Hessian-vector product costs at most about one gradient (far less when y is a small head,
    since it reuses the saved activations), and autograd's mixed product covers all of x in
    one backward pass where a difference covers one coordinate per gradient
    (``tests/flops/test_flops.py`` has the exact count; ``benchmarks/hypergrad_flops.py``). What the
    estimator saves is second-order machinery: no ``create_graph``, no double backward.

    Precision: the differences are accurate when ``∇_y g`` is smooth in y (a linear head or a
    logistic regression). When y holds ReLU layers, a step can cross activation kinks and
    float32 cancels digits; raise ``hvp_mu`` or work in float64 there.

    ``HypergradResult.v`` is ``−w = [∇²_yy g]⁻¹ ∇_y f`` as solved by CG (``−∇_y f`` with
    ``as_printed``), so that ``grad_p = ∇_{x_p} f − scale · ⟨δ_p, v⟩`` for ``p ∈ P``.

    >>> import torch
    >>> f = lambda x, y: 0.5 * (y["w"] - 1.0).pow(2).sum()          # outer: pull y to 1
    >>> g = lambda x, y: 0.5 * (2.0 * y["w"] - x["a"]).pow(2).sum()  # y*(x) = x / 2
    >>> x, y = {"a": torch.tensor([4.0], dtype=torch.float64)}, {"w": torch.tensor([2.0],
    ...                                                                dtype=torch.float64)}
    >>> r = FiniteDifference()(f, g, x, y)      # Φ(a) = (a/2 − 1)²/2, Φ'(4) = 0.5
    >>> round(float(r.grad["a"]), 8), r.n_grad, r.n_hvp      # 1 + 2·1 CG + 2·1 coordinate
    (0.5, 5, 0)
    >>> r = FiniteDifference(scheme="forward")(f, g, x, y)
    >>> round(float(r.grad["a"]), 8), r.n_grad               # 2 + 1 CG + 1 coordinate
    (0.5, 4)
    >>> printed = FiniteDifference(as_printed=True)
    >>> printed.scheme, round(float(printed(f, g, x, y).grad["a"]), 6)  # wrong
    ('forward', -2.0)
    """

    name: Literal["finite_difference"] = "finite_difference"
    num_coordinates: int | None = Field(None, ge=1, description="|P|; default all of x")
    fraction: FiniteFloat | None = Field(None, gt=0, le=1, description="|P| as a share of dim(x)")
    scheme: Scheme = Field(
        "central", description="central (O(mu^2)) or forward (O(mu), eq. (10)) differences"
    )
    mu: FiniteFloat | None = Field(
        None, gt=0, description="coordinate step; default from the dtype (eps^(1/3) / eps^(1/2))"
    )
    hvp_mu: FiniteFloat = Field(1e-3, gt=0, description="norm of the y-step of H_yy u")
    cg_iters: Steps = Field(
        10, ge=1, description="at most this many CG iterations (<= 10,000 without --force)"
    )
    tol: FiniteFloat = Field(1e-10, ge=0, description="CG's relative squared-residual tolerance")
    damping: FiniteFloat = Field(0.0, ge=0, description="added to the diagonal of H_yy in CG")
    as_printed: bool = Field(
        False, strict=True, description="eq. (10) as printed (not a hypergradient)"
    )
    rescale: bool = Field(
        False, strict=True, description="scale the indirect term by d / |P| (unbiased)"
    )
    coordinate_batch: int = Field(
        1, ge=1, le=4096, strict=True, description="coordinates per batched gradient of g"
    )

    capabilities: ClassVar[frozenset[str]] = frozenset({"hypergradient", "products"})
    products_fields: ClassVar[frozenset[str]] = frozenset({"hvp_mu"})

    @classmethod
    def hypergradient_bytes(cls, footprint: MemoryFootprint) -> int:
        """``∇_x f, ∇_y f`` (|x| + |y|), two gradient buffers of y (``∇_y g`` at ``x`` and at
        ``x + μ e_p``), one of x (the hypergradient being accumulated) and the CG vectors of
        the finite-difference solve (4|y|); no second-order graph."""
        x, y = footprint.x_bytes, footprint.y_bytes
        return (x + y) + 2 * y + x + 4 * y

    def memory_bytes(self, footprint: MemoryFootprint) -> int:
        """:meth:`hypergradient_bytes` plus, for ``coordinate_batch = b > 1``, ``b - 1`` more
        points held at once, each a shifted copy of x, a copy of y and the gradient of g at
        it (|x| + 2|y|) and the activations of its backward (``footprint.activations``).

        >>> fp = MemoryFootprint(x_bytes=100, y_bytes=10, second_order=int, activations=50)
        >>> one, three = FiniteDifference(), FiniteDifference(coordinate_batch=3)
        >>> one.memory_bytes(fp), three.memory_bytes(fp)
        (270, 610)
        """
        point = footprint.x_bytes + 2 * footprint.y_bytes + footprint.activations
        return self.hypergradient_bytes(footprint) + (self.coordinate_batch - 1) * point

    @model_validator(mode="before")
    @classmethod
    def _printed_scheme(cls, data: Any) -> Any:
        # eq. (10) as printed is a forward difference: as_printed alone reproduces it
        if isinstance(data, dict) and data.get("as_printed") is True and "scheme" not in data:
            return {**data, "scheme": "forward"}
        return data

    @model_validator(mode="after")
    def _one_size(self) -> FiniteDifference:
        if self.num_coordinates is not None and self.fraction is not None:
            raise ValueError("give num_coordinates or fraction, not both")
        return self

    def step(self, dtype: torch.dtype) -> float:
        """The coordinate step ``μ`` used on an x of ``dtype``: ``mu``, or when it is
        ``None`` :func:`default_step` of the scheme.

        >>> FiniteDifference(mu=1e-3).step(torch.float32), FiniteDifference().step(torch.float64)
        (0.001, 6.055454452393343e-06)
        """
        return default_step(self.scheme, dtype) if self.mu is None else self.mu

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
        if draws is None:
            draws = self.draw(generator, {k: t[(0,) * lead] for k, t in x.items()})
        # [|P|], or [C, |P|] for a cohort; drawn on the CPU, used where x lives
        coords = draws["coordinates"].to(device=xs[0].device if xs else None, dtype=torch.long)
        grad_y_g = _InnerGradient(inner_loss, x_names, y_names, lead)
        grad_x_f, grad_y_f = loss_grads(
            outer_loss, "outer_loss", x_names, xs, y_names, ys, wrt_x=True, wrt_y=True, lead=lead
        )
        base, hvp = self._products(grad_y_g, inner_loss, xs, ys)
        calls: int | Tensor = 0
        if self.as_printed or hvp is None:
            w = grad_y_f  # Alg. 2 line 7 as printed
        else:
            v, calls = solve_cg(
                cg_product(hvp),
                grad_y_f,
                max_iter=self.cg_iters,
                tol=self.tol,
                damping=self.damping,
                lead=lead,
            )
            w = tuple(-t for t in v)
        grad = self._coordinate_terms(grad_y_g, _FlatX(xs, lead), ys, grad_x_f, base, w, coords)
        num = coords.shape[-1]
        central = self.scheme == "central"
        n_grad = 1 + 2 * calls + 2 * num if central else 2 + calls + num
        return HypergradResult(
            grad=dict(zip(x_names, grad, strict=True)),
            v={k: -t for k, t in zip(y_names, w, strict=True)},
            n_grad=n_grad,
            n_hvp=0,
        )

    def _products(
        self, grad_y_g: _InnerGradient, inner_loss: BilevelLoss, xs: TensorTuple, ys: TensorTuple
    ) -> tuple[TensorTuple, Callable[[Sequence[Tensor]], TensorTuple] | None]:
        """``(∇_y g(x, y), u -> H u)`` by this scheme's differences: forward ones share the
        gradient at ``(x, y)`` (returned); central ones need none (``()``); ``as_printed``
        solves nothing (no product)."""
        lead = grad_y_g.lead
        if self.scheme != "central":
            system = FiniteDifferenceSystem(
                inner_loss,
                dict(zip(grad_y_g.x_names, xs, strict=True)),
                dict(zip(grad_y_g.y_names, ys, strict=True)),
                mu=self.hvp_mu,
                lead=lead,
                with_x=False,
            )
            return system.grad_y_g, system.hvp
        if self.as_printed:
            return (), None

        def central_hvp(u: Sequence[Tensor]) -> TensorTuple:
            # ε per client: hvp_mu / ||u||, or hvp_mu where u = 0 (whose product is 0)
            norm = tuple_norm(u, lead)
            eps: Scalar
            if lead == 0:
                value = float(norm)
                eps = self.hvp_mu / value if value > 0.0 else self.hvp_mu
            else:
                eps = torch.where(norm > 0, self.hvp_mu / norm, torch.full_like(norm, self.hvp_mu))
            plus = grad_y_g(xs, tuple_axpy(eps, u, ys))
            minus = grad_y_g(xs, tuple_axpy(-eps, u, ys))
            return tuple((p - m) / broadcast(2 * eps, p) for p, m in zip(plus, minus, strict=True))

        return (), central_hvp

    def _coordinate_terms(
        self,
        grad_y_g: _InnerGradient,
        flat_x: _FlatX,
        ys: TensorTuple,
        grad_x_f: TensorTuple,
        base: TensorTuple,
        w: TensorTuple,
        coords: Tensor,
    ) -> TensorTuple:
        """``∇_x f`` plus, at every coordinate ``p`` of ``coords`` (in order), ``scale ·
        ⟨δ_p, w⟩`` with ``δ_p`` this scheme's difference of ``∇_y g`` (forward ones from
        ``base = ∇_y g(x, y)``); shaped like x. Takes ``coordinate_batch`` coordinates at a
        time, all of them at points stacked on a new leading dim when that is more than one."""
        central = self.scheme == "central"
        lead, lead_shape = grad_y_g.lead, flat_x.lead_shape
        num, size = coords.shape[-1], self.coordinate_batch
        scale = flat_x.dim / num if self.rescale and num else 1.0
        flat = flat_x.flat(flat_x.xs)
        grad = flat_x.flat(grad_x_f).clone()
        mu = self.step(flat.dtype)
        stacked = grad_y_g.at_points() if size > 1 else None
        for k in range(0, num, size):
            p = coords[..., k : k + size]  # [*lead, b]
            old = flat.gather(-1, p)
            up = old + mu
            down = old - mu if central else old
            step = up - down  # the step actually taken in floating point
            # a host read, deferred to after the replay inside a captured phase (radbo.graphs)
            check(
                (step == 0).any(),
                partial(self._vanishing_step, flat_x, grad_y_g.x_names, p, old, step, mu),
            )
            if stacked is None:  # one coordinate: the plain calls, bitwise as before the batch
                shifted = grad_y_g(flat_x.unflat(flat.scatter(-1, p, up)), ys)
                other = grad_y_g(flat_x.unflat(flat.scatter(-1, p, down)), ys) if central else base
                diff = tuple(s - b for s, b in zip(shifted, other, strict=True))
                dots = tuple_dot(diff, w, lead).reshape(lead_shape)
            else:
                dots = self._stacked_dots(stacked, flat_x, flat, ys, base, w, p, up, down)
            # in float64, as a plain-float computation would be; then added once in x's dtype
            term = scale * dots.double() / step.reshape(dots.shape).double()
            grad = grad.scatter_add(-1, p, term.to(grad.dtype).reshape(p.shape))
        return flat_x.unflat(grad)

    def _stacked_dots(
        self,
        stacked: _InnerGradient,
        flat_x: _FlatX,
        flat: Tensor,
        ys: TensorTuple,
        base: TensorTuple,
        w: TensorTuple,
        p: Tensor,
        up: Tensor,
        down: Tensor,
    ) -> Tensor:
        """``⟨δ_p, w⟩`` for the ``b`` coordinates of ``p`` ``[*lead, b]`` at once, shaped like
        ``p``: the differences' gradients come from one evaluation of ``stacked`` (the inner
        gradient over points) at the ``b`` shifted copies of x (two for central ones)."""
        count = p.shape[-1]
        ys_at = tuple(t.expand(count, *t.shape) for t in ys)
        shifted = stacked(flat_x.at_points(flat, p, up), ys_at)
        if self.scheme == "central":
            other = stacked(flat_x.at_points(flat, p, down), ys_at)
        else:
            other = base
        diff = tuple(s - b for s, b in zip(shifted, other, strict=True))
        return tuple_dot(diff, w, stacked.lead).movedim(0, -1)  # [b, *lead] -> [*lead, b]

    def _vanishing_step(
        self,
        flat_x: _FlatX,
        x_names: tuple[str, ...],
        p: Tensor,
        old: Tensor,
        step: Tensor,
        mu: float,
    ) -> NoReturn:
        """Raise the error of a coordinate step ``mu`` lost in rounding next to ``old``."""
        at = int((step == 0).reshape(-1).nonzero()[0])
        j = int(p.reshape(-1)[at])
        i = bisect.bisect_right(flat_x.offsets, j) - 1
        value = float(old.reshape(-1)[at])
        which = "" if self.mu is not None else f" (the default of scheme {self.scheme!r})"
        raise ValueError(
            f"FiniteDifference.mu = {mu!r}{which} vanishes next to "
            f"x[{x_names[i]!r}] = {value!r} in {old.dtype}; raise mu."
        )


@dataclass(frozen=True)
class _InnerGradient:
    """``(x, y) -> ∇_y g(x, y)`` on tuples of tensors named ``x_names`` / ``y_names``: the
    gradient every difference of :class:`FiniteDifference` takes."""

    inner_loss: BilevelLoss
    x_names: tuple[str, ...]
    y_names: tuple[str, ...]
    lead: int

    def __call__(self, x_values: TensorTuple, y_values: TensorTuple) -> TensorTuple:
        return loss_grads(
            self.inner_loss,
            "inner_loss",
            self.x_names,
            x_values,
            self.y_names,
            y_values,
            wrt_x=False,
            wrt_y=True,
            lead=self.lead,
        )[1]

    def at_points(self) -> _InnerGradient:
        """The same gradient at several points at once: x and y, and the gradients, carry one
        more leading dim (:func:`radbo.problem.at_points`)."""
        return _InnerGradient(at_points(self.inner_loss), self.x_names, self.y_names, self.lead + 1)


class _FlatX:
    """x as one flat vector per client (tensors in dict order), in which
    :class:`FiniteDifference` perturbs one coordinate at a time."""

    def __init__(self, xs: TensorTuple, lead: int) -> None:
        self.xs = xs
        self.lead_shape = xs[0].shape[:lead] if xs else torch.Size()
        self.sizes = [t[(0,) * lead].numel() if lead else t.numel() for t in xs]
        self.dim = sum(self.sizes)
        #: where each tensor of x starts in the flat vector, and the end
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)

    def flat(self, tensors: TensorTuple) -> Tensor:
        """``tensors`` (shaped like x) as one flat vector per client."""
        return torch.cat([t.reshape(*self.lead_shape, -1) for t in tensors], dim=-1)

    def unflat(self, values: Tensor) -> TensorTuple:
        """A flat vector per client back to tensors shaped like x (leading dims before the
        clients', as :meth:`at_points` makes, are kept)."""
        extra = values.shape[: values.ndim - 1 - len(self.lead_shape)]
        parts = values.split(self.sizes, dim=-1)
        return tuple(p.reshape((*extra, *t.shape)) for p, t in zip(parts, self.xs, strict=True))

    def at_points(self, flat: Tensor, p: Tensor, values: Tensor) -> TensorTuple:
        """x at ``b`` points, stacked on a new leading dim: point ``j`` is ``flat`` with
        coordinate ``p[..., j]`` set to ``values[..., j]`` (``p`` and ``values`` ``[*lead,
        b]``); shaped ``[b, *x's shape]``."""
        points = flat.expand(p.shape[-1], *flat.shape).clone()
        points.scatter_(-1, p.movedim(-1, 0).unsqueeze(-1), values.movedim(-1, 0).unsqueeze(-1))
        return self.unflat(points)
