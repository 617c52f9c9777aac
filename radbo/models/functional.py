"""Functional forward passes of the zoo's layers, without re-parametrisation.

``torch.func.functional_call`` evaluates a module on given tensors by swapping them into the
module, calling it and swapping them back: a Python ``setattr`` per tensor, twice, plus the
module-call machinery, on every loss evaluation. The functions here compute each layer of the
zoo straight from a state dict (keyed like ``state_dict``) with the ``torch.nn.functional`` op
and arguments that the layer's own ``forward`` uses, in the same order, so the result, its
gradients and its higher-order products are bitwise those of ``functional_call``. The
exceptions, by design, are all inside ``torch.vmap`` with a weight per client (a stacked
cohort), where radbo batches three kinds of layer itself instead of leaving them to vmap's
rules:

* a linear layer of at least :data:`STACKED_LINEAR_MIN_WEIGHTS` weights computes its weight
  gradient as the one-client backward does, which keeps it contiguous (:class:`_StackedLinear`);
* a convolution with few channels per group and enough work per client
  (:data:`CLIENT_CONV_MAX_IN_CHANNELS`) runs each client's own convolution instead of vmap's
  grouped one (:class:`_ClientConv2d`); another with at least :data:`STACKED_CONV_MIN_NUMEL`
  output elements per client runs the grouped one with the bias inside the kernel and leaves
  its output where it lies (:class:`_StackedConv2d`);
* a max-pooling of at least as many input elements per client pools the stacked images where
  they lie, without a copy (:class:`_StackedMaxPool2d`; bitwise vmap's, as a maximum is
  exact).

They equal ``functional_call``'s results to rounding, and everything else stays bitwise.

Shapes come from the tensors, never from the module, so a pruned submodel skeleton of the
same class (even one on the ``meta`` device) computes with the submodel's shapes; the module
supplies only its hyperparameters (stride, padding, eps, momentum) and its mode
(``training``).

BatchNorm updates the running statistics of ``state`` in place, exactly as
``nn.BatchNorm2d.forward`` does under ``functional_call`` (``num_batches_tracked`` incremented,
cumulative average when ``momentum`` is ``None``, batch statistics in training mode).

:meth:`radbo.models.BilevelModel.functional_forward` uses these layers only when every
submodule is of a type registered here and no module hook is installed (a hook, e.g. the
``ModuleTracker`` of ``FlopCounterMode`` or a feature-capturing hook, needs the module call).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

from radbo._torch_private import carries_vmap_dim

__all__ = [
    "CLIENT_CONV_MAX_IN_CHANNELS",
    "CLIENT_CONV_MAX_OUT_CHANNELS",
    "CLIENT_CONV_MIN_FLOPS",
    "STACKED_CONV_MIN_NUMEL",
    "STACKED_LINEAR_MIN_WEIGHTS",
    "apply_layer",
    "has_functional_form",
    "layer_rule",
]

#: ``rule(layer, prefix, state, inputs)``: the layer's output on ``inputs`` with its tensors
#: read from ``state`` under ``prefix`` (e.g. ``"body.0."``).
LayerRule = Callable[[nn.Module, str, Mapping[str, Tensor], Tensor], Tensor]

_RULES: dict[type[nn.Module], LayerRule] = {}

#: The submodules of each model :func:`has_functional_form` has seen, when all have a rule
#: (``None``: some has none). Models are not rebuilt after their first evaluation.
_SUBMODULES: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, ...] | None] = (
    weakref.WeakKeyDictionary()
)


def layer_rule(kind: type[nn.Module]) -> Callable[[LayerRule], LayerRule]:
    """Register ``rule`` as the functional form of layers of exactly type ``kind``."""

    def register(rule: LayerRule) -> LayerRule:
        _RULES[kind] = rule
        return rule

    return register


def apply_layer(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    """``layer(x)`` with the layer's tensors taken from ``state`` under ``prefix``."""
    return _RULES[type(layer)](layer, prefix, state, x)


def _hooked(m: nn.Module) -> bool:
    return bool(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    )


