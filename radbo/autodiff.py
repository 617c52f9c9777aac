"""The second-order toolkit: gradients, Hessian-vector products, linear solves and the penalty
gradient of a bilevel problem, shared by every estimator and algorithm in radbo.

Notation: ``f(x, y)`` is the outer loss, ``g(x, y)`` the inner loss, both
:data:`~radbo.typing.BilevelLoss` callables over named parameter dicts. What bilevel methods
need from them:

* :func:`loss_grads` -- first-order gradients (``∇_x`` and/or ``∇_y``) of one loss;
* :class:`InnerSystem` -- ``∇_y g`` and the products ``∇²_yy g · u`` (:meth:`~InnerSystem.hvp`),
  ``∇²_xy g · v`` (:meth:`~InnerSystem.mixed`) and both at once (:meth:`~InnerSystem.both`) by
  autograd double backward; :class:`FiniteDifferenceSystem` gives the same products from
  differences of gradients (second-order free);
* :func:`solve_cg` -- ``(∇²_yy g + damping I) v = b`` by conjugate gradient;
* :func:`bilevel_directions` -- the three directions of simultaneous methods at ``(x, y, v)``:
  ``∇_x f − ∇²_xy g v``, ``∇_y g`` and ``∇²_yy g v − ∇_y f`` (SimFBO eq. (3), FedMSA eq. (10));
* :func:`penalty_gradients` -- the first-order oracle of the penalty reformulation
  ``f(x, y) + λ (g(x, y) − g(x, z))`` (FedSVRBGD-FO, eqs. (4)-(6)).

**Cohorts.** Every helper also works on a *cohort*: several clients' tensors stacked along a
leading dimension (``lead = 1``), with losses that return one value per client (the problem's
loss under ``torch.vmap``). Gradients are taken of the sum of the clients' losses, which gives
each client its own gradient (the clients' parameters are separate), and every reduction that
is per client in the single-client case (inner products, norms, step sizes, convergence tests)
stays per client: clients never mix. ``lead = 0`` is one client and reproduces the plain
single-client arithmetic exactly. That is what lets a batched backend run any algorithm's
client work for many clients at once with the code written for one.

Parameters are never flattened into one vector: a vector of the product space is a tuple of
tensors (:data:`TensorTuple`), one per named parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, cast

import torch
from torch import Tensor

from radbo.typing import BilevelLoss, Params

__all__ = [
    "BilevelDirections",
    "FiniteDifferenceSystem",
    "ImplicitSystem",
    "InnerSystem",
    "Linearization",
    "PenaltyGradients",
    "TensorTuple",
    "axpy",
    "bilevel_directions",
    "broadcast",
    "capturing_graph",
    "check_finite",
    "check_int",
    "loss_grads",
    "params_norm",
    "params_where",
    "penalty_gradients",
    "per_client_sum",
    "project_ball",
    "solve_cg",
    "tuple_axpy",
    "tuple_dot",
    "tuple_norm",
    "tuple_where",
]

#: A vector of the product space of several tensors, one entry per named parameter.
TensorTuple = tuple[Tensor, ...]
#: A number, or one number per client of a cohort (a tensor of shape ``[C]``).
Scalar = float | Tensor


# ------------------------------------------------------------------ linear algebra on tuples
def broadcast(alpha: Scalar, like: Tensor) -> Scalar:
    """``alpha`` shaped to multiply ``like``: per-client numbers ``[C]`` get trailing unit
    dimensions; plain numbers and 0-dim tensors are returned as they are."""
    if isinstance(alpha, Tensor) and alpha.ndim > 0:
        return alpha.to(like.dtype).reshape(alpha.shape + (1,) * (like.ndim - alpha.ndim))
    return alpha


def per_client_sum(t: Tensor, lead: int = 0) -> Tensor:
    """Sum of all entries of ``t``, per client with ``lead`` (the leading dims are kept)."""
    if lead == 0:
        return torch.sum(t)
    dims = tuple(range(lead, t.ndim))
    return t.sum(dim=dims) if dims else t


def tuple_dot(a: Sequence[Tensor], b: Sequence[Tensor], lead: int = 0) -> Tensor:
    """Inner product ``Σ_k <a_k, b_k>`` of two tuples of same-shaped tensors.

    With ``lead = 1`` the first dimension indexes clients and the result has one entry per
    client; with ``lead = 0`` it is a 0-dim tensor.

    >>> import torch
    >>> float(tuple_dot((torch.tensor([1.0, 2.0]), torch.ones(2, 2)),
    ...                 (torch.tensor([3.0, 4.0]), torch.full((2, 2), 0.5))))
    13.0
    >>> tuple_dot((torch.tensor([[1.0, 2.0], [3.0, 4.0]]),), (torch.ones(2, 2),), lead=1)
    tensor([3., 7.])
    """
    if len(a) != len(b):
        raise ValueError(f"tuple_dot needs tuples of equal length, got {len(a)} and {len(b)}.")
    if len(a) == 0:
        return torch.zeros(())
    terms = [per_client_sum(ai * bi, lead) for ai, bi in zip(a, b, strict=True)]
    return torch.stack(terms).sum(0)


def tuple_axpy(alpha: Scalar, x: Sequence[Tensor], y: Sequence[Tensor]) -> TensorTuple:
    """``alpha * x + y`` for tuples of same-shaped tensors (out of place); ``alpha`` is a
    number or one number per client.

    >>> import torch
    >>> tuple_axpy(2.0, (torch.tensor([1.0]),), (torch.tensor([3.0]),))
    (tensor([5.]),)
    """
    if len(x) != len(y):
        raise ValueError(f"tuple_axpy needs tuples of equal length, got {len(x)} and {len(y)}.")
    return tuple(yi + broadcast(alpha, xi) * xi for xi, yi in zip(x, y, strict=True))


def tuple_where(mask: Tensor | None, new: Sequence[Tensor], old: Sequence[Tensor]) -> TensorTuple:
    """Per client, ``new`` where ``mask`` holds and ``old`` elsewhere (``mask = None``: ``new``).
    Values of the branch not taken never leak, NaN included."""
    if mask is None:
        return tuple(new)
    if new and mask.device != new[0].device:  # the cohort's flags are made on the CPU
        mask = mask.to(new[0].device)
    return tuple(
        torch.where(mask.reshape(mask.shape + (1,) * (n.ndim - mask.ndim)), n, o)
        for n, o in zip(new, old, strict=True)
    )


def params_where(mask: Tensor | None, new: Params, old: Params) -> Params:
    """:func:`tuple_where` on named tensors: per client, ``new`` where ``mask`` holds, ``old``
    elsewhere (``mask = None``: ``new``). Client work uses it to freeze the clients of a cohort
    that have finished their local steps while the others go on."""
    if mask is None:
        return new
    return dict(zip(new, tuple_where(mask, tuple(new.values()), tuple(old.values())), strict=True))


def tuple_norm(u: Sequence[Tensor], lead: int = 0) -> Tensor:
    """Euclidean norm over all tensors of ``u`` in float64 (one per client with ``lead``)."""
    if not u:
        return torch.zeros((), dtype=torch.float64)
    return tuple_dot(u, u, lead).double().sqrt()


def axpy(alpha: Scalar, d: Params, p: Params) -> Params:
    """``p + alpha * d``, tensor by tensor over the names of ``p``."""
    return {k: p[k] + broadcast(alpha, d[k]) * d[k] for k in p}


def params_norm(tensors: Params, lead: int = 0) -> Tensor:
    """L2 norm of all tensors together, computed in float64 (per client with ``lead``)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    # ``tensors`` is not empty, so sum() adds tensors and never returns its start value 0
    total = cast(Tensor, sum(per_client_sum(t.double() ** 2, lead) for t in tensors.values()))
    return torch.sqrt(total)


