"""Functional forward passes of the zoo's layers, without re-parametrisation.

``torch.func.functional_call`` evaluates a module on given tensors by swapping them into the
module, calling it and swapping them back: a Python ``setattr`` per tensor, twice, plus the
module-call machinery, on every loss evaluation. The functions here compute each layer of the
zoo straight from a state dict (keyed like ``state_dict``) with the ``torch.nn.functional`` op
and arguments that the layer's own ``forward`` uses, in the same order, so the result, its
gradients and its higher-order products are bitwise those of ``functional_call``. One
exception, by design: inside ``torch.vmap`` with a weight per client (a stacked cohort), a
linear layer of at least :data:`STACKED_LINEAR_MIN_WEIGHTS` weights computes its weight
gradient as the one-client backward does, which keeps it contiguous (:class:`_StackedLinear`);
that gradient equals ``functional_call``'s to rounding, and everything else stays bitwise.

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
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

from radbo._torch_private import carries_vmap_dim

__all__ = ["STACKED_LINEAR_MIN_WEIGHTS", "apply_layer", "has_functional_form", "layer_rule"]

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


@layer_rule(nn.Conv2d)
def _conv2d(layer: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    assert isinstance(layer, nn.Conv2d)
    weight, bias = state[prefix + "weight"], _bias(layer, prefix, state)
    if layer.padding_mode != "zeros":
        padded = F.pad(x, layer._reversed_padding_repeated_twice, mode=layer.padding_mode)
        return F.conv2d(padded, weight, bias, layer.stride, (0, 0), layer.dilation, layer.groups)
    return F.conv2d(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)


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