def has_functional_form(model: nn.Module) -> bool:
    """Whether every submodule of ``model`` (not ``model`` itself, whose functional form
    stands for its ``forward``) has a registered rule and no module hook, global or local, is
    installed. The submodules are listed once per model (their types do not change)."""
    if (
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or _module._global_backward_pre_hooks
        or _hooked(model)
    ):
        return False
    try:
        modules = _SUBMODULES[model]
    except KeyError:
        subs = tuple(model.modules())[1:]
        modules = _SUBMODULES[model] = subs if all(type(m) in _RULES for m in subs) else None
    return modules is not None and not any(_hooked(m) for m in modules)


def _bias(layer: nn.Module, prefix: str, state: Mapping[str, Tensor]) -> Tensor | None:
    return None if layer.bias is None else state[prefix + "bias"]


@layer_rule(nn.Sequential)
def _sequential(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    for name, child in layer._modules.items():
        assert child is not None
        x = _RULES[type(child)](child, f"{prefix}{name}.", state, x)
    return x


class _StackedLinear(torch.autograd.Function):
    """``F.linear(x, weight)`` whose weight gradient keeps the weight's memory layout under
    ``torch.vmap`` (a stacked cohort: one weight per client).

    Written by hand because PyTorch's two backward formulas differ: for one client, ``mm``'s
    backward returns the gradient of ``weight.t()`` in the weight's own (row-major) layout,
    but for a stack of clients ``bmm``'s backward computes ``x^T @ grad`` and returns its
    transpose, a strided view. Every elementwise operation between such a gradient and the
    contiguous parameters (a local step's ``p - lr * g``, a running sum of gradients) then
    reads one of them with a stride: a local step's update was 7x slower on the 1.6 M-weight
    layer of pfl-research's CIFAR-10 CNN (``benchmarks/stacked_linear.py``; BENCHMARKS.md,
    "The weight gradient of a stacked linear layer"). Here the weight gradient is
    ``grad^T @ x``, the product the one-client backward computes, contiguous; the output and
    the input gradient are the very operations of ``F.linear`` under vmap
    (``tests/models/test_stacked_linear.py``). Double backward works: the backward is made of
    differentiable operations. Under vmap a custom function costs about 0.9 ms more per
    forward and backward than ``F.linear`` (PyTorch vmaps it in Python), so :func:`_linear`
    takes it only for layers of at least :data:`STACKED_LINEAR_MIN_WEIGHTS` weights."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, weight: Tensor) -> Tensor:
        return F.linear(x, weight)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # every leading dim of x is a row, as F.linear has it
            grad_weight = grad.reshape(-1, grad.shape[-1]).mT @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_weight


#: A stacked cohort's linear layers with at least this many weights per client (``out * in``)
#: return contiguous weight gradients (:class:`_StackedLinear`); smaller ones run ``F.linear``,
#: whose strided gradient costs less there than the custom function's overhead. Backward and
#: update together, the crossover lies between 16,384 weights per client (the custom function
#: at 0.55x at 10 clients, 0.96x at 50) and 65,536 (1.26x and 1.78x)
#: (``benchmarks/stacked_linear.py``, BENCHMARKS.md).
STACKED_LINEAR_MIN_WEIGHTS = 1 << 16


@layer_rule(nn.Linear)
def _linear(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    weight, bias = state[prefix + "weight"], _bias(layer, prefix, state)
    # a stacked cohort's weight (numel: one client's)
    if carries_vmap_dim(weight) and weight.numel() >= STACKED_LINEAR_MIN_WEIGHTS:
        out = _StackedLinear.apply(x, weight)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class _Conv2d(torch.autograd.Function):
    """``F.conv2d`` as a custom autograd function, the forward and backward that
    :class:`_ClientConv2d` and :class:`_StackedConv2d` share; each adds its own :meth:`vmap`
    rule. Under vmap only that rule runs: its operations on the stacked tensors are ordinary
    ones, which autograd records and differentiates (double backward included). :meth:`backward`
    serves the function called outside vmap. The padding is two numbers (:func:`_conv` turns
    ``"same"`` and ``"valid"`` into them)."""

    @staticmethod
    def forward(
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
    ) -> Tensor:
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, weight, bias, stride, padding, dilation, groups = inputs
        ctx.save_for_backward(x, weight)
        ctx.settings = (stride, padding, dilation, groups, None if bias is None else bias.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        stride, padding, dilation, groups, bias_shape = ctx.settings
        unbatched = x.dim() == 3  # F.conv2d takes one image without a batch dimension
        if unbatched:
            x, grad = x.unsqueeze(0), grad.unsqueeze(0)
        needs = ctx.needs_input_grad
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad,
            x,
            weight,
            bias_shape,
            _pair(stride),
            _pair(padding),
            _pair(dilation),
            False,
            [0, 0],
            groups,
            [needs[0], needs[1], needs[2] and bias_shape is not None],
        )
        if unbatched and gx is not None:
            gx = gx.squeeze(0)
        return gx, gw, gb, None, None, None, None


class _ClientConv2d(_Conv2d):
    """``F.conv2d`` which, under ``torch.vmap`` with a weight per client (a stacked cohort),
    runs each client's own convolution and stacks the outputs, where vmap would run one grouped
    convolution (``groups = clients``) over the clients' inputs laid side by side.

    Written by hand because PyTorch's vmap rule for a convolution has one form, and oneDNN's
    grouped kernels can be much slower per FLOP than its plain ones when each group has few
    channels: CNN7's second convolution at 32x32 (6 -> 16 channels, 5x5, 10 clients of 64
    examples) took 47.9 ms grouped against 28.2 ms client by client, forward and backward
    (``benchmarks/vmap_conv.py --batch 64``), and a whole FedAvg round of CNN7 at 32x32 ran at
    0.83x of the sequential backend's speed with vmap's grouped convolutions, 0.98x with these
    (``benchmarks/client_conv.py``). Which layers gain is a measured rule, not a law:
    :func:`_conv2d` takes this function only for layers with few channels per group and enough
    work per client (:data:`CLIENT_CONV_MAX_IN_CHANNELS`).

    The forward and every gradient are bitwise what each client's own convolution and its
    ``convolution_backward`` give (``tests/models/test_client_conv.py``)."""

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
    ) -> tuple[Tensor, int]:
        def client(t: Tensor | None, dim: int | None, i: int) -> Tensor | None:
            return t if t is None or dim is None else t.select(dim, i)

        xd, wd, bd = in_dims[:3]
        outputs = [
            F.conv2d(
                client(x, xd, i),  # type: ignore[arg-type]
                client(weight, wd, i),  # type: ignore[arg-type]
                client(bias, bd, i),
                stride,
                padding,
                dilation,
                groups,
            )
            for i in range(info.batch_size)
        ]
        return torch.stack(outputs), 0


def _clients_first(t: Tensor, dim: int | None, clients: int) -> Tensor:
    """A stacked tensor with its clients' dimension first; one shared by every client (``dim``
    ``None``) expanded to them, without a copy."""
    return t.expand(clients, *t.shape) if dim is None else t.movedim(dim, 0)


class _StackedConv2d(_Conv2d):
    """``F.conv2d`` which, under ``torch.vmap`` with a weight per client (a stacked cohort), is
    one grouped convolution (``groups = clients x groups``) with the bias inside the kernel, and
    whose output keeps the clients beside the channels (the clients' dimension is its dim 1).

    Written by hand because vmap's own rule for this convolution runs the same grouped kernel
    but adds a per-client bias in a separate pass over the output, and because the layers after
    it then copy that output: vmap's max-pooling rule folds the clients into the images'
    dimension (dim 0), which for an output laid out clients beside channels is a copy. With
    this function and :class:`_StackedMaxPool2d` a convolution, ReLU and pooling chain (the body
    of a CNN) reads each stacked activation where it lies: the only copy left is of the cohort's
    input images, whose clients come first (``tests/models/test_stacked_conv.py`` counts them).
    On pfl-research's CIFAR-10 CNN, where those passes over 10-100 MB activations were much of
    what stacking lost to the sequential backend, batched RABO rounds went from 0.95-0.98x of
    the sequential backend's speed to 0.98-1.00x at 10 clients and from 0.81-0.85x to
    0.92-0.96x at 50 (``benchmarks/client_conv.py``, BENCHMARKS.md "Stacked convolutions and
    pooling without copies"). Each custom function costs Python time under vmap, so
    :func:`_conv` takes it only for outputs of at least :data:`STACKED_CONV_MIN_NUMEL`
    elements per client.

    The output equals ``F.conv2d`` of the clients' inputs laid side by side with their weights
    and biases concatenated, bitwise; each client's part equals its own convolution to the
    grouped kernel's rounding, as vmap's rule does. Unlike the client-by-client rule it applies
    on every device: it launches the kernel vmap's rule launches, without the bias pass and the
    copies (on a GPU that is fewer launches; not timed there, as no GPU was lent)."""

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
    ) -> tuple[Tensor, int]:
        clients = info.batch_size
        xd, wd, bd = in_dims[:3]
        w = _clients_first(weight, wd, clients)
        b = None if bias is None else _clients_first(bias, bd, clients)
        x = _clients_first(x, xd, clients)
        one_image = x.dim() == 4  # (clients, channels, height, width)
        # (images, clients x channels, ...): a view when the clients lie beside the channels
        side_by_side = x.unsqueeze(0) if one_image else x.movedim(0, 1)
        out = F.conv2d(
            side_by_side.flatten(1, 2),
            w.flatten(0, 1),
            None if b is None else b.flatten(),
            stride,
            padding,
            dilation,
            groups * clients,
        ).unflatten(1, (clients, -1))
        return (out.squeeze(0), 0) if one_image else (out, 1)


class _StackedMaxPool2d(torch.autograd.Function):
    """``F.max_pool2d`` which, under ``torch.vmap`` (a stacked cohort), pools the clients' images
    where they lie: the clients' dimension folded into its neighbour (images or channels; a
    view when the clients' dimension is dim 0 or 1), where vmap's rule moves it beside the
    images first (a copy when the clients lie beside the channels, as after
    :class:`_StackedConv2d`). Max pooling treats every image and channel alike, so the output
    and its gradient are bitwise vmap's and each client's own (``tests/models/
    test_stacked_conv.py``). Outside vmap it is ``F.max_pool2d``, with its own backward
    (differentiable again: RABO's Hessian-vector products pass through it)."""

    @staticmethod
    def forward(
        x: Tensor, kernel: Any, stride: Any, padding: Any, dilation: Any, ceil: bool
    ) -> Tensor:
        return F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=ceil)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.settings = inputs[1:]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil = ctx.settings
        _, indices = F.max_pool2d(
            x.detach(), kernel, stride, padding, dilation, ceil_mode=ceil, return_indices=True
        )
        kernel = _pair(kernel)
        gx = torch.ops.aten.max_pool2d_with_indices_backward(
            grad,
            x,
            kernel,
            kernel if stride is None or stride == [] else _pair(stride),  # F's default stride
            _pair(padding),
            _pair(dilation),
            ceil,
            indices,
        )
        return gx, None, None, None, None, None

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple[int | None, ...],
        x: Tensor,
        kernel: Any,
        stride: Any,
        padding: Any,
        dilation: Any,
        ceil: bool,
    ) -> tuple[Tensor, int]:
        (xd,) = in_dims[:1]
        if xd not in (0, 1):  # a shared input (None) or another layout: clients first
            x, xd = _clients_first(x, xd, info.batch_size), 0
        if x.dim() == 4 and xd == 0:  # one image per client: the clients are its batch
            return F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=ceil), 0
        out = F.max_pool2d(x.flatten(0, 1), kernel, stride, padding, dilation, ceil_mode=ceil)
        return out.unflatten(0, x.shape[:2]), xd