def project_ball(tensors: Params, radius: float, lead: int = 0) -> Params:
    """``P_r(v) = min(1, r / ||v||) v`` over the global L2 norm of all tensors (SimFBO eq. (5));
    also clipping by global norm. Per client with ``lead``."""
    norm = params_norm(tensors, lead)
    if lead == 0:
        value = float(norm)
        if value <= radius:
            return tensors
        return {k: t * (radius / value) for k, t in tensors.items()}
    factor = torch.where(norm > radius, radius / norm, torch.ones_like(norm))
    return {k: t * broadcast(factor, t) for k, t in tensors.items()}


# ----------------------------------------------------------------------------- validation
def check_finite(owner: str, field: str, value: float, *, low: float, strict: bool) -> None:
    """Raise ValueError unless ``value`` is a finite real number ``> low`` (or ``>= low``)."""
    op = ">" if strict else ">="
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > low if strict else value >= low)
    )
    if not ok:
        raise ValueError(f"{owner}.{field} must be a finite number {op} {low}, got {value!r}.")


def check_int(owner: str, field: str, value: int, *, low: int) -> None:
    """Raise ValueError unless ``value`` is an int ``>= low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}.{field} must be an integer >= {low}, got {value!r}.")


def leaf(name: str, key: str, t: Tensor) -> Tensor:
    """A fresh leaf copy of ``t`` that requires grad (``t`` must be floating point)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(t).__name__}.")
    if not t.is_floating_point():
        raise ValueError(
            f"{name}[{key!r}] must be a floating-point tensor to be differentiated, got "
            f"dtype {t.dtype}; keep integer buffers out of x and y."
        )
    return t.detach().clone().requires_grad_(True)


