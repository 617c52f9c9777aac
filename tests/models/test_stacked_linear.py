"""A stacked cohort's linear layer (``radbo.models.functional._StackedLinear``): under
``torch.vmap`` the output and the input gradient are ``F.linear``'s own operations (bitwise),
the weight gradient is the one-client backward's product ``grad^T @ x``, contiguous, and
second derivatives flow through it. The layer rule takes it for stacked weights of at least
``STACKED_LINEAR_MIN_WEIGHTS`` per client; with every layer taking it, the zoo's functional
forms agree with ``functional_call`` to rounding, and whole batched runs too.

The weight-gradient comparisons are in float64: the two sides sum the same ``n`` products per
element in orders the kernels pick. Two orders of one sum differ by at most ``2 (n - 1) u S``
(``u = eps / 2``, ``S`` the sum of the products' magnitudes), so each element is held to
``n eps S`` (:func:`assert_sums_agree`), not to a share of its own value, which cancellation can
make small: 1e-12 relative failed the wide case's element (0, 11, 85), 1.04e-12, under the AVX2
kernels of an AVX-512 Xeon (2026-12-07). The
bitwise claims hold on any CPU because both sides dispatch the same aten operations on the
same tensors (under vmap ``F.linear`` with a bias is ``mm`` then ``add``, as here); the module
is marked ``float_sensitive`` so that CI checks them under every kernel the machine offers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import radbo
from radbo.models import MLP
from radbo.models import functional as functional_module
from radbo.models.functional import STACKED_LINEAR_MIN_WEIGHTS, _StackedLinear, apply_layer
from radbo.problem import forward, module_calls_only
from tests.configs import small_config
from tests.helpers import assert_runs_agree, count_applies

pytestmark = pytest.mark.float_sensitive

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


def assert_sums_agree(got: Tensor, ref: Tensor, magnitudes: Tensor, n: int) -> None:
    """``got`` and ``ref``, two float64 evaluations of sums of ``n`` products each, agree to
    ``n eps`` times ``magnitudes``, each element's sum of the products' magnitudes (two
    summation orders differ by at most ``2 (n - 1) u`` of it, ``u = eps / 2``)."""
    bound = n * torch.finfo(torch.float64).eps * magnitudes
    excess = (got - ref).abs() - bound
    assert float(excess.max()) <= 0.0, f"over the bound by {float(excess.max()):.3g}"


def weight_gradient_magnitudes(x: Tensor, grad: Tensor) -> tuple[Tensor, int]:
    """Per client and weight, the sum of ``|grad_j x_j|`` over the rows ``j`` that
    ``grad^T @ x`` adds, and how many rows that is."""
    rows = grad[0].numel() // grad.shape[-1]
    g = grad.detach().abs().reshape(grad.shape[0], rows, grad.shape[-1])
    a = x.detach().abs().reshape(x.shape[0], rows, x.shape[-1])
    return g.transpose(1, 2) @ a, rows


@pytest.mark.parametrize("shape", list(SHAPES))
def test_weight_gradient_is_contiguous_and_each_clients_own(shape) -> None:
    x, w, b, grad = stacked(*SHAPES[shape], torch.float64)
    (gw,) = torch.autograd.grad(torch.vmap(ours)(x, w, b), w, grad)
    (rw,) = torch.autograd.grad(torch.vmap(F.linear)(x, w, b), w, grad)
    assert gw.is_contiguous()
    if len(SHAPES[shape][1]) == 1:  # F.linear's own stacked gradient is bmm's transposed view
        assert not rw.is_contiguous()
    magnitudes, rows = weight_gradient_magnitudes(x, grad)
    assert_sums_agree(gw, rw, magnitudes, rows)
    for c in range(x.shape[0]):  # each client alone, as the sequential backend computes it
        (one,) = torch.autograd.grad(F.linear(x[c], w[c], b[c]), w, grad[c])
        assert_sums_agree(gw[c], one[c], magnitudes[c], rows)


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
    assert_sums_agree(gw, rw, *weight_gradient_magnitudes(data, grad))
    shared = x[0].detach().requires_grad_(True)  # one input for every client's weights
    out = torch.vmap(ours, in_dims=(None, 0, 0))(shared, w, b)
    ref = torch.vmap(F.linear, in_dims=(None, 0, 0))(shared, w, b)
    assert torch.equal(out, ref)
    gs, gw = torch.autograd.grad(out, (shared, w), grad)
    rs, rw = torch.autograd.grad(ref, (shared, w), grad)
    # the shared input's gradient adds grad[c] @ w[c] over the clients c and outputs
    clients, outputs = w.shape[0], w.shape[1]
    shared_magnitudes = torch.einsum("cro,cok->rk", grad.abs(), w.detach().abs())
    assert_sums_agree(gs, rs, shared_magnitudes, clients * outputs)
    assert_sums_agree(gw, rw, *weight_gradient_magnitudes(shared.expand_as(x), grad))


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """How many times the layer rule took ``_StackedLinear`` (a spy on ``apply``)."""
    return count_applies(monkeypatch, _StackedLinear)


def test_the_layer_rule_takes_it_for_large_stacked_weights_only(monkeypatch, calls) -> None:
    """Outside vmap, inside it with one weight for all clients, and for a stacked weight below
    the threshold, the rule is ``F.linear`` (bitwise); at the threshold, the stacked layer."""
    assert STACKED_LINEAR_MIN_WEIGHTS == 1 << 16
    layer = nn.Linear(6, 4).double()
    state = {"weight": layer.weight.detach().clone().requires_grad_(True), "bias": layer.bias}
    inputs = torch.randn(5, 6, dtype=torch.float64)
    assert torch.equal(apply_layer(layer, "", state, inputs), F.linear(inputs, *state.values()))
    batch = torch.randn(3, 5, 6, dtype=torch.float64)
    out = torch.vmap(lambda i: apply_layer(layer, "", state, i))(batch)
    assert torch.equal(out, torch.vmap(lambda i: F.linear(i, *state.values()))(batch))
    stacked_state = {
        k: torch.stack([v.detach()] * 3).requires_grad_(True) for k, v in state.items()
    }

    def stacked_gradient() -> Tensor:
        out = torch.vmap(lambda s, i: apply_layer(layer, "", s, i))(stacked_state, batch)
        (gw,) = torch.autograd.grad(out.sum(), stacked_state["weight"])
        return gw

    assert calls == [0] and not stacked_gradient().is_contiguous()  # 24 weights: F.linear's
    monkeypatch.setattr(functional_module, "STACKED_LINEAR_MIN_WEIGHTS", 24)
    assert stacked_gradient().is_contiguous() and calls == [1]


def test_functional_forms_agree_with_functional_call_when_every_layer_is_stacked(
    monkeypatch,
) -> None:
    """An MLP under vmap with the threshold at 1 weight: losses and biases' gradients bitwise
    functional_call's; the weights' gradients (contiguous, functional_call's strided) to
    float64 rounding."""
    monkeypatch.setattr(functional_module, "STACKED_LINEAR_MIN_WEIGHTS", 1)
    torch.manual_seed(0)
    clients = [MLP(8, [6], 3).double().state_dict() for _ in range(3)]
    model = MLP(8, [6], 3).double()
    stacked = {k: torch.stack([c[k] for c in clients]).requires_grad_(True) for k in clients[0]}
    inputs = torch.randn(3, 4, 8, dtype=torch.float64)
    x = {k: v for k, v in stacked.items() if not k.startswith("head")}
    y = {k: v for k, v in stacked.items() if k.startswith("head")}

    def run() -> tuple[Tensor, ...]:
        def one(x_: dict, y_: dict, inp: Tensor) -> Tensor:
            return forward(model, x_, y_, {}, inp).tanh().square().sum()

        losses = torch.vmap(one)(x, y, inputs)
        return (losses, *torch.autograd.grad(losses.sum(), list(stacked.values())))

    fast = run()
    with module_calls_only():
        slow = run()
    assert torch.equal(fast[0], slow[0])
    for name, f, s in zip(stacked, fast[1:], slow[1:], strict=True):
        if name.endswith("bias"):
            assert torch.equal(f, s), name
        else:
            assert f.is_contiguous() and not s.is_contiguous(), name
            torch.testing.assert_close(f, s, rtol=1e-12, atol=0.0, msg=name)


def test_a_batched_run_with_every_layer_stacked_matches_to_rounding(monkeypatch, calls) -> None:
    """The demo config, batched, float64, 2 rounds: every linear layer stacked against none
    (the threshold above every layer) -- states and metrics to 1e-9 relative, ledgers equal."""
    config = small_config(
        rounds=2, eval_every=1, runtime={"backend": "batched", "dtype": "float64"}
    )
    plain = radbo.run(config, progress=False, save=False)
    assert calls == [0]  # the demo MLP's layers are below the threshold
    monkeypatch.setattr(functional_module, "STACKED_LINEAR_MIN_WEIGHTS", 1)
    stacked = radbo.run(config, progress=False, save=False)
    assert calls[0] > 0
    assert_runs_agree(stacked, plain, rtol=1e-9, atol=1e-12)


def test_nested_vmap_over_points_of_a_stacked_cohort() -> None:
    """Finite differences evaluate a cohort's loss at several points at once
    (``radbo.problem.at_points``: a vmap over points around the cohort's vmap): the same values
    as ``F.linear``, and gradients to rounding."""
    x, w, b, _ = stacked(3, (5,), 6, 4, torch.float64)
    points = torch.stack([w.detach() + 0.1 * s for s in range(2)]).requires_grad_(True)

    def losses(linear) -> tuple[Tensor, Tensor]:
        def cohort(w_: Tensor) -> Tensor:
            return torch.vmap(lambda x_, w1, b_: linear(x_, w1, b_).tanh().sum())(x, w_, b)

        out = torch.vmap(cohort)(points)  # [points, clients]
        (grad,) = torch.autograd.grad(out.sum(), points)
        return out, grad

    (out, grad), (ref, ref_grad) = losses(ours), losses(F.linear)
    assert out.shape == (2, 3) and torch.equal(out, ref)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
