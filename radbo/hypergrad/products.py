"""Second-order products of the inner loss for simultaneous methods (SimFBO / ShroFBO).

Single-loop methods such as SimFBO and ShroFBO (``papers/simfbo_shrofbo.txt``, Alg. 1) update
``y``, the auxiliary ``v`` and ``x`` together each local step; besides the gradients of ``g``
they need two products at ``(x, y)`` with the current ``v``:

* ``hvp_yy = ∇²_yy g(x, y) · v`` (``y``-shaped), for the ``v`` update;
* ``jvp_xy = ∇²_xy g(x, y) · v = ∂/∂x ⟨∇_y g(x, y), v⟩`` (``x``-shaped), for the ``x`` update.

A :class:`SecondOrderProducts` implementation returns both together with ``∇_x g`` and
``∇_y g`` (a :class:`ProductResult`), either exactly by autograd (:class:`AutogradProducts`)
or second-order free by a forward difference of the gradient
(:class:`FiniteDifferenceProducts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from radbo.hypergrad.base import (
    TensorTuple,
    _check_finite,
    _grad,
    _leaf,
    _loss_grads,
    _scalar,
    tuple_axpy,
    tuple_dot,
)
from radbo.typing import BilevelLoss, Params

__all__ = [
    "AutogradProducts",
    "FiniteDifferenceProducts",
    "ProductResult",
    "SecondOrderProducts",
]


@dataclass(frozen=True)
class ProductResult:
    """Gradients and second-order products of ``g`` at one point, all detached.

    Attributes:
        grad_x: ``∇_x g(x, y)``, keyed and shaped like ``x``.
        grad_y: ``∇_y g(x, y)``, keyed and shaped like ``y``.
        hvp_yy: ``∇²_yy g(x, y) · v``, keyed and shaped like ``y``.
        jvp_xy: ``∇²_xy g(x, y) · v = ∂/∂x ⟨∇_y g(x, y), v⟩``, keyed and shaped like ``x``.
        n_grad: first-order gradient evaluations made.
        n_hvp: second-order (double-backward) products made.
    """

    grad_x: Params
    grad_y: Params
    hvp_yy: Params
    jvp_xy: Params
    n_grad: int
    n_hvp: int


@runtime_checkable
class SecondOrderProducts(Protocol):
    """``products(inner_loss, x, y, v) -> ProductResult`` for ``v`` shaped like ``y``.

    Implementations are frozen, configured callables; they never mutate their inputs,
    accept tensors that do not require grad, and give zeros for tensors of ``x`` that ``g``
    does not use.
    """

    def __call__(self, inner_loss: BilevelLoss, x: Params, y: Params, v: Params) -> ProductResult:
        """Gradients of ``inner_loss`` and its products with ``v`` at ``(x, y)``."""
        ...


def _check_v(y: Params, v: Params) -> TensorTuple:
    if set(v) != set(y):
        raise ValueError(f"v must have the keys of y, {sorted(y)}, got {sorted(v)}.")
    out = []
    for k, t in y.items():
        vk = v[k]
        if not isinstance(vk, torch.Tensor) or vk.shape != t.shape:
            shape = tuple(vk.shape) if isinstance(vk, torch.Tensor) else type(vk).__name__
            raise ValueError(
                f"v[{k!r}] must have the shape of y[{k!r}], {tuple(t.shape)}, got {shape}."
            )
        out.append(vk.detach().to(dtype=t.dtype, device=t.device))
    return tuple(out)


def _result(
    x: Params,
    y: Params,
    parts: tuple[TensorTuple, TensorTuple, TensorTuple, TensorTuple],
    n_grad: int,
    n_hvp: int,
) -> ProductResult:
    gx, gy, hyy, jxy = parts
    return ProductResult(
        grad_x=dict(zip(x, gx, strict=True)),
        grad_y=dict(zip(y, gy, strict=True)),
        hvp_yy=dict(zip(y, hyy, strict=True)),
        jvp_xy=dict(zip(x, jxy, strict=True)),
        n_grad=n_grad,
        n_hvp=n_hvp,
    )


@dataclass(frozen=True)
class AutogradProducts:
    """Exact products by autograd double backward.

    One gradient of ``g`` with respect to ``(x, y)`` with ``create_graph=True``, then one
    backward of ``⟨∇_y g, v⟩`` with respect to ``(x, y)`` gives both products at once
    (its y-part is ``∇²_yy g · v``, its x-part ``∇²_xy g · v``).

    Cost: ``n_grad = 1``, ``n_hvp = 1``.

    >>> import torch
    >>> g = lambda x, y: (x["a"] * y["w"] ** 2).sum()           # ∇_w g = 2 a w
    >>> r = AutogradProducts()(g, {"a": torch.tensor([3.0])}, {"w": torch.tensor([2.0])},
    ...                        {"w": torch.tensor([1.0])})
    >>> r.hvp_yy["w"], r.jvp_xy["a"], r.n_grad, r.n_hvp       # 2 a v, 2 w v
    (tensor([6.]), tensor([4.]), 1, 1)
    """

    def __call__(self, inner_loss: BilevelLoss, x: Params, y: Params, v: Params) -> ProductResult:
        """Gradients of ``inner_loss`` and its exact products with ``v`` at ``(x, y)``."""
        if len(y) == 0:
            raise ValueError("y must hold at least one tensor, got an empty dict.")
        vs = _check_v(y, v)
        xl = tuple(_leaf("x", k, t) for k, t in x.items())
        yl = tuple(_leaf("y", k, t) for k, t in y.items())
        with torch.enable_grad():
            g = _scalar(
                "inner_loss",
                inner_loss(dict(zip(x, xl, strict=True)), dict(zip(y, yl, strict=True))),
            )
            first = _grad([g], xl + yl, None, create_graph=True)
            gy = first[len(xl) :]
            second = _grad(gy, xl + yl, vs, create_graph=False)
        gx = tuple(t.detach() for t in first[: len(xl)])
        gy = tuple(t.detach() for t in gy)
        second = tuple(t.detach() for t in second)
        parts = (gx, gy, second[len(xl) :], second[: len(xl)])
        return _result(x, y, parts, n_grad=1, n_hvp=1)


@dataclass(frozen=True)
class FiniteDifferenceProducts:
    """Second-order-free products by a forward difference of ``∇_{(x, y)} g`` along ``v``.

    ::

        ε = mu / max(||v||, tiny)
        (∇²_xy g · v, ∇²_yy g · v) ≈ (∇_{(x,y)} g(x, y + ε v) − ∇_{(x,y)} g(x, y)) / ε

    (``||v||`` over all tensors of ``v``), so the y-step has norm ``mu`` whatever the scale
    of ``v``; ``v = 0`` gives zero products. Exact up to rounding when ``g`` is quadratic in
    ``y``; otherwise the error is ``O(mu · ||v||)`` relative to the third derivative of ``g``
    (about ``1e-3`` relative with the default on a small tanh network).

    Attributes:
        mu: the norm ``> 0`` of the y-step; default ``1e-3``.

    Cost: ``n_grad = 2`` (the gradient at ``y`` and at ``y + ε v``), ``n_hvp = 0``.

    >>> import torch
    >>> g = lambda x, y: (x["a"] * y["w"] ** 2).sum()
    >>> r = FiniteDifferenceProducts()(g, {"a": torch.tensor([3.0], dtype=torch.float64)},
    ...     {"w": torch.tensor([2.0], dtype=torch.float64)},
    ...     {"w": torch.tensor([1.0], dtype=torch.float64)})
    >>> round(float(r.hvp_yy["w"]), 6), round(float(r.jvp_xy["a"]), 6), r.n_grad, r.n_hvp
    (6.0, 4.001, 2, 0)
    """

    mu: float = 1e-3

    def __post_init__(self) -> None:
        _check_finite("FiniteDifferenceProducts", "mu", self.mu, low=0, strict=True)

    def __call__(self, inner_loss: BilevelLoss, x: Params, y: Params, v: Params) -> ProductResult:
        """Gradients of ``inner_loss`` and finite-difference products with ``v``."""
        if len(y) == 0:
            raise ValueError("y must hold at least one tensor, got an empty dict.")
        vs = _check_v(y, v)
        x_names, y_names = tuple(x), tuple(y)
        xs = tuple(_leaf("x", k, t).detach() for k, t in x.items())
        ys = tuple(_leaf("y", k, t).detach() for k, t in y.items())
        gx, gy = _loss_grads(
            inner_loss, "inner_loss", x_names, xs, y_names, ys, wrt_x=True, wrt_y=True
        )
        norm = math.sqrt(float(tuple_dot(vs, vs)))
        eps = self.mu / norm if norm > 0.0 else self.mu
        sx, sy = _loss_grads(
            inner_loss,
            "inner_loss",
            x_names,
            xs,
            y_names,
            tuple_axpy(eps, vs, ys),
            wrt_x=True,
            wrt_y=True,
        )
        jxy = tuple((s - b) / eps for s, b in zip(sx, gx, strict=True))
        hyy = tuple((s - b) / eps for s, b in zip(sy, gy, strict=True))
        return _result(x, y, (gx, gy, hyy, jxy), n_grad=2, n_hvp=0)