def scalar(name: str, value: object, lead: int = 0) -> Tensor:
    """The 0-dim tensor to differentiate for a loss value: the value itself for one client,
    the sum of the clients' values for a cohort (so that each client gets its own gradient)."""
    if lead == 0:
        if not isinstance(value, Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{name} must return a scalar tensor, got {shape}.")
        return value.reshape(())
    if not isinstance(value, Tensor) or value.ndim != lead:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} must return one value per client, got {shape}.")
    return value.sum()


# ------------------------------------------------------------------------------ gradients
def grad(
    outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    grad_outputs: Sequence[Tensor] | None,
    *,
    create_graph: bool,
) -> TensorTuple:
    """``Σ_k grad_outputs_k · ∂outputs_k / ∂inputs``, zeros for inputs that do not matter.

    Outputs that do not require grad (constants with respect to every input) contribute
    nothing; inputs that no output depends on get zero gradients.
    """
    if len(inputs) == 0:
        return ()
    if grad_outputs is None:
        grad_outputs = [torch.ones_like(o) for o in outputs]
    pairs = [(o, go) for o, go in zip(outputs, grad_outputs, strict=True) if o.requires_grad]
    if not pairs:
        return tuple(torch.zeros_like(t) for t in inputs)
    grads = torch.autograd.grad(
        [o for o, _ in pairs],
        list(inputs),
        grad_outputs=[go for _, go in pairs],
        create_graph=create_graph,
        retain_graph=True,
        allow_unused=True,
        materialize_grads=True,
    )
    return tuple(grads)


def loss_grads(
    loss: BilevelLoss,
    name: str,
    x_names: Sequence[str],
    x: Sequence[Tensor],
    y_names: Sequence[str],
    y: Sequence[Tensor],
    *,
    wrt_x: bool,
    wrt_y: bool,
    lead: int = 0,
    value: list[Tensor] | None = None,
) -> tuple[TensorTuple, TensorTuple]:
    """First-order ``(∇_x loss, ∇_y loss)`` at ``(x, y)``, detached; one gradient evaluation.

    Only the requested blocks are differentiated (the other comes back as ``()``); inputs
    the loss does not use get zeros. Never builds a graph of the gradient
    (``create_graph=False``): this is the oracle of the second-order-free methods. The inputs
    are detached, not copied, and never written to. When ``value`` is a list, the detached
    loss value is appended to it.
    """
    with torch.enable_grad():
        xl = tuple(t.detach().requires_grad_(True) if wrt_x else t.detach() for t in x)
        yl = tuple(t.detach().requires_grad_(True) if wrt_y else t.detach() for t in y)
        out = loss(dict(zip(x_names, xl, strict=True)), dict(zip(y_names, yl, strict=True)))
        total = scalar(name, out, lead)
        inputs = (xl if wrt_x else ()) + (yl if wrt_y else ())
        grads = grad([total], inputs, None, create_graph=False)
    if value is not None:
        value.append(out.detach())
    grads = tuple(t.detach() for t in grads)
    n_x = len(xl) if wrt_x else 0
    return grads[:n_x], grads[n_x:]


# -------------------------------------------------------------------- second-order products
class Linearization(Protocol):
    """The inner loss linearised at one point ``(x, y)``: its y-gradient and its products.

    :class:`InnerSystem` (autograd) and :class:`FiniteDifferenceSystem` (differences of
    gradients) implement it; every algorithm that needs ``∇²_yy g · u`` or ``∇²_xy g · v``
    gets one from its estimator (``estimator.linearize(g, x, y)``).
    """

    x_names: tuple[str, ...]
    y_names: tuple[str, ...]
    lead: int
    n_grad: int
    n_hvp: int
    g_value: Tensor

    @property
    def grad_y_g(self) -> TensorTuple: ...

    def hvp(self, u: Sequence[Tensor]) -> TensorTuple: ...

    def mixed(self, v: Sequence[Tensor]) -> TensorTuple: ...

    def both(self, v: Sequence[Tensor]) -> tuple[TensorTuple, TensorTuple]: ...


