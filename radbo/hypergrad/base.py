"""The ``[estimator]`` section: one interface for every hypergradient estimator.

The bilevel problem is ``min_x Φ(x) = f(x, y*(x))`` with ``y*(x) = argmin_y g(x, y)``. At a
point ``(x, y)`` (``y`` standing in for ``y*(x)``) the implicit hypergradient is eq. (7) of the
RABO paper (Li et al., "Distributed Bilevel Optimization with Dual Pruning for Resource-limited
Clients", ``papers/rabo_rafbo.txt``; the same formula is Lemma 1, eq. (2)-(3), of FedMBO)::

    ∇Φ(x) ≈ ∇_x f(x, y) − ∇²_xy g(x, y) · v,      v = [∇²_yy g(x, y)]⁻¹ ∇_y f(x, y).

An :class:`Estimator` is a frozen, validated config section (``[estimator] name = ...``) that is
also the callable radbo runs; its settings are declared once, on the class. It offers some of
three capabilities, which the algorithms use:

* ``"hypergradient"`` -- ``estimator(f, g, x, y) -> HypergradResult`` (RABO, RAFBO);
* ``"products"`` -- ``estimator.linearize(g, x, y) -> Linearization``: ``∇²_yy g · u`` and
  ``∇²_xy g · v`` (SimFBO / ShroFBO, FedMSA, FedMBO);
* ``"penalty"`` -- the penalty parameter ``λ`` of the fully first-order method
  (:func:`radbo.autodiff.penalty_gradients`; SimFBO / ShroFBO's first-order mode).

The arithmetic is :mod:`radbo.autodiff`'s; estimators only choose how ``v`` is approximated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from radbo.autodiff import Linearization, TensorTuple
from radbo.registry import Registry, Section
from radbo.typing import BilevelLoss, Params

__all__ = [
    "ESTIMATORS",
    "Capability",
    "Estimator",
    "FiniteFloat",
    "HypergradResult",
    "MemoryFootprint",
    "init_state",
]

#: What an estimator can give an algorithm (see the module docstring).
Capability = Literal["hypergradient", "products", "penalty"]
#: A float that must be finite (no NaN, no infinity).
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


@dataclass(frozen=True)
class MemoryFootprint:
    """What an estimator's memory model (:meth:`Estimator.hypergradient_bytes`) reads of the
    (sub)model being trained (:func:`radbo.devices.estimate_training_memory` makes it).

    Attributes:
        x_bytes / y_bytes: the bytes of the outer and inner parameters, |x| and |y|.
        second_order: the bytes autograd keeps for second-order products: the forward of
            ``g`` and what ``∇_y g`` built with ``create_graph=True`` saves for double
            backward, counted on the ``meta`` device when called (only an estimator with
            second-order products calls it).
        activations: the bytes autograd saves for one first-order backward of the loss on
            a batch (what each point of a batched evaluation holds again; default 0).
    """

    x_bytes: int
    y_bytes: int
    second_order: Callable[[], int]
    activations: int = 0


@dataclass(frozen=True)
class HypergradResult:
    """A local hypergradient and what it cost.

    Attributes:
        grad: the hypergradient estimate, same keys and shapes as ``x``, detached.
        v: the solution of the linear system ``∇²_yy g · v = ∇_y f`` as approximated by the
            estimator, same keys and shapes as ``y``, detached.
        n_grad: first-order gradient evaluations made (each autograd pass of a loss with
            respect to its inputs counts 1); for a cohort (``lead = 1``) possibly one count
            per client.
        n_hvp: second-order products made (each ``H_yy · u`` and the final ``∇²_xy g · v``
            count 1 each); per client for a cohort.
        state: the estimator state to pass as ``state=`` to the next call, detached, keyed
            ``f"{key}:{y_name}"`` for every ``key`` in the estimator's ``state_keys`` (e.g.
            ``"y_lambda:head.weight"``); empty for stateless estimators (the default).
    """

    grad: Params
    v: Params
    n_grad: int | Tensor
    n_hvp: int | Tensor
    state: Params = field(default_factory=dict)


#: The registered ``[estimator]`` kinds.
ESTIMATORS: Registry[Estimator] = Registry("estimator", "name")


class Estimator(Section):
    """Base of every ``[estimator]`` kind (see the module docstring).

    Class attributes a kind sets:
        capabilities: what it offers (``"hypergradient"``, ``"products"``, ``"penalty"``).
        products_fields / penalty_fields: the settings that matter when an algorithm uses
            only its products (resp. its penalty); the others are refused there.
        state_keys: the y-shaped state blocks it carries between calls (``()``: stateless).

    Calls take ``generator`` (random draws made on the spot, e.g. RAFBO's coordinate set),
    or ``draws`` made beforehand by :meth:`draw` with that generator (what client work does,
    so that a batched backend draws exactly what one client would), ``state`` (see
    :func:`init_state`) and ``lead`` (1 for a cohort of clients stacked on dim 0; see
    :mod:`radbo.autodiff`).
    """

    name: str

    capabilities: ClassVar[frozenset[str]] = frozenset()
    products_fields: ClassVar[frozenset[str]] = frozenset()
    penalty_fields: ClassVar[frozenset[str]] = frozenset()
    state_keys: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def hypergradient_bytes(cls, footprint: MemoryFootprint) -> int:
        """The buffers this estimator needs beyond a plain training step, which the budget
        planner adds (:func:`radbo.devices.estimate_training_memory`). Default, an implicit
        hypergradient with second-order products (RABO eq. (7): CG, Neumann, autograd): the
        graph of ``∇_y g`` kept alive for the products (``footprint.second_order``), the CG
        vectors ``v, r, p, Ap`` (4|y|), ``∇_x f, ∇_y f`` (|x| + |y|), and the mixed product
        ``∇²_xy g · v`` and the hypergradient itself (2|x|)."""
        x, y = footprint.x_bytes, footprint.y_bytes
        return footprint.second_order() + 4 * y + (x + y) + 2 * x

    def memory_bytes(self, footprint: MemoryFootprint) -> int:
        """:meth:`hypergradient_bytes` for this estimator's settings (what the budget planner
        adds when it is given the configured estimator rather than its class); the same
        unless a setting changes the buffers (:class:`~radbo.hypergrad.FiniteDifference`'s
        ``coordinate_batch``)."""
        return self.hypergradient_bytes(footprint)

    def fields_for(self, use: str) -> frozenset[str] | None:
        """The settings that matter when an algorithm uses this estimator for ``use``
        (``None``: all of them)."""
        if use == "products":
            return self.products_fields
        if use == "penalty":
            return self.penalty_fields
        return None

    def draw(self, generator: torch.Generator | None, x: Params) -> dict[str, Tensor]:
        """The random draws one call at ``x`` makes (default: none)."""
        return {}

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
        """The hypergradient at ``(x, y)`` (estimators with the ``"hypergradient"``
        capability)."""
        raise TypeError(f"estimator {self.name!r} gives second-order products, not a hypergradient")

    def linearize(
        self, inner_loss: BilevelLoss, x: Params, y: Params, *, lead: int = 0, with_x: bool = True
    ) -> Linearization:
        """The inner loss linearised at ``(x, y)`` (estimators with ``"products"``);
        ``with_x = False`` when no ``∇²_xy g`` product will be asked for."""
        raise TypeError(f"estimator {self.name!r} gives no second-order products")


def init_state(estimator: Any, y: Params) -> Params:
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


def state_blocks(owner: str, key: str, state: Params | None, y: Params) -> Params:
    """The ``key`` block of ``state`` keyed like ``y`` (detached clones).

    ``state=None`` (or an empty dict) starts from ``y``. A non-empty state must hold
    ``f"{key}:{name}"`` for every name of ``y``, shaped like ``y[name]``.
    """
    if not state:
        return {name: t.detach().clone() for name, t in y.items()}
    out = {}
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
        out[name] = block.detach().clone().to(dtype=t.dtype, device=t.device)
    return out


def implicit_result(
    x_names: Sequence[str],
    y_names: Sequence[str],
    grad_x_f: TensorTuple,
    correction: TensorTuple,
    v: TensorTuple,
    n_grad: int | Tensor,
    n_hvp: int | Tensor,
) -> HypergradResult:
    """Eq. (7) of RABO, ``∇_x f − ∇²_xy g · v``, packaged with ``v`` and the counts."""
    grad = tuple(g - c for g, c in zip(grad_x_f, correction, strict=True))
    return HypergradResult(
        grad=dict(zip(x_names, grad, strict=True)),
        v=dict(zip(y_names, (t.detach() for t in v), strict=True)),
        n_grad=n_grad,
        n_hvp=n_hvp,
    )


def require_y(y: Params) -> None:
    if len(y) == 0:
        raise ValueError("y must hold at least one tensor, got an empty dict.")
