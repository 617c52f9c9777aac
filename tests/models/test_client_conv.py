"""A stacked cohort's convolution run client by client (``radbo.models.functional.
_ClientConv2d``): under ``torch.vmap`` with a weight per client, the output and every gradient
are each client's own ``F.conv2d`` and its backward, bitwise; they agree with vmap's grouped
convolution to rounding; second derivatives flow; and the layer rule takes it only for stacked
convolutions on the CPU with few input and output channels per group and enough work per
client.

The bitwise claims hold on any CPU because both sides run the same aten operations on the same
tensors (one client's convolution, its ``convolution_backward``). The comparisons with vmap's
grouped convolution are in float64, where the kernels sum the same products in orders of their
choosing: an output sums ``C k^2 <= 27`` of them here, an input-gradient element ``O k^2 <=
150``, a weight-gradient element (batch x output positions) <= 256. Two orders of n terms
differ by at most about ``2 n u`` times the sum of their magnitudes (``u = 2^-53``), at most
5.7e-14 of it; the tolerance is 1e-12 relative, with 1e-13 absolute for elements whose terms
cancel to near zero, and the largest share of it the cases use is 8 % (measured). The module
is ``float_sensitive`` so that CI checks it under every kernel the machine offers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import radbo
from radbo.models import functional as functional_module
from radbo.models.functional import (
    CLIENT_CONV_MAX_IN_CHANNELS,
    CLIENT_CONV_MAX_OUT_CHANNELS,
    CLIENT_CONV_MIN_FLOPS,
    _ClientConv2d,
    _conv_flops,
    _padding,
    apply_layer,
)
from tests.configs import small_config
from tests.helpers import assert_runs_agree, count_applies
from tests.models.conv_cases import (
    check_hessian_vector_products,
    check_nested_vmap,
    loss,
    plain,
    stacked,
)

pytestmark = pytest.mark.float_sensitive

#: the cases of ``tests/models/conv_cases.py`` this module runs
CASE_NAMES = [
    "5x5",
    "padded, strided",
    "dilated",
    "grouped per client",
    "one image",
    "same padding",
]


def ours(settings):
    """The function as the layer rule calls it: a padding string turned into its numbers."""
    stride, padding, dilation, groups = settings

    def conv(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        pad = _padding(padding, dilation, w.shape[-2:])
        return _ClientConv2d.apply(x, w, b, stride, pad, dilation, groups)

    return conv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", CASE_NAMES)
def test_output_and_gradients_are_each_clients_own_bitwise(case, dtype) -> None:
    x, w, b, settings = stacked(case, dtype)
    out = torch.vmap(ours(settings))(x, w, b)
    grad = torch.cos(torch.arange(out.numel(), dtype=dtype)).reshape(out.shape)
    grads = torch.autograd.grad(out, (x, w, b), grad)
    for c in range(x.shape[0]):  # each client alone, as the sequential backend computes it
        one = F.conv2d(x[c], w[c], b[c], *settings)
        assert torch.equal(out[c], one)
        refs = torch.autograd.grad(one, (x, w, b), grad[c])
        for g, r in zip(grads, refs, strict=True):
            assert torch.equal(g[c], r[c])


@pytest.mark.parametrize("case", CASE_NAMES)
def test_agrees_with_vmaps_grouped_convolution(case) -> None:
    x, w, b, settings = stacked(case)
    out = torch.vmap(ours(settings))(x, w, b)
    ref = torch.vmap(plain(settings))(x, w, b)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    for g, r in zip(
        torch.autograd.grad(loss(ours(settings), x, w, b).sum(), (x, w, b)),
        torch.autograd.grad(loss(plain(settings), x, w, b).sum(), (x, w, b)),
        strict=True,
    ):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-13)


def test_hessian_vector_products_match_the_grouped_convolution() -> None:
    check_hessian_vector_products(ours)


def test_shared_input_and_no_bias() -> None:
    """One input for every client's weights (in_dims None), and a layer without bias."""
    x, w, _, settings = stacked("5x5")
    shared = x[0].detach().requires_grad_(True)
    out = torch.vmap(lambda w_: ours(settings)(shared, w_, None))(w)
    ref = torch.vmap(lambda w_: F.conv2d(shared, w_, None, *settings))(w)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    for g, r in zip(
        torch.autograd.grad(out.tanh().sum(), (shared, w)),
        torch.autograd.grad(ref.tanh().sum(), (shared, w)),
        strict=True,
    ):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("case", ["padded, strided", "one image", "same padding", "dilated"])