class InnerSystem:
    """Second-order products of the inner loss at one point ``(x, y)``, by autograd.

    Building it costs one gradient evaluation: ``∇_y g(x, y)`` with ``create_graph=True``.
    That graph is built once and reused (``retain_graph``) by every product:

    * :meth:`hvp`: ``H_yy · u = ∂/∂y <∇_y g(x, y), u>`` (double backward);
    * :meth:`mixed`: ``∇²_xy g · v = ∂/∂x <∇_y g(x, y), v>``;
    * :meth:`both`: ``(∇²_xy g · v, ∇²_yy g · v)`` in one backward pass (one product).

    The inputs are detached and cloned, never mutated; the loss receives fresh leaf tensors
    that require grad. Tensors of ``x`` that the loss does not use get zero derivatives.
    :attr:`n_grad` and :attr:`n_hvp` count the work done so far; :attr:`g_value` is the loss
    value at the point.
    """

    def __init__(self, inner_loss: BilevelLoss, x: Params, y: Params, *, lead: int = 0) -> None:
        self._leaves(x, y, lead)
        self._build_inner(inner_loss)
        #: First-order gradient evaluations made so far (1 once built).
        self.n_grad: int = 1
        #: Second-order products made so far.
        self.n_hvp: int = 0

    def _leaves(self, x: Params, y: Params, lead: int) -> None:
        if len(y) == 0:
            raise ValueError("y must hold at least one tensor, got an empty dict.")
        self.lead = lead
        self.x_names: tuple[str, ...] = tuple(x)
        self.y_names: tuple[str, ...] = tuple(y)
        self._x: TensorTuple = tuple(leaf("x", k, t) for k, t in x.items())
        self._y: TensorTuple = tuple(leaf("y", k, t) for k, t in y.items())

    def _leaf_dicts(self) -> tuple[Params, Params]:
        return (
            dict(zip(self.x_names, self._x, strict=True)),
            dict(zip(self.y_names, self._y, strict=True)),
        )

    def _build_inner(self, inner_loss: BilevelLoss) -> None:
        x_leaf, y_leaf = self._leaf_dicts()
        with torch.enable_grad():
            value = inner_loss(x_leaf, y_leaf)
            g = scalar("inner_loss", value, self.lead)
            self._grad_y_g: TensorTuple = grad([g], self._y, None, create_graph=True)
        #: ``g(x, y)`` (detached; one value per client in a cohort).
        self.g_value: Tensor = value.detach()

    @property
    def grad_y_g(self) -> TensorTuple:
        """``∇_y g(x, y)`` (detached), one tensor per name of ``y``."""
        return tuple(t.detach() for t in self._grad_y_g)

    def hvp(self, u: Sequence[Tensor]) -> TensorTuple:
        """``∇²_yy g(x, y) · u`` for ``u`` shaped like ``y`` (counts one product)."""
        self.n_hvp += 1
        out = grad(self._grad_y_g, self._y, u, create_graph=False)
        return tuple(t.detach() for t in out)

    def mixed(self, v: Sequence[Tensor]) -> TensorTuple:
        """``∇²_xy g(x, y) · v`` for ``v`` shaped like ``y``, shaped like ``x`` (one product)."""
        self.n_hvp += 1
        out = grad(self._grad_y_g, self._x, v, create_graph=False)
        return tuple(t.detach() for t in out)

    def both(self, v: Sequence[Tensor]) -> tuple[TensorTuple, TensorTuple]:
        """``(∇²_xy g · v, ∇²_yy g · v)`` from one backward pass (counts one product)."""
        self.n_hvp += 1
        out = grad(self._grad_y_g, self._x + self._y, v, create_graph=False)
        out = tuple(t.detach() for t in out)
        return out[: len(self._x)], out[len(self._x) :]


