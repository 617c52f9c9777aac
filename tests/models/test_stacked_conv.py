"""A stacked cohort's convolutions and max-poolings as radbo batches them
(``radbo.models.functional._StackedConv2d`` and ``_StackedMaxPool2d``): the convolution is
bitwise one grouped ``F.conv2d`` of the clients' inputs side by side, bias inside the kernel;
it agrees with each client's own convolution and with vmap's rule to rounding, second
derivatives included; the pooling is bitwise each client's own, values and gradients; a CNN
body chain makes no copy of its activations; and the layer rules take them only inside vmap,
for layers of at least ``STACKED_CONV_MIN_NUMEL`` elements per client.

The bitwise claims hold on any CPU because both sides run the same aten operation on the same
tensors (the grouped convolution), or an operation that is exact (a maximum; its gradient
routes each element to one place, in the same order per image and channel). The comparisons
with each client's convolution and vmap's rule are in float64, where kernels sum the same
products in orders of their choosing: an output sums ``C k^2 <= 27`` of them here (plus the
bias, which vmap's rule adds after the sum), an input-gradient element ``O k^2 <= 54``, a
weight-gradient element (batch x output positions) <= 300. Two orders of n terms differ by at
most about ``2 n u`` times the sum of their magnitudes (``u = 2^-53``), at most 6.7e-14 of it;
the tolerance is 1e-12 relative, with 1e-13 absolute for elements whose terms cancel to near
zero. The module is ``float_sensitive`` so that CI checks it under every kernel the machine
offers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import radbo
from radbo.models import functional as functional_module
from radbo.models.functional import (
    STACKED_CONV_MIN_NUMEL,
    _ClientConv2d,
    _conv_outputs,
    _StackedConv2d,
    _StackedMaxPool2d,
    apply_layer,
)
from tests.configs import small_config
from tests.helpers import OpLog, assert_runs_agree, count_applies
from tests.models.conv_cases import (
    TOL,
    check_hessian_vector_products,
    check_nested_vmap,
    loss,
    plain,
    stacked,
)

pytestmark = pytest.mark.float_sensitive

#: the cases of ``tests/models/conv_cases.py`` this module runs
CASE_NAMES = ["3x3", "padded, strided", "dilated", "grouped per client", "one image"]


def ours(settings):
    return lambda x, w, b: _StackedConv2d.apply(x, w, b, *settings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_output_is_one_grouped_convolution_of_the_clients_side_by_side_bitwise(case, dtype) -> None:
    x, w, b, (stride, padding, dilation, groups) = stacked(case, dtype)
    out = torch.vmap(ours((stride, padding, dilation, groups)))(x, w, b)
    clients = x.shape[0]
    # by hand: images x (clients x channels) in, clients x out channels of weights and biases
    side_by_side = x.unsqueeze(0) if case == "one image" else x.movedim(0, 1)
    ref = F.conv2d(
        side_by_side.flatten(1, 2),
        w.flatten(0, 1),
        b.flatten(),
        stride,
        padding,
        dilation,
        groups * clients,
    ).unflatten(1, (clients, -1))
    assert torch.equal(out, ref.squeeze(0) if case == "one image" else ref.movedim(1, 0))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_agrees_with_each_clients_convolution_and_vmaps_rule(case) -> None:
    x, w, b, settings = stacked(case)
    out = torch.vmap(ours(settings))(x, w, b)
    torch.testing.assert_close(out, torch.vmap(plain(settings))(x, w, b), **TOL)
    for c in range(x.shape[0]):
        torch.testing.assert_close(out[c], F.conv2d(x[c], w[c], b[c], *settings), **TOL)
    for g, r in zip(
        torch.autograd.grad(loss(ours(settings), x, w, b).sum(), (x, w, b)),
        torch.autograd.grad(loss(plain(settings), x, w, b).sum(), (x, w, b)),
        strict=True,
    ):
        torch.testing.assert_close(g, r, **TOL)


def test_hessian_vector_products_match_vmaps_rule() -> None:
    check_hessian_vector_products(ours)


def test_shared_input_shared_weight_and_no_bias() -> None:
    """One input for every client's weights, one weight for every client's inputs (in_dims
    None: expanded to the clients), and a layer without bias."""
    x, w, _, settings = stacked("3x3")
    shared_x = x[0].detach().requires_grad_(True)
    shared_w = w[0].detach().requires_grad_(True)

    def check(conv_of, stacked_arg: Tensor, params: tuple[Tensor, Tensor]) -> None:
        out = torch.vmap(conv_of(ours(settings)))(stacked_arg)
        ref = torch.vmap(conv_of(plain(settings)))(stacked_arg)
        torch.testing.assert_close(out, ref, **TOL)
        for g, r in zip(
            torch.autograd.grad(out.tanh().sum(), params),
            torch.autograd.grad(ref.tanh().sum(), params),
            strict=True,
        ):
            torch.testing.assert_close(g, r, **TOL)

    check(lambda conv: lambda w_: conv(shared_x, w_, None), w, (shared_x, w))
    check(lambda conv: lambda x_: conv(x_, shared_w, None), x, (x, shared_w))


def test_nested_vmap_over_points_of_a_stacked_cohort() -> None:
    check_nested_vmap(ours)


def test_outside_vmap_both_are_the_plain_functions_with_their_gradients() -> None:
    """Called directly, forward bitwise F.conv2d / F.max_pool2d; their own backwards pass
    gradcheck and gradgradcheck (the pooling's is differentiable again)."""
    x, w, b, settings = stacked("padded, strided")
    x0, w0, b0 = (t[0].detach().requires_grad_(True) for t in (x, w, b))
    conv = ours(settings)
    assert torch.equal(conv(x0, w0, b0), F.conv2d(x0, w0, b0, *settings))
    assert torch.autograd.gradcheck(conv, (x0, w0, b0))
    assert torch.autograd.gradgradcheck(conv, (x0, w0, b0))
    for args in ((2, 2, 0, 1, False), (3, 2, 1, 1, True), (2, None, 0, 2, False)):
        pool = lambda t, args=args: _StackedMaxPool2d.apply(t, *args)  # noqa: E731
        assert torch.equal(pool(x0), F.max_pool2d(x0, *args[:4], ceil_mode=args[4]))
        assert torch.autograd.gradcheck(pool, (x0,))
        assert torch.autograd.gradgradcheck(pool, (x0,))


#: (kernel, stride, padding, dilation, ceil_mode): plain, overlapping windows with padding and
#: ceil mode, dilated
POOLS = {
    "2x2": (2, 2, 0, 1, False),
    "3x3/2 ceil": (3, 2, 1, 1, True),
    "dilated": (2, 1, 0, 2, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("layout", ["clients first", "beside the channels", "last", "one image"])
def test_pooling_is_each_clients_own_bitwise_wherever_the_clients_lie(layout, pool, dtype) -> None:
    kernel, stride, padding, dilation, ceil = POOLS[pool]
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(3, 4, 2, 9, 9, generator=gen, dtype=dtype)  # clients, batch, C, H, W
    if layout == "one image":
        images = images[:, 0]
    dim = {"clients first": 0, "beside the channels": 1, "last": 4, "one image": 0}[layout]
    physical = images.movedim(0, dim).contiguous().requires_grad_(True)
    out = torch.vmap(
        lambda t: _StackedMaxPool2d.apply(t, kernel, stride, padding, dilation, ceil),
        in_dims=dim,
    )(physical)
    grad = torch.cos(torch.arange(out.numel(), dtype=dtype)).reshape(out.shape)
    (g,) = torch.autograd.grad(out, physical, grad)
    g = g.movedim(dim, 0)
    for c in range(3):
        one = images[c].detach().requires_grad_(True)
        ref = F.max_pool2d(one, kernel, stride, padding, dilation, ceil_mode=ceil)
        assert torch.equal(out[c], ref)
        assert torch.equal(g[c], torch.autograd.grad(ref, one, grad[c])[0])


def body_ops(monkeypatch, min_numel: int) -> Counter[str]:
    monkeypatch.setattr(functional_module, "STACKED_CONV_MIN_NUMEL", min_numel)
    body = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3), nn.ReLU(),
        nn.MaxPool2d(2),
    )  # fmt: skip
    state = {k: torch.stack([v.detach()] * 4) for k, v in body.state_dict().items()}
    images = torch.randn(4, 5, 3, 16, 16)
    with OpLog() as ops:  # under vmap: the operations on the stacked tensors
        torch.vmap(lambda s, i: apply_layer(body, "", s, i))(state, images)
    return Counter(name.removeprefix("aten::").split(".")[0] for name in ops.names)


def test_a_cnn_body_copies_only_its_input_images(monkeypatch) -> None:
    """conv -> ReLU -> pool -> conv -> ReLU -> pool on a stacked cohort: one copy (the images,
    clients first, laid beside the channels) and no separate bias addition, where vmap's rules
    make four copies (before each pooling and each convolution) and two additions."""
    ours_ = body_ops(monkeypatch, 0)
    assert ours_["clone"] == 1 and ours_["add"] == 0 and ours_["convolution"] == 2
    vmaps = body_ops(monkeypatch, 1 << 62)
    assert vmaps["clone"] == 4 and vmaps["add"] == 2 and vmaps["convolution"] == 2


@pytest.fixture
def calls(monkeypatch) -> dict[str, list[int]]:
    """How many times the layer rules took each custom function (spies on ``apply``)."""
    return {
        "stacked": count_applies(monkeypatch, _StackedConv2d),
        "pool": count_applies(monkeypatch, _StackedMaxPool2d),
        "client": count_applies(monkeypatch, _ClientConv2d),
    }


def test_the_layer_rules_take_them_inside_vmap_for_large_layers(calls) -> None:
    """Outside vmap, with one weight for all clients, and below ``STACKED_CONV_MIN_NUMEL``
    elements per client, the rules run F.conv2d and F.max_pool2d (bitwise); a stacked
    convolution of enough output takes ``_StackedConv2d``, a large enough pooling input
    ``_StackedMaxPool2d``, and the client-by-client rule keeps its layers."""
    assert STACKED_CONV_MIN_NUMEL == 1 << 18
    conv, pool = nn.Conv2d(3, 32, 3).double(), nn.MaxPool2d(2)
    state = {"weight": conv.weight.detach(), "bias": conv.bias.detach()}
    images = torch.randn(2, 10, 3, 32, 32, dtype=torch.float64)
    assert _conv_outputs(images[0], state["weight"], 1, [0, 0], 1) == 10 * 32 * 30 * 30
    assert 10 * 32 * 30 * 30 >= STACKED_CONV_MIN_NUMEL > 2 * 32 * 30 * 30
    assert torch.equal(
        apply_layer(conv, "", state, images[0]), F.conv2d(images[0], *state.values())
    )
    torch.vmap(lambda i: apply_layer(pool, "", {}, apply_layer(conv, "", state, i)))(images)
    assert (calls["stacked"], calls["pool"]) == ([0], [1])  # one weight: vmap's rule
    stacked_state = {k: torch.stack([v] * 2) for k, v in state.items()}

    def run(layer: nn.Module, inputs: Tensor) -> Tensor:
        return torch.vmap(lambda s, i: apply_layer(layer, "", s, i))(stacked_state, inputs)

    out = run(conv, images)
    assert calls["stacked"] == [1]
    for o, i in zip(out, images, strict=True):
        torch.testing.assert_close(o, F.conv2d(i, *state.values()), **TOL)
    run(conv, images[:, :2])  # 57,600 output elements per client
    torch.vmap(lambda i: apply_layer(pool, "", {}, i))(images[:, :2])
    assert (calls["stacked"], calls["pool"]) == ([1], [1])
    indices = nn.MaxPool2d(2, return_indices=True)
    torch.vmap(lambda i: apply_layer(indices, "", {}, i))(out)
    assert calls["pool"] == [1]
    narrow = nn.Conv2d(1, 6, 5).double()  # CNN7's first layer at 32x32: client by client
    stacked_state = {k: torch.stack([v.detach()] * 2) for k, v in narrow.state_dict().items()}
    run(narrow, torch.randn(2, 64, 1, 32, 32, dtype=torch.float64))
    assert (calls["stacked"], calls["client"]) == ([1], [1])


def test_a_batched_cnn_run_with_every_layer_stacked(monkeypatch, calls) -> None:
    """CNN7 on digits at 16x16, batched, float64, 2 rounds: every convolution and pooling
    through radbo's batching against none (its layers are below the bound) -- states and
    metrics to 1e-9 relative, ledgers equal (FLOPs are counted one client at a time, outside
    vmap)."""
    config = small_config(
        rounds=2,
        eval_every=1,
        data={"name": "digits", "image_size": 16},
        model={"name": "cnn7"},
        runtime={"backend": "batched", "dtype": "float64"},
    )
    vmaps = radbo.run(config, progress=False, save=False)
    assert calls["stacked"] == calls["pool"] == [0]
    monkeypatch.setattr(functional_module, "STACKED_CONV_MIN_NUMEL", 0)
    ours_ = radbo.run(config, progress=False, save=False)
    assert calls["stacked"][0] > 0 and calls["pool"][0] > 0
    assert_runs_agree(ours_, vmaps, rtol=1e-9, atol=1e-12)