def _pair(value: Any) -> list[int]:
    return [value, value] if isinstance(value, int) else [int(v) for v in value]


def _padding(padding: Any, dilation: Any, kernel: Sequence[int]) -> list[int] | None:
    """A convolution's padding as two numbers per side (``"valid"``: none; ``"same"``: half the
    dilated kernel's extent), or ``None`` for ``"same"`` padding that is not symmetric (an even
    extent, which PyTorch pads by one more on one side)."""
    if not isinstance(padding, str):
        return _pair(padding)
    if padding == "valid":
        return [0, 0]
    extent = [d * (k - 1) for d, k in zip(_pair(dilation), kernel, strict=True)]
    return None if any(e % 2 for e in extent) else [e // 2 for e in extent]


#: A stacked cohort's convolutions with at most this many input channels per group, at most
#: :data:`CLIENT_CONV_MAX_OUT_CHANNELS` output channels per group and at least
#: :data:`CLIENT_CONV_MIN_FLOPS` per client run as each client's own convolution
#: (:class:`_ClientConv2d`); the others as vmap's one grouped convolution. Measured in whole
#: rounds on one CPU thread (``benchmarks/client_conv.py``, BENCHMARKS.md "Convolutions of a
#: stacked cohort client by client"): CNN7 at 32x32 (1 -> 6 and 6 -> 16 channels, 7.5 and 15
#: MFLOP per client) gains (FedAvg 0.83x of sequential -> 0.98x at 10 clients, RABO 1.30x ->
#: 1.43x at 50); the first convolution of pfl-research's CIFAR-10 CNN (3 -> 32, 16 MFLOP),
#: which only the bound on output channels leaves grouped, gains nothing (``--max-out-channels
#: 64``: FedAvg and RABO at 10 clients and FedAvg at 50 within 1 % either way), so that CNN
#: keeps its bits; below 4 MFLOP per client, stacking's saved overhead wins (CNN7 at 16x16,
#: 1.4 MFLOP, forced client by client with ``--min-flops 0``: FedAvg at 50 clients 2.18x of
#: sequential -> 1.40x, RABO 3.51x -> 2.44x). Other layers the rule takes (narrow pruned
#: submodels on 28x28 images, for instance) were not timed. It applies on the CPU only.
CLIENT_CONV_MAX_IN_CHANNELS = 8
CLIENT_CONV_MAX_OUT_CHANNELS = 16
CLIENT_CONV_MIN_FLOPS = 1 << 22

#: A stacked cohort's other convolutions with at least this many output elements per client,
#: and its max-poolings with at least this many input elements per client, run as radbo's own
#: batching (:class:`_StackedConv2d`, :class:`_StackedMaxPool2d`: no separate bias pass, no
#: copies of the activations); smaller ones as vmap's rules, whose extra passes cost less there
#: than the custom functions' Python time under vmap. Measured in whole rounds on one CPU
#: thread (``benchmarks/client_conv.py``, BENCHMARKS.md "Stacked convolutions and pooling
#: without copies"): on pfl-research's CIFAR-10 CNN (layers of 0.29-1.6 M elements per client)
#: batched RABO rounds went from 0.95-0.98x of sequential's speed to 0.98-1.00x at 10 clients
#: and from 0.81-0.85x to 0.92-0.96x at 50; CNN7's layers at 16x16 (4,096 and 55,296 elements)
#: gain nothing when taken (``--stacked-min-numel 0``: FedAvg at 10 clients 1.48x -> 1.40x,
#: RABO 1.90x -> 1.61x, at 50 clients 2.39x -> 2.32x and 3.30x -> 3.33x).
STACKED_CONV_MIN_NUMEL = 1 << 18


def _conv_outputs(x: Tensor, weight: Tensor, stride: Any, pad: list[int], dilation: Any) -> int:
    """The number of elements of one client's convolution's output, from the shapes as the
    client sees them (inside vmap, without the clients' dimension), for a padding of ``pad`` per
    side."""
    size = [
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, p, d, k, s in zip(
            x.shape[-2:], pad, _pair(dilation), weight.shape[-2:], _pair(stride), strict=True
        )
    ]
    rows = x.shape[0] if x.dim() == 4 else 1
    return rows * weight.shape[0] * size[0] * size[1]


def _conv_flops(x: Tensor, weight: Tensor, stride: Any, pad: list[int], dilation: Any) -> int:
    """One client's convolution's FLOPs (2 x multiply-adds: each output element sums one
    group's input channels times the kernel area) from the shapes as the client sees them."""
    return 2 * _conv_outputs(x, weight, stride, pad, dilation) * weight[0].numel()


def _conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
) -> Tensor:
    if carries_vmap_dim(weight):
        pad = _padding(padding, dilation, weight.shape[-2:])
        # "same" / "valid" as the numbers they stand for: F.conv2d runs the same kernel
        if pad is not None and _client_by_client(x, weight, stride, pad, dilation, groups):
            return _ClientConv2d.apply(x, weight, bias, stride, pad, dilation, groups)
        if pad is not None and _conv_outputs(x, weight, stride, pad, dilation) >= (
            STACKED_CONV_MIN_NUMEL
        ):
            return _StackedConv2d.apply(x, weight, bias, stride, pad, dilation, groups)
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups)