class ImplicitSystem(InnerSystem):
    """First- and second-order derivatives of a bilevel problem at one point ``(x, y)``.

    Building the system costs two gradient evaluations: one autograd pass of ``f`` with
    respect to ``(x, y)`` (giving ``∇_x f`` and ``∇_y f``) and one of ``g`` with respect to
    ``y`` with ``create_graph=True``, whose graph :meth:`hvp`, :meth:`mixed` and :meth:`both`
    reuse (see :class:`InnerSystem`).
    """

    def __init__(
        self,
        outer_loss: BilevelLoss,
        inner_loss: BilevelLoss,
        x: Params,
        y: Params,
        *,
        lead: int = 0,
    ) -> None:
        self._leaves(x, y, lead)
        x_leaf, y_leaf = self._leaf_dicts()
        # f first: its graph is freed before g's double-backward graph is built
        with torch.enable_grad():
            value = outer_loss(x_leaf, y_leaf)
            f = scalar("outer_loss", value, lead)
            grads_f = grad([f], self._x + self._y, None, create_graph=False)
        #: ``f(x, y)`` (detached; one value per client in a cohort).
        self.f_value: Tensor = value.detach()
        #: ``∇_x f(x, y)``, one tensor per name of ``x``.
        self.grad_x_f: TensorTuple = tuple(t.detach() for t in grads_f[: len(self._x)])
        #: ``∇_y f(x, y)``, one tensor per name of ``y``: the right-hand side for ``v``.
        self.grad_y_f: TensorTuple = tuple(t.detach() for t in grads_f[len(self._x) :])
        self._build_inner(inner_loss)
        self.n_grad = 2
        self.n_hvp = 0


class FiniteDifferenceSystem:
    """The products of :class:`InnerSystem` from forward differences of gradients (no second
    derivatives anywhere)::

        ε = mu / max(||u||, tiny)
        ∇²_yy g · u ≈ (∇_y g(x, y + ε u) − ∇_y g(x, y)) / ε
        ∇²_xy g · v ≈ (∇_x g(x, y + ε v) − ∇_x g(x, y)) / ε

    (``||·||`` over all tensors of ``u``, per client in a cohort), so the y-step has norm
    ``mu`` whatever the scale of ``u``; ``u = 0`` gives zero products. Exact up to rounding
    when ``g`` is quadratic in ``y``; otherwise the error is ``O(mu · ||u||)`` relative to the
    third derivative of ``g``.

    Building it costs one gradient evaluation (``∇_y g``; also ``∇_x g`` with ``with_x``,
    which :meth:`mixed` and :meth:`both` need); each product costs one more.
    """

    def __init__(
        self,
        inner_loss: BilevelLoss,
        x: Params,
        y: Params,
        *,
        mu: float,
        lead: int = 0,
        with_x: bool = True,
    ) -> None:
        if len(y) == 0:
            raise ValueError("y must hold at least one tensor, got an empty dict.")
        check_finite("FiniteDifferenceSystem", "mu", mu, low=0, strict=True)
        self.mu = mu
        self.lead = lead
        self.loss = inner_loss
        self.x_names: tuple[str, ...] = tuple(x)
        self.y_names: tuple[str, ...] = tuple(y)
        self._x: TensorTuple = tuple(leaf("x", k, t).detach() for k, t in x.items())
        self._y: TensorTuple = tuple(leaf("y", k, t).detach() for k, t in y.items())
        self.with_x = with_x
        values: list[Tensor] = []
        self._gx, self._gy = self._grads(self._y, wrt_x=with_x, value=values)
        #: ``g(x, y)`` (detached; one value per client in a cohort).
        self.g_value: Tensor = values[0]
        self.n_grad = 1
        self.n_hvp = 0

    def _grads(
        self, y: TensorTuple, *, wrt_x: bool, value: list[Tensor] | None = None
    ) -> tuple[TensorTuple, TensorTuple]:
        return loss_grads(
            self.loss,
            "inner_loss",
            self.x_names,
            self._x,
            self.y_names,
            y,
            wrt_x=wrt_x,
            wrt_y=True,
            lead=self.lead,
            value=value,
        )

    @property
    def grad_y_g(self) -> TensorTuple:
        return self._gy

    def _difference(self, u: Sequence[Tensor], *, wrt_x: bool) -> tuple[TensorTuple, TensorTuple]:
        if wrt_x and not self.with_x:
            raise ValueError("this FiniteDifferenceSystem was built without x gradients")
        # ε per client: mu / ||u||, or mu where u = 0 (whose difference comes out exactly 0)
        norm = tuple_norm(u, self.lead)
        eps: Scalar
        if self.lead == 0:
            value = float(norm)
            eps = self.mu / value if value > 0.0 else self.mu
        else:
            eps = torch.where(norm > 0, self.mu / norm, torch.full_like(norm, self.mu))
        self.n_grad += 1
        sx, sy = self._grads(tuple_axpy(eps, u, self._y), wrt_x=wrt_x)
        dx = tuple(
            _quotient(s - b, eps) for s, b in zip(sx, self._gx if wrt_x else (), strict=True)
        )
        dy = tuple(_quotient(s - b, eps) for s, b in zip(sy, self._gy, strict=True))
        return dx, dy

    def hvp(self, u: Sequence[Tensor]) -> TensorTuple:
        """``∇²_yy g · u`` by one difference of ``∇_y g`` (one gradient)."""
        return self._difference(u, wrt_x=False)[1]

    def mixed(self, v: Sequence[Tensor]) -> TensorTuple:
        """``∇²_xy g · v`` by one difference of ``∇_x g`` (one gradient)."""
        return self._difference(v, wrt_x=True)[0]

    def both(self, v: Sequence[Tensor]) -> tuple[TensorTuple, TensorTuple]:
        """``(∇²_xy g · v, ∇²_yy g · v)`` by one difference of ``∇_{(x,y)} g`` (one gradient)."""
        return self._difference(v, wrt_x=True)


