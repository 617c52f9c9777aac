"""Stacked convolution cases and checks shared by ``test_client_conv.py`` and
``test_stacked_conv.py`` (radbo's two vmap rules for a cohort's convolutions): the cases, their
tensors, vmap's own rule as the reference, a per-client loss, and the two checks each rule must
pass against that reference. Each test module states the sums its cases make and the tolerance
derived from them; both use 1e-12 relative and 1e-13 absolute in float64."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Conv = Callable[[Tensor, Tensor, Tensor | None], Tensor]

#: name -> (clients, batch, in channels, out channels, kernel, size, stride, padding, dilation,
#: groups); a batch of 0: one image per client, without a batch dimension
CASES = {
    "3x3": (3, 4, 3, 6, 3, 10, 1, 0, 1, 1),
    "5x5": (3, 4, 1, 6, 5, 12, 1, 0, 1, 1),
    "padded, strided": (2, 3, 3, 4, 3, 9, 2, 1, 1, 1),
    "dilated": (2, 2, 2, 3, 3, 10, 1, 2, 2, 1),
    "grouped per client": (3, 2, 4, 6, 3, 7, 1, 1, 1, 2),
    "one image": (3, 0, 2, 5, 3, 8, 1, 0, 1, 1),
    "same padding": (2, 3, 2, 4, 3, 8, 1, "same", 1, 1),
}
TOL = {"rtol": 1e-12, "atol": 1e-13}


def stacked(case: str, dtype: torch.dtype = torch.float64):
    """A cohort's inputs, weights and biases for ``case`` (clients first, requiring grad) and
    the convolution's settings ``(stride, padding, dilation, groups)``."""
    clients, batch, c, o, k, size, stride, padding, dilation, groups = CASES[case]
    gen = torch.Generator().manual_seed(0)
    lead = (batch,) if batch else ()
    x = torch.randn(clients, *lead, c, size, size, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(clients, o, c // groups, k, k, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(clients, o, generator=gen, dtype=dtype).requires_grad_()
    return x, w, b, (stride, padding, dilation, groups)


def plain(settings) -> Conv:
    """``F.conv2d``: under vmap, vmap's own rule (the reference)."""
    return lambda x, w, b: F.conv2d(x, w, b, *settings)


def loss(conv: Conv, x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Each client's scalar loss (one per client) through a nonlinearity."""
    return torch.vmap(lambda x_, w_, b_: conv(x_, w_, b_).tanh().square().sum())(x, w, b)


def check_hessian_vector_products(ours: Callable[..., Conv]) -> None:
    """Double backward (RABO's CG products), d/d(w, x, b) of <grad_w L, v>, through ``ours``
    (built from the settings) as through vmap's rule."""
    x, w, b, settings = stacked("padded, strided")

    def products(conv: Conv) -> tuple[Tensor, ...]:
        (gw,) = torch.autograd.grad(loss(conv, x, w, b).sum(), w, create_graph=True)
        v = torch.cos(torch.arange(gw.numel(), dtype=gw.dtype)).reshape(gw.shape)
        return torch.autograd.grad((gw * v).sum(), (w, x, b))

    for a, r in zip(products(ours(settings)), products(plain(settings)), strict=True):
        torch.testing.assert_close(a, r, **TOL)


def check_nested_vmap(ours: Callable[..., Conv]) -> None:
    """Finite differences evaluate a cohort's loss at several points at once (a vmap over
    points around the cohort's vmap): values and gradients through ``ours`` as through vmap's
    rule."""
    x, w, b, settings = stacked("padded, strided")
    points = torch.stack([w.detach() + 0.1 * s for s in range(2)]).requires_grad_(True)

    def losses(conv: Conv) -> tuple[Tensor, Tensor]:
        out = torch.vmap(lambda w_: loss(conv, x.detach(), w_, b.detach()))(points)
        (grad,) = torch.autograd.grad(out.sum(), points)
        return out, grad

    (out, grad), (ref, ref_grad) = losses(ours(settings)), losses(plain(settings))
    assert out.shape == (2, 2)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(grad, ref_grad, **TOL)