def test_outside_vmap_it_is_f_conv2d_with_its_gradients(case) -> None:
    """Called directly (no vmap), forward bitwise F.conv2d; its own backward passes gradcheck
    (and gradgradcheck: its backward is differentiable)."""
    x, w, b, settings = stacked(case)
    x0, w0, b0 = (t[0].detach().requires_grad_(True) for t in (x, w, b))
    fn = ours(settings)
    assert torch.equal(fn(x0, w0, b0), F.conv2d(x0, w0, b0, *settings))
    assert torch.autograd.gradcheck(fn, (x0, w0, b0))
    assert torch.autograd.gradgradcheck(fn, (x0, w0, b0))
    assert torch.autograd.gradcheck(lambda x_, w_: fn(x_, w_, None), (x0, w0))


def test_flops_of_one_clients_convolution_and_its_padding() -> None:
    """2 x multiply-adds: batch x out channels x output positions x (in channels / groups) x
    kernel area, hand-computed; padding strings as their numbers, and None for "same" padding
    PyTorch makes asymmetric (an even dilated kernel extent), which the rule leaves to vmap."""
    w = torch.zeros(6, 1, 5, 5)
    assert _conv_flops(torch.zeros(64, 1, 32, 32), w, 1, [0, 0], 1) == 2 * 64 * 6 * 28 * 28 * 25
    assert _conv_flops(torch.zeros(1, 32, 32), w, 1, [0, 0], 1) == 2 * 6 * 28 * 28 * 25
    w = torch.zeros(4, 2, 3, 3)  # groups 2 of 4 input channels
    assert _conv_flops(torch.zeros(3, 4, 9, 9), w, 2, [1, 1], 1) == 2 * 3 * 4 * 5 * 5 * 18
    assert _conv_flops(torch.zeros(3, 4, 9, 9), w, 1, [1, 1], 1) == 2 * 3 * 4 * 81 * 18
    assert _conv_flops(torch.zeros(3, 4, 9, 9), w, 1, [0, 1], (2, 1)) == 2 * 3 * 4 * 5 * 9 * 18
    assert _padding(1, 1, (3, 3)) == [1, 1] and _padding((0, 2), 1, (3, 3)) == [0, 2]
    assert _padding("valid", 1, (4, 4)) == [0, 0]
    assert _padding("same", 1, (3, 5)) == [1, 2] and _padding("same", 2, (3, 3)) == [2, 2]
    assert _padding("same", 1, (4, 3)) is None


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """How many times the layer rule took ``_ClientConv2d`` (a spy on ``apply``)."""
    return count_applies(monkeypatch, _ClientConv2d)