def _client_by_client(
    x: Tensor, weight: Tensor, stride: Any, pad: list[int], dilation: Any, groups: int
) -> bool:
    """Whether a stacked cohort's convolution of these (one client's) shapes runs client by
    client (the rule of :data:`CLIENT_CONV_MAX_IN_CHANNELS`). On the CPU only, where the rule
    was measured: on a GPU each client's convolution would be a kernel launch of its own."""
    return (
        weight.device.type == "cpu"
        and weight.shape[1] <= CLIENT_CONV_MAX_IN_CHANNELS
        and weight.shape[0] // groups <= CLIENT_CONV_MAX_OUT_CHANNELS
        and _conv_flops(x, weight, stride, pad, dilation) >= CLIENT_CONV_MIN_FLOPS
    )


@layer_rule(nn.Conv2d)
def _conv2d(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    assert isinstance(layer, nn.Conv2d)
    weight, bias = state[prefix + "weight"], _bias(layer, prefix, state)
    if layer.padding_mode != "zeros":
        padded = F.pad(x, layer._reversed_padding_repeated_twice, mode=layer.padding_mode)
        return _conv(padded, weight, bias, layer.stride, (0, 0), layer.dilation, layer.groups)
    return _conv(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)


@layer_rule(nn.BatchNorm2d)
def _batch_norm2d(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    # nn.modules.batchnorm._BatchNorm.forward, line by line, on the tensors of ``state``
    assert isinstance(layer, nn.BatchNorm2d)
    layer._check_input_dim(x)
    momentum = layer.momentum
    factor = 0.0 if momentum is None else momentum
    training, tracked = layer.training, layer.track_running_stats
    mean: Tensor | None
    var: Tensor | None
    if tracked:
        mean, var = state[prefix + "running_mean"], state[prefix + "running_var"]
        if training:
            count = state[prefix + "num_batches_tracked"]
            count.add_(1)
            factor = 1.0 / float(count) if momentum is None else momentum
    else:
        mean = var = None
    bn_training = training or (mean is None and var is None)
    weight: Tensor | None
    bias: Tensor | None
    if layer.affine:
        weight, bias = state[prefix + "weight"], state[prefix + "bias"]
    else:
        weight = bias = None
    use_stats = not training or tracked
    return F.batch_norm(
        x,
        mean if use_stats else None,
        var if use_stats else None,
        weight,
        bias,
        bn_training,
        factor,
        layer.eps,
    )


@layer_rule(nn.ReLU)
def _relu(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    assert isinstance(layer, nn.ReLU)
    return F.relu(x, inplace=layer.inplace)


@layer_rule(nn.LeakyReLU)
def _leaky_relu(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    assert isinstance(layer, nn.LeakyReLU)
    return F.leaky_relu(x, layer.negative_slope, layer.inplace)


@layer_rule(nn.MaxPool2d)
def _max_pool2d(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    assert isinstance(layer, nn.MaxPool2d)
    if carries_vmap_dim(x) and not layer.return_indices and x.numel() >= STACKED_CONV_MIN_NUMEL:
        return _StackedMaxPool2d.apply(
            x, layer.kernel_size, layer.stride, layer.padding, layer.dilation, layer.ceil_mode
        )
    return F.max_pool2d(  # type: ignore[call-overload]  # return_indices is a plain bool
        x,
        layer.kernel_size,
        layer.stride,
        layer.padding,
        layer.dilation,
        ceil_mode=layer.ceil_mode,
        return_indices=layer.return_indices,
    )


@layer_rule(nn.AdaptiveAvgPool2d)
def _adaptive_avg_pool2d(
    layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor
) -> Tensor:
    assert isinstance(layer, nn.AdaptiveAvgPool2d)
    return F.adaptive_avg_pool2d(x, layer.output_size)


@layer_rule(nn.Flatten)
def _flatten(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    assert isinstance(layer, nn.Flatten)
    return x.flatten(layer.start_dim, layer.end_dim)