def _quotient(diff: Tensor, eps: Scalar) -> Tensor:
    return diff / broadcast(eps.to(diff.dtype), diff) if isinstance(eps, Tensor) else diff / eps


# ------------------------------------------------------------------------------ linear solve
class _CGIterate(NamedTuple):
    """Where a conjugate-gradient solve stands: solution ``sol``, residual ``r``, search
    direction ``p``, the squared residual norm ``rs`` and, per client, whether it still
    iterates (``active``)."""

    sol: TensorTuple
    r: TensorTuple
    p: TensorTuple
    rs: Tensor
    active: Tensor


def capturing_graph(t: Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``t``'s GPU (then no
    value may be read on the host; ``False`` for a tensor on the CPU)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _damped(
    matvec: Callable[[TensorTuple], TensorTuple], damping: float
) -> Callable[[TensorTuple], TensorTuple]:
    """``u -> (A + damping·I) u`` for :func:`solve_cg`, checking that ``matvec`` keeps the
    tuple's length."""

    def apply(u: TensorTuple) -> TensorTuple:
        au = tuple(matvec(u))
        if len(au) != len(u):
            raise ValueError(
                f"solve_cg: matvec returned {len(au)} tensors for an input of {len(u)}."
            )
        return tuple_axpy(damping, u, au) if damping != 0.0 else au

    return apply


def _cg_start(
    apply: Callable[[TensorTuple], TensorTuple], b: TensorTuple, x0: Sequence[Tensor] | None
) -> tuple[TensorTuple, TensorTuple, int]:
    """``(solution, residual, products made)`` before the first iteration: zeros and ``b``,
    or the warm start ``x0`` and its residual (one product)."""
    if x0 is None:
        return tuple(torch.zeros_like(bi) for bi in b), b, 0
    sol = tuple(x0)
    if len(sol) != len(b) or any(s.shape != bi.shape for s, bi in zip(sol, b, strict=True)):
        raise ValueError(
            "solve_cg.x0 must have the shapes of b, got "
            f"{[tuple(s.shape) for s in sol]} for b of {[tuple(bi.shape) for bi in b]}."
        )
    return sol, tuple_axpy(-1.0, apply(sol), b), 1


def _cg_update(
    it: _CGIterate, ap: TensorTuple, curvature: Tensor, threshold: Tensor, lead: int
) -> _CGIterate:
    """One conjugate-gradient step from ``it`` along ``p`` (``ap = (A + λI) p``, ``curvature
    = pᵀ ap``); for a cohort, clients no longer active keep their iterate."""
    alpha = it.rs / curvature
    new_sol = tuple_axpy(alpha, it.p, it.sol)
    new_r = tuple_axpy(-alpha, ap, it.r)
    rs_new = tuple_dot(new_r, new_r, lead)
    new_p = tuple_axpy(rs_new / it.rs, it.p, new_r)
    mask = None if lead == 0 else it.active
    rs = rs_new if mask is None else torch.where(mask, rs_new, it.rs)
    return _CGIterate(
        sol=tuple_where(mask, new_sol, it.sol),
        r=tuple_where(mask, new_r, it.r),
        p=tuple_where(mask, new_p, it.p),
        rs=rs,
        active=it.active & (rs.double() > threshold),
    )


