"""Shared pieces of the implicit hypergradient estimators.

The bilevel problem is ``min_x Φ(x) = f(x, y*(x))`` with ``y*(x) = argmin_y g(x, y)``. At a
point ``(x, y)`` (``y`` standing in for ``y*(x)``) the implicit hypergradient is eq. (7) of the
RABO paper (``papers/rabo_rafbo.txt``; the same formula is Lemma 1, eq. (2)-(3), of FedMBO)::

    ∇Φ(x) ≈ ∇_x f(x, y) − ∇²_xy g(x, y) · v,      v = [∇²_yy g(x, y)]⁻¹ ∇_y f(x, y),

where ``∇²_xy g`` is the ``dim(x) × dim(y)`` matrix of ``∂²g / ∂x_i ∂y_j``. Estimators differ
only in how they approximate ``v``; everything else lives here:

* :class:`HypergradResult` -- what every estimator returns (gradient, ``v``, cost counts and
  the estimator state to carry to the next call);
* :class:`HypergradEstimator` -- the one signature every estimator shares, and
  :func:`init_state` -- the initial state of a stateful estimator;
* :func:`tuple_dot` / :func:`tuple_axpy` -- linear algebra on tuples of tensors of any shapes
  (parameters are never flattened into one global vector);
* :class:`ImplicitSystem` -- ``∇_x f``, ``∇_y f`` and the second-order products
  ``H_yy · u`` and ``∇²_xy g · v`` at one point, by autograd double backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor

from radbo.typing import BilevelLoss, Params

__all__ = [
    "HypergradEstimator",
    "HypergradResult",
    "ImplicitSystem",
    "TensorTuple",
    "init_state",
    "tuple_axpy",
    "tuple_dot",
]

#: A vector of the product space of several tensors, one entry per named parameter.
TensorTuple = tuple[Tensor, ...]


@dataclass(frozen=True)
class HypergradResult:
    """A local hypergradient and what it cost.

    Attributes:
        grad: the hypergradient estimate, same keys and shapes as ``x``, detached.
        v: the solution of the linear system ``∇²_yy g · v = ∇_y f`` as approximated by the
            estimator, same keys and shapes as ``y``, detached.
        n_grad: first-order gradient evaluations made (each autograd pass of a loss with
            respect to its inputs counts 1).
        n_hvp: second-order products made (each ``H_yy · u`` and the final ``∇²_xy g · v``
            count 1 each).
        state: the estimator state to pass as ``state=`` to the next call, detached, keyed
            ``f"{key}:{y_name}"`` for every ``key`` in the estimator's ``state_keys`` (e.g.
            ``"y_lambda:head.weight"``); empty for stateless estimators (the default).
    """

    grad: Params
    v: Params
    n_grad: int
    n_hvp: int
    state: Params = field(default_factory=dict)


@runtime_checkable
class HypergradEstimator(Protocol):
    """The signature every hypergradient estimator shares.

    An estimator is a frozen, configured callable. It evaluates ``outer_loss`` (f) and
    ``inner_loss`` (g) at ``(x, y)`` and returns the hypergradient with respect to ``x``. It
    must not mutate ``x`` or ``y`` and must accept tensors that do not require grad.

    Keyword arguments (both optional, so ``estimator(f, g, x, y)`` always works):

    * ``generator`` -- the source of randomness of randomised estimators (e.g. the sampled
      coordinate set of :class:`~radbo.hypergrad.FiniteDifference`); deterministic
      estimators ignore it.
    * ``state`` -- the ``HypergradResult.state`` of the previous call (or
      :func:`init_state`), for estimators that warm-start auxiliary variables across calls
      (e.g. ``y_λ`` and ``z`` of :class:`~radbo.hypergrad.FirstOrder`); ``None`` starts from
      ``y``. Stateless estimators ignore it.

    ``state_keys`` names the y-shaped state blocks an estimator keeps (``()`` when stateless).
    """

    state_keys: ClassVar[tuple[str, ...]]

    def __call__(
        self,
        outer_loss: BilevelLoss,
        inner_loss: BilevelLoss,
        x: Params,
        y: Params,
        *,
        generator: torch.Generator | None = None,
        state: Params | None = None,
    ) -> HypergradResult: ...


def init_state(estimator: HypergradEstimator, y: Params) -> Params:
    """The initial ``state`` of ``estimator`` at ``y``: a detached clone of ``y`` per state key.

    Keys are ``f"{key}:{y_name}"``; stateless estimators (``state_keys == ()``) get ``{}``.
    Passing this state is equivalent to passing ``state=None``.

    >>> import torch
    >>> from radbo.hypergrad import FirstOrder, ImplicitCG
    >>> sorted(init_state(FirstOrder(), {"w": torch.zeros(2)}))
    ['y_lambda:w', 'z:w']
    >>> init_state(ImplicitCG(), {"w": torch.zeros(2)})
    {}
    """
    keys: tuple[str, ...] = getattr(estimator, "state_keys", ())
    return {f"{key}:{name}": t.detach().clone() for key in keys for name, t in y.items()}


def _state_blocks(owner: str, key: str, state: Params | None, y: Params) -> TensorTuple:
    """The ``key`` block of ``state`` as a tuple ordered like ``y`` (detached clones).

    ``state=None`` (or an empty dict) starts from ``y``. A non-empty state must hold
    ``f"{key}:{name}"`` for every name of ``y``, shaped like ``y[name]``.
    """
    if not state:
        return tuple(t.detach().clone() for t in y.values())
    out = []
    for name, t in y.items():
        full = f"{key}:{name}"
        if full not in state:
            raise ValueError(
                f"{owner}: state lacks {full!r} (it has {sorted(state)}); pass the state "
                "returned by the previous call, init_state(estimator, y), or None."
            )
        block = state[full]
        if not isinstance(block, Tensor) or block.shape != t.shape:
            shape = tuple(block.shape) if isinstance(block, Tensor) else type(block).__name__
            raise ValueError(
                f"{owner}: state[{full!r}] must have the shape of y[{name!r}], "
                f"{tuple(t.shape)}, got {shape}."
            )
        out.append(block.detach().clone().to(dtype=t.dtype, device=t.device))
    return tuple(out)


def tuple_dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """Inner product ``Σ_k <a_k, b_k>`` of two tuples of same-shaped tensors (a 0-dim tensor).

    >>> import torch
    >>> float(tuple_dot((torch.tensor([1.0, 2.0]), torch.ones(2, 2)),
    ...                 (torch.tensor([3.0, 4.0]), torch.full((2, 2), 0.5))))
    13.0
    """
    if len(a) != len(b):
        raise ValueError(f"tuple_dot needs tuples of equal length, got {len(a)} and {len(b)}.")
    if len(a) == 0:
        return torch.zeros(())
    terms = [torch.sum(ai * bi) for ai, bi in zip(a, b, strict=True)]
    return torch.stack(terms).sum()


def tuple_axpy(alpha: float | Tensor, x: Sequence[Tensor], y: Sequence[Tensor]) -> TensorTuple:
    """``alpha * x + y`` for tuples of same-shaped tensors (out of place).

    >>> import torch
    >>> tuple_axpy(2.0, (torch.tensor([1.0]),), (torch.tensor([3.0]),))
    (tensor([5.]),)
    """
    if len(x) != len(y):
        raise ValueError(f"tuple_axpy needs tuples of equal length, got {len(x)} and {len(y)}.")
    return tuple(yi + alpha * xi for xi, yi in zip(x, y, strict=True))


def _grad(
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


def _loss_grads(
    loss: BilevelLoss,
    name: str,
    x_names: Sequence[str],
    x: Sequence[Tensor],
    y_names: Sequence[str],
    y: Sequence[Tensor],
    *,
    wrt_x: bool,
    wrt_y: bool,
) -> tuple[TensorTuple, TensorTuple]:
    """First-order ``(∇_x loss, ∇_y loss)`` at ``(x, y)``, detached; one gradient evaluation.

    Only the requested blocks are differentiated (the other comes back as ``()``); inputs
    the loss does not use get zeros. Never builds a graph of the gradient
    (``create_graph=False``): this is the oracle of the second-order-free estimators. The
    inputs are detached, not copied, and never written to.
    """
    with torch.enable_grad():
        xl = tuple(t.detach().requires_grad_(True) if wrt_x else t.detach() for t in x)
        yl = tuple(t.detach().requires_grad_(True) if wrt_y else t.detach() for t in y)
        value = _scalar(
            name,
            loss(dict(zip(x_names, xl, strict=True)), dict(zip(y_names, yl, strict=True))),
        )
        inputs = (xl if wrt_x else ()) + (yl if wrt_y else ())
        grads = _grad([value], inputs, None, create_graph=False)
    grads = tuple(t.detach() for t in grads)
    n_x = len(xl) if wrt_x else 0
    return grads[:n_x], grads[n_x:]


def _leaf(name: str, key: str, t: Tensor) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(t).__name__}.")
    if not t.is_floating_point():
        raise ValueError(
            f"{name}[{key!r}] must be a floating-point tensor to be differentiated, got "
            f"dtype {t.dtype}; keep integer buffers out of x and y."
        )
    return t.detach().clone().requires_grad_(True)


def _scalar(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} must return a scalar tensor, got {shape}.")
    return value.reshape(())


class InnerSystem:
    """Second-order products of the inner loss at one point ``(x, y)``, by autograd.

    Building it costs one gradient evaluation: ``∇_y g(x, y)`` with ``create_graph=True``.
    That graph is built once and reused (``retain_graph``) by every product:

    * :meth:`hvp`: ``H_yy · u = ∂/∂y <∇_y g(x, y), u>`` (double backward);
    * :meth:`mixed`: ``∇²_xy g · v = ∂/∂x <∇_y g(x, y), v>``.

    The inputs are detached and cloned, never mutated; the loss receives fresh leaf tensors
    that require grad. Tensors of ``x`` that the loss does not use get zero derivatives.
    :attr:`n_grad` and :attr:`n_hvp` count the work done so far. FedMBO's clients, which
    each make one product of a Neumann chain, use this directly.
    """

    def __init__(self, inner_loss: BilevelLoss, x: Params, y: Params) -> None:
        self._leaves(x, y)
        self._build_inner(inner_loss)
        #: First-order gradient evaluations made so far (1 once built).
        self.n_grad: int = 1
        #: Second-order products made so far.
        self.n_hvp: int = 0

    def _leaves(self, x: Params, y: Params) -> None:
        if len(y) == 0:
            raise ValueError("y must hold at least one tensor, got an empty dict.")
        self.x_names: tuple[str, ...] = tuple(x)
        self.y_names: tuple[str, ...] = tuple(y)
        self._x: TensorTuple = tuple(_leaf("x", k, t) for k, t in x.items())
        self._y: TensorTuple = tuple(_leaf("y", k, t) for k, t in y.items())

    def _leaf_dicts(self) -> tuple[Params, Params]:
        return (
            dict(zip(self.x_names, self._x, strict=True)),
            dict(zip(self.y_names, self._y, strict=True)),
        )

    def _build_inner(self, inner_loss: BilevelLoss) -> None:
        x_leaf, y_leaf = self._leaf_dicts()
        g = _scalar("inner_loss", inner_loss(x_leaf, y_leaf))
        self._grad_y_g: TensorTuple = _grad([g], self._y, None, create_graph=True)

    @property
    def grad_y_g(self) -> TensorTuple:
        """``∇_y g(x, y)`` (detached), one tensor per name of ``y``."""
        return tuple(t.detach() for t in self._grad_y_g)

    def hvp(self, u: Sequence[Tensor]) -> TensorTuple:
        """``∇²_yy g(x, y) · u`` for ``u`` shaped like ``y`` (counts one product)."""
        self.n_hvp += 1
        out = _grad(self._grad_y_g, self._y, u, create_graph=False)
        return tuple(t.detach() for t in out)

    def mixed(self, v: Sequence[Tensor]) -> TensorTuple:
        """``∇²_xy g(x, y) · v`` for ``v`` shaped like ``y``, shaped like ``x`` (one product)."""
        self.n_hvp += 1
        out = _grad(self._grad_y_g, self._x, v, create_graph=False)
        return tuple(t.detach() for t in out)


class ImplicitSystem(InnerSystem):
    """First- and second-order derivatives of a bilevel problem at one point ``(x, y)``.

    Building the system costs two gradient evaluations: one autograd pass of ``f`` with
    respect to ``(x, y)`` (giving ``∇_x f`` and ``∇_y f``) and one of ``g`` with respect to
    ``y`` with ``create_graph=True``, whose graph :meth:`hvp` and :meth:`mixed` reuse (see
    :class:`InnerSystem`). :meth:`result` finishes eq. (7) of the RABO paper for a given
    ``v``.
    """

    def __init__(
        self, outer_loss: BilevelLoss, inner_loss: BilevelLoss, x: Params, y: Params
    ) -> None:
        self._leaves(x, y)
        x_leaf, y_leaf = self._leaf_dicts()
        # f first: its graph is freed before g's double-backward graph is built
        f = _scalar("outer_loss", outer_loss(x_leaf, y_leaf))
        grads_f = _grad([f], self._x + self._y, None, create_graph=False)
        #: ``∇_x f(x, y)``, one tensor per name of ``x``.
        self.grad_x_f: TensorTuple = tuple(t.detach() for t in grads_f[: len(self._x)])
        #: ``∇_y f(x, y)``, one tensor per name of ``y``: the right-hand side for ``v``.
        self.grad_y_f: TensorTuple = tuple(t.detach() for t in grads_f[len(self._x) :])
        self._build_inner(inner_loss)
        self.n_grad = 2
        self.n_hvp = 0

    def result(self, v: Sequence[Tensor]) -> HypergradResult:
        """Eq. (7) of RABO: ``∇_x f − ∇²_xy g · v``, packaged with ``v`` and the counts."""
        v = tuple(t.detach() for t in v)
        correction = self.mixed(v)
        grad = tuple_axpy(-1.0, correction, self.grad_x_f)
        return HypergradResult(
            grad=dict(zip(self.x_names, grad, strict=True)),
            v=dict(zip(self.y_names, v, strict=True)),
            n_grad=self.n_grad,
            n_hvp=self.n_hvp,
        )


def _check_finite(owner: str, field: str, value: float, *, low: float, strict: bool) -> None:
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


def _check_int(owner: str, field: str, value: int, *, low: int) -> None:
    """Raise ValueError unless ``value`` is an int ``>= low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}.{field} must be an integer >= {low}, got {value!r}.")
