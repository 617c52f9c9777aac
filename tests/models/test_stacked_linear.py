"""A stacked cohort's linear layer (``radbo.models.functional._StackedLinear``): under
``torch.vmap`` the output and the input gradient are ``F.linear``'s own operations (bitwise),
the weight gradient is the one-client backward's product ``grad^T @ x``, contiguous, and
second derivatives flow through it.

The weight-gradient comparisons are in float64: the two sides sum the same products per element
in orders the kernels pick, so they agree to a few ulps of the sums' size (``n`` products per
element; 1e-12 relative is over 4,000 ulps of margin for the ``n <= 12`` used here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radbo.models.functional import _StackedLinear, apply_layer

SHAPES = {  # clients, leading dims of x, in, out
    "rows": (3, (5,), 6, 4),
    "one example": (3, (), 6, 4),
    "3-d input": (2, (3, 4), 5, 7),
    "wide": (4, (10,), 300, 12),
}


def stacked(clients: int, lead: tuple[int, ...], k: int, o: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(clients, *lead, k, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(clients, o, k, generator=gen, dtype=dtype, requires_grad=True)
    b = torch.randn(clients, o, generator=gen, dtype=dtype, requires_grad=True)
    grad = torch.randn(clients, *lead, o, generator=gen, dtype=dtype)
    return x, w, b, grad


def ours(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return _StackedLinear.apply(x, w) + b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_output_and_input_gradient_are_f_linear_under_vmap_bitwise(shape, dtype) -> None:
    x, w, b, grad = stacked(*SHAPES[shape], dtype)
    out = torch.vmap(ours)(x, w, b)
    ref = torch.vmap(F.linear)(x, w, b)
    assert torch.equal(out, ref)
    gx, _, gb = torch.autograd.grad(out, (x, w, b), grad)
    rx, _, rb = torch.autograd.grad(ref, (x, w, b), grad)
    assert torch.equal(gx, rx) and torch.equal(gb, rb)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_weight_gradient_is_contiguous_and_each_clients_own(shape) -> None:
    x, w, b, grad = stacked(*SHAPES[shape], torch.float64)
    (gw,) = torch.autograd.grad(torch.vmap(ours)(x, w, b), w, grad)
    (rw,) = torch.autograd.grad(torch.vmap(F.linear)(x, w, b), w, grad)
    assert gw.is_contiguous()
    if len(SHAPES[shape][1]) == 1:  # F.linear's own stacked gradient is bmm's transposed view
        assert not rw.is_contiguous()
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=0.0)
    for c in range(x.shape[0]):  # each client alone, as the sequential backend computes it
        (one,) = torch.autograd.grad(F.linear(x[c], w[c], b[c]), w, grad[c])
        torch.testing.assert_close(gw[c], one[c], rtol=1e-12, atol=0.0)


def test_hessian_vector_products_match_f_linear() -> None:
    """Double backward (RABO's CG products) through a tanh: d/d(w, x) of <grad_w L, v>."""
    x, w, b, _ = stacked(3, (5,), 6, 4, torch.float64)

    def products(linear) -> tuple[Tensor, ...]:
        loss = torch.vmap(lambda x_, w_, b_: linear(x_, w_, b_).tanh().square().sum())(x, w, b)
        (gw,) = torch.autograd.grad(loss.sum(), w, create_graph=True)
        v = torch.cos(torch.arange(gw.numel(), dtype=gw.dtype)).reshape(gw.shape)
        return torch.autograd.grad((gw * v).sum(), (w, x, b))

    for a, r in zip(products(ours), products(F.linear), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-14)


def test_inputs_without_gradient_and_shared_inputs() -> None:
    x, w, b, grad = stacked(3, (5,), 6, 4, torch.float64)
    data = x.detach()  # a first layer's input: no gradient asked for
    (gw,) = torch.autograd.grad(torch.vmap(ours)(data, w, b), w, grad)
    (rw,) = torch.autograd.grad(torch.vmap(F.linear)(data, w, b), w, grad)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=0.0)
    shared = x[0].detach().requires_grad_(True)  # one input for every client's weights
    out = torch.vmap(ours, in_dims=(None, 0, 0))(shared, w, b)
    ref = torch.vmap(F.linear, in_dims=(None, 0, 0))(shared, w, b)
    assert torch.equal(out, ref)
    gs, gw = torch.autograd.grad(out, (shared, w), grad)
    rs, rw = torch.autograd.grad(ref, (shared, w), grad)
    torch.testing.assert_close(gs, rs, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=0.0)


def test_the_layer_rule_takes_it_only_for_stacked_weights(monkeypatch) -> None:
    """Outside vmap, and inside it with one weight for all clients, the rule is ``F.linear``
    (bitwise); with a weight per client it is the stacked layer."""
    calls = [0]
    original = _StackedLinear.apply

    def counted(*args: Tensor) -> Tensor:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(_StackedLinear, "apply", counted)
    layer = nn.Linear(6, 4).double()
    state = {"weight": layer.weight.detach().clone().requires_grad_(True), "bias": layer.bias}
    inputs = torch.randn(5, 6, dtype=torch.float64)
    assert torch.equal(apply_layer(layer, "", state, inputs), F.linear(inputs, *state.values()))
    batch = torch.randn(3, 5, 6, dtype=torch.float64)
    out = torch.vmap(lambda i: apply_layer(layer, "", state, i))(batch)
    assert torch.equal(out, torch.vmap(lambda i: F.linear(i, *state.values()))(batch))
    assert calls == [0]
    stacked_state = {
        k: torch.stack([v.detach()] * 3).requires_grad_(True) for k, v in state.items()
    }
    out = torch.vmap(lambda s, i: apply_layer(layer, "", s, i))(stacked_state, batch)
    (gw,) = torch.autograd.grad(out.sum(), stacked_state["weight"])
    assert calls == [1] and gw.is_contiguous()