def solve_cg(
    matvec: Callable[[TensorTuple], TensorTuple],
    b: Sequence[Tensor],
    *,
    max_iter: int,
    tol: float = 1e-10,
    damping: float = 0.0,
    x0: Sequence[Tensor] | None = None,
    lead: int = 0,
) -> tuple[TensorTuple, int | Tensor]:
    """Solve ``(A + damping·I) v = b`` by conjugate gradient on tuples of tensors.

    ``A`` is given only through ``matvec(u) -> A u`` and must be symmetric positive definite
    (after damping) on the tuple space of ``b``; tensors may have any shapes and are never
    flattened together. Written by hand rather than taken from TorchOpt (``torchopt.linalg.cg``
    installs beside radbo's torch): radbo needs per-client step sizes and stopping tests on a
    stacked cohort, truncation on non-positive curvature, and its own count of products. Like
    TorchOpt's, it is a pure solver: a caller that wants each product marked (for the FLOP
    meter: :func:`radbo.loops.cg_product`) wraps ``matvec``.

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
        lead: 1 for a cohort (clients stacked on dim 0, ``A`` block diagonal over clients):
            every client has its own step sizes and stops on its own; a client that stopped
            keeps its solution while the others go on. Inside a CUDA graph's capture
            (:func:`capturing_graph`, where nothing may be read on the host) a cohort's solve
            runs all ``max_iter`` iterations, stopped clients masked: the same solution and
            counts as stopping once every client has.

    Returns:
        ``(v, n_matvec)``: the solution and the number of ``matvec`` calls made (the CG
        iterations, plus one when ``x0`` is given); for a cohort, a tensor with each client's
        count (the calls it would have made alone). If ``b`` is zero and no ``x0`` is given,
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
    check_int("solve_cg", "max_iter", max_iter, low=1)
    check_finite("solve_cg", "tol", tol, low=0, strict=False)
    check_finite("solve_cg", "damping", damping, low=0, strict=False)
    b = tuple(b)
    apply = _damped(matvec, damping)
    sol, r, calls = _cg_start(apply, b, x0)
    # The comparisons are in float64 (as Python floats would be) and the step sizes are
    # quotients of the tensors' own dtype: one client reproduces plain-float CG exactly.
    threshold = tol * tuple_dot(b, b, lead).double()
    rs = tuple_dot(r, r, lead)
    it = _CGIterate(sol, r, r, rs, rs.double() > threshold)  # active: per client, iterating
    counts = torch.full(it.active.shape, calls, dtype=torch.int64, device=it.active.device)
    # Inside a CUDA graph's capture nothing may be read on the host: a cohort's solve then
    # runs every iteration, clients that stopped masked as they are once some stop (the same
    # values, and the same counts, as stopping when all have).
    capturing = lead > 0 and capturing_graph(it.active)
    for _ in range(max_iter):
        if not capturing and not bool(it.active.any()):
            break
        ap = apply(it.p)
        counts = counts + it.active.long()
        curvature = tuple_dot(it.p, ap, lead)
        # non-positive curvature (or NaN): truncate
        it = it._replace(active=it.active & (curvature > 0.0))
        if lead == 0 and not bool(it.active):
            break
        it = _cg_update(it, ap, curvature, threshold, lead)
    return it.sol, (int(counts) if lead == 0 else counts)


# --------------------------------------------------------------- directions of bilevel methods
@dataclass(frozen=True)
class BilevelDirections:
    """The directions of a simultaneous bilevel step at ``(x, y, v)`` (all detached):

    * ``x = ∇_x f(x, y) − ∇²_xy g(x, y) · v`` -- the hypergradient estimate for ``x``;
    * ``y = ∇_y g(x, y)`` -- the descent direction of the inner problem;
    * ``v = ∇²_yy g(x, y) · v − ∇_y f(x, y)`` -- the gradient in ``v`` of the quadratic
      ``½ vᵀ H_yy v − vᵀ ∇_y f`` whose minimiser is ``[∇²_yy g]⁻¹ ∇_y f``.

    SimFBO eq. (3) steps along them; they are FedMSA's maps P and S of eq. (10). ``f`` and
    ``g`` are the loss values at ``(x, y)``; ``n_grad`` / ``n_hvp`` count the work.
    """

    x: Params
    y: Params
    v: Params
    f: Tensor
    g: Tensor
    n_grad: int
    n_hvp: int


def bilevel_directions(
    system: Linearization,
    outer_loss: BilevelLoss,
    x: Params,
    y: Params,
    v: Params,
) -> BilevelDirections:
    """:class:`BilevelDirections` at ``(x, y, v)`` with the products of ``system`` (the inner
    loss linearised at ``(x, y)``): one gradient of ``f`` plus one joint product."""
    values: list[Tensor] = []
    x_names, y_names = tuple(x), tuple(y)
    fx, fy = loss_grads(
        outer_loss,
        "outer_loss",
        x_names,
        tuple(x.values()),
        y_names,
        tuple(y.values()),
        wrt_x=True,
        wrt_y=True,
        lead=system.lead,
        value=values,
    )
    vt = tuple(v[n] for n in y_names)
    jxy, hyy = system.both(vt)
    return BilevelDirections(
        x={n: a - b for n, a, b in zip(x_names, fx, jxy, strict=True)},
        y=dict(zip(y_names, system.grad_y_g, strict=True)),
        v={n: a - b for n, a, b in zip(y_names, hyy, fy, strict=True)},
        f=values[0],
        g=system.g_value,
        n_grad=system.n_grad + 1,
        n_hvp=system.n_hvp,
    )


@dataclass(frozen=True)
class PenaltyGradients:
    """The first-order oracle of ``L_λ(x, y, z) = f(x, y) + λ (g(x, y) − g(x, z))``
    (``papers/fedsbo_first_order.txt`` eqs. (3)-(6); Kwon et al., 2023), all detached:

    * ``x = ∇_x f(x, y) + λ (∇_x g(x, y) − ∇_x g(x, z))`` -- eq. (6)'s ``m_x = u_1 + λ(u_2 − u_3)``,
      the penalty hypergradient (empty without ``with_x``);
    * ``y = ∇_y f(x, y) + λ ∇_y g(x, y)`` -- ``m_y = v_1 + λ v_2``: ``y`` descends towards
      ``y_λ = argmin_y f + λ g``;
    * ``z = ∇_y g(x, z)`` -- ``z`` descends towards ``y* = argmin_y g`` (the paper's
      ``m_z = λ w_1`` is this times ``λ``).

    ``parts`` keeps the six gradients the combinations are made of (``"f_x"``, ``"g_x"``,
    ``"gz_x"``, ``"f_y"``, ``"g_y"``, ``"gz_y"``; the x ones empty without ``with_x``) for
    variance-reduced methods that track them one by one. ``f = f(x, y)``, ``g = g(x, z)``;
    ``n_grad = 3`` (one gradient of each loss at each point).
    """

    x: Params
    y: Params
    z: Params
    parts: dict[str, Params]
    f: Tensor
    g: Tensor
    n_grad: int = 3


def penalty_gradients(
    outer_loss: BilevelLoss,
    inner_loss: BilevelLoss,
    x: Params,
    y: Params,
    z: Params,
    lam: float,
    *,
    with_x: bool = True,
    lead: int = 0,
) -> PenaltyGradients:
    """:class:`PenaltyGradients` at ``(x, y, z)``: three gradient evaluations, no second
    derivatives. Without ``with_x`` only the y- and z-gradients are taken (cheaper: the
    backward pass stops at y)."""
    x_names, y_names = tuple(x), tuple(y)
    xs = tuple(x.values())
    f_values: list[Tensor] = []
    g_values: list[Tensor] = []

    def grads(loss: BilevelLoss, name: str, point: Params, values: list[Tensor] | None):
        pt = tuple(point[n] for n in y_names)
        return loss_grads(
            loss,
            name,
            x_names,
            xs,
            y_names,
            pt,
            wrt_x=with_x,
            wrt_y=True,
            lead=lead,
            value=values,
        )

    f_x, f_y = grads(outer_loss, "outer_loss", y, f_values)
    g_x, g_y = grads(inner_loss, "inner_loss", y, None)
    gz_x, gz_y = grads(inner_loss, "inner_loss", z, g_values)
    named = lambda names, ts: dict(zip(names, ts, strict=True)) if ts else {}  # noqa: E731
    m_x = tuple(a + lam * (b - c) for a, b, c in zip(f_x, g_x, gz_x, strict=True))
    m_y = tuple(a + lam * b for a, b in zip(f_y, g_y, strict=True))
    parts = {
        "f_x": named(x_names, f_x),
        "g_x": named(x_names, g_x),
        "gz_x": named(x_names, gz_x),
        "f_y": named(y_names, f_y),
        "g_y": named(y_names, g_y),
        "gz_y": named(y_names, gz_y),
    }
    return PenaltyGradients(
        x=named(x_names, m_x) if with_x else {},
        y=named(y_names, m_y),
        z=named(y_names, gz_y),
        parts=parts,
        f=f_values[0],
        g=g_values[0],
    )