def test_the_layer_rule_takes_it_for_few_input_channels_and_enough_work(monkeypatch, calls) -> None:
    """Outside vmap, inside it with one weight for all clients, with many input or output
    channels per group and with too little work per client, the rule is F.conv2d (bitwise);
    with a stacked weight, few channels and enough work, the client-by-client convolution."""
    assert (CLIENT_CONV_MAX_IN_CHANNELS, CLIENT_CONV_MAX_OUT_CHANNELS) == (8, 16)
    assert CLIENT_CONV_MIN_FLOPS == 1 << 22
    layer = nn.Conv2d(1, 6, 5).double()
    state = {"weight": layer.weight.detach(), "bias": layer.bias.detach()}
    images = torch.randn(3, 64, 1, 32, 32, dtype=torch.float64)  # 7.5 MFLOP per client
    assert _conv_flops(images[0], state["weight"], 1, [0, 0], 1) >= CLIENT_CONV_MIN_FLOPS
    ref = F.conv2d(images[0], *state.values())
    assert torch.equal(apply_layer(layer, "", state, images[0]), ref)
    torch.vmap(lambda i: apply_layer(layer, "", state, i))(images)
    assert calls == [0]
    stacked_state = {k: torch.stack([v] * 3) for k, v in state.items()}

    def stacked_run(inputs: Tensor) -> Tensor:
        return torch.vmap(lambda s, i: apply_layer(layer, "", s, i))(stacked_state, inputs)

    out = stacked_run(images)
    assert calls == [1]
    assert all(
        torch.equal(o, F.conv2d(i, *state.values())) for o, i in zip(out, images, strict=True)
    )
    stacked_run(images[:, :8])  # 0.9 MFLOP per client
    assert calls == [1]
    for bound in ("CLIENT_CONV_MAX_IN_CHANNELS", "CLIENT_CONV_MAX_OUT_CHANNELS"):
        saved = getattr(functional_module, bound)
        monkeypatch.setattr(functional_module, bound, 0)
        stacked_run(images)
        assert calls == [1]
        monkeypatch.setattr(functional_module, bound, saved)
    layer.padding_mode = "circular"  # padded first, then the same rule
    layer.padding = (1, 1)
    layer._reversed_padding_repeated_twice = [1, 1, 1, 1]
    stacked_run(images)
    assert calls == [2]


def test_the_rule_is_for_the_cpu_only(calls) -> None:
    """On another device (here ``meta``, which computes shapes only; on a GPU every client's
    convolution would be a launch of its own) a stacked convolution stays vmap's grouped one."""
    layer = nn.Conv2d(1, 6, 5, device="meta")
    state = {k: torch.stack([v] * 3) for k, v in layer.state_dict().items()}
    images = torch.zeros(3, 64, 1, 32, 32, device="meta")
    out = torch.vmap(lambda s, i: apply_layer(layer, "", s, i))(state, images)
    assert out.shape == (3, 64, 6, 28, 28) and calls == [0]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
def test_the_rule_takes_same_padding_as_its_numbers_unless_asymmetric(calls) -> None:
    """A layer with ``padding="same"`` and a 5x5 kernel is taken, with padding 2 (bitwise
    F.conv2d's "same"); with a 4x4 kernel PyTorch pads one side more, and the layer stays
    F.conv2d under vmap."""
    images = torch.randn(2, 64, 1, 32, 32, dtype=torch.float64)
    for kernel, taken in ((5, 1), (4, 0)):
        layer = nn.Conv2d(1, 6, kernel, padding="same").double()
        state = {k: torch.stack([v.detach()] * 2) for k, v in layer.state_dict().items()}
        out = torch.vmap(lambda s, i, layer=layer: apply_layer(layer, "", s, i))(state, images)
        assert calls == [taken]
        calls[0] = 0
        for c in range(2):
            ref = F.conv2d(images[c], state["weight"][c], state["bias"][c], padding="same")
            if taken:
                assert torch.equal(out[c], ref)
            else:
                torch.testing.assert_close(out[c], ref, rtol=1e-12, atol=1e-13)


def test_nested_vmap_over_points_of_a_stacked_cohort() -> None:
    check_nested_vmap(ours)


def test_a_batched_cnn_run_with_every_convolution_client_by_client(monkeypatch, calls) -> None:
    """CNN7 on digits at 16x16, batched, float64, 2 rounds: every convolution client by client
    against none (the default rule leaves these small layers to vmap) -- states and metrics
    to 1e-9 relative, ledgers equal (FLOPs are counted one client at a time, outside vmap)."""
    config = small_config(
        rounds=2,
        eval_every=1,
        data={"name": "digits", "image_size": 16},
        model={"name": "cnn7"},
        runtime={"backend": "batched", "dtype": "float64"},
    )
    grouped = radbo.run(config, progress=False, save=False)
    assert calls == [0]
    monkeypatch.setattr(functional_module, "CLIENT_CONV_MIN_FLOPS", 0)
    by_client = radbo.run(config, progress=False, save=False)
    assert calls[0] > 0
    assert_runs_agree(by_client, grouped, rtol=1e-9, atol=1e-12)
