"""FLOP counting for training steps, Hessian-vector products and whole client functions.

SPEC "Cost accounting": the FLOPs a client executes are *measured*, by running the work once
under PyTorch's ``torch.utils.flop_counter.FlopCounterMode``, instead of being modelled per
sample (FedScale's ``client_device_capacity`` traces give a per-sample compute cost; here the
cost follows the submodel's real shapes). What the counter does and does not count:

* It counts matrix products and convolutions (``mm``, ``addmm``, ``bmm``, ``convolution``,
  scaled-dot-product attention, ...) as ``2 x`` multiply-accumulates, in the forward pass, in
  backward, and in double backward (the Hessian-vector products of implicit hypergradients),
  because autograd's backward ops run through the same dispatcher.
* It skips elementwise operations (ReLU, additions, softmax, the optimiser update), BatchNorm,
  pooling and reductions: they are memory-bound and small next to the products. The totals are
  therefore a lower bound of the arithmetic, exact for the products that dominate it.
* It only counts what autograd really executes: the gradient of a layer's input is not computed
  when nothing upstream needs it (the data, frozen layers), and ``torch.autograd.grad`` with a
  subset of parameters prunes the rest of the backward graph.

FLOPs depend only on shapes, so :func:`training_step_flops` runs its step on the ``meta``
device: no memory is allocated and no arithmetic is done, which makes counting a ResNet-18 at
any batch size instantaneous.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from radbo._torch_private import (
    HigherOrderOperator,
    TorchDispatchMode,
    current_dispatch_mode,
    pop_mode_temporarily,
)

__all__ = [
    "RepeatedWorkError",
    "count_flops",
    "meta_training_inputs",
    "new_scope",
    "repeated",
    "trainable_names",
    "training_step_flops",
]

Wrt = Literal["all", "inner", "outer"]


class RepeatedWorkError(RuntimeError):
    """Two :func:`repeated` blocks with the same key counted different FLOPs: the caller's
    promise that they run the same work does not hold, and reusing a count would be wrong."""


class _HigherOrderOp(Exception):
    """A higher-order operator (``cond``, a Triton kernel) met while counting: left to
    ``FlopCounterMode``, which has rules for them."""


# Ops that only query metadata: ``FlopCounterMode`` lets them run untouched (returning
# NotImplemented hands them back to the default behaviour); so does the counter below.
_METADATA_OPS = frozenset(
    getattr(getattr(torch.ops.aten, name), overload)
    for name, overload in [
        ("sym_is_contiguous", "default"),
        ("is_contiguous", "default"),
        ("is_contiguous", "memory_format"),
        ("is_strides_like_format", "default"),
        ("is_non_overlapping_and_dense", "default"),
        ("size", "default"),
        ("sym_size", "default"),
        ("stride", "default"),
        ("sym_stride", "default"),
        ("storage_offset", "default"),
        ("sym_storage_offset", "default"),
        ("numel", "default"),
        ("sym_numel", "default"),
        ("dim", "default"),
    ]
    if hasattr(torch.ops.aten, name) and hasattr(getattr(torch.ops.aten, name), overload)
) | {torch.ops.prim.layout.default}


def _signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """What a FLOP formula can read of ``args``: tensors by their shape, lists as tuples."""
    return tuple(
        ("shape", *a.shape)
        if isinstance(a, Tensor)
        else _signature(a)
        if isinstance(a, list | tuple)
        else a
        for a in args
    )


class _TotalFlops(TorchDispatchMode):
    """``FlopCounterMode``'s counting rules without its per-module bookkeeping.

    ``FlopCounterMode`` also attributes every count to the modules on the call stack (a module
    tracker with forward and backward hooks on every module), which radbo never reads and which
    costs about a third of its time on radbo's many small operations. This mode applies the same
    rules -- the same skipped metadata ops, the same decomposition of ops without a formula, the
    same formulas (``torch.utils.flop_counter.flop_registry``) -- and keeps one total, so its
    count equals ``FlopCounterMode.get_total_flops()`` (``tests/flops/test_flops.py`` checks it on
    linear, convolutional, BatchNorm and double-backward workloads).

    Written by hand because every operation of a client passes through it: what each operator
    needs (skip, formula, decomposition) is looked up once per operator and kept in
    :attr:`_plans`, instead of asking the dispatcher again for every call (``FlopCounterMode``
    enters the mode and asks for a ``CompositeImplicitAutograd`` kernel on every operation
    without a formula, which is most of them); and the mode is not wrapped to keep Dynamo out
    (it never runs under ``torch.compile``)."""

    # operator -> None (metadata: let it run untouched), or (formula or None, decomposable)
    _plans: dict[Any, tuple[Callable[..., Any] | None, bool] | None] = {}
    # (operator, argument shapes and values) -> its FLOPs
    _counts: dict[tuple[Any, ...], int] = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, reuse: bool = True, check: bool = True) -> None:
        super().__init__()
        self.total = 0
        #: counts of the :func:`repeated` blocks met so far, by key (``None``: no reuse)
        self.repeats: dict[tuple[Any, ...], int] | None = {} if reuse else None
        #: the keys whose second block is still to be counted and compared with the first
        #: (``check``); a key leaves once its second block has been
        self.unchecked: set[tuple[Any, ...]] | None = set() if check else None
        #: inside a block whose count is known, which runs outside the mode
        self.paused = False

    @classmethod
    def _plan(cls, func: Any) -> tuple[Callable[..., Any] | None, bool] | None:
        if func in _METADATA_OPS:
            plan = None
        else:
            formula = flop_registry.get(func.overloadpacket)
            decomposable = (
                formula is None
                and func is not torch.ops.prim.device.default
                and func.has_kernel_for_dispatch_key(torch.DispatchKey.CompositeImplicitAutograd)
            )
            plan = (formula, decomposable)
        cls._plans[func] = plan
        return plan

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            plan = self._plans[func]
        except KeyError:
            if isinstance(func, HigherOrderOperator):
                raise _HigherOrderOp(str(func)) from None
            plan = self._plan(func)
        if plan is None:
            return NotImplemented
        formula, decomposable = plan
        if decomposable:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if formula is not None:
            # the formulas read shapes and flags only; applying one (a pytree walk over the
            # arguments) costs several times the small product itself, so each distinct call
            # signature is evaluated once
            key = (func, _signature(args), _signature(tuple(kwargs.items())) if kwargs else ())
            try:
                flops = self._counts.get(key)
                cacheable = True
            except TypeError:  # an argument that cannot be a key: apply the formula
                flops, cacheable = None, False
            if flops is None:
                flops = int(formula(*args, **kwargs, out_val=out))
                if cacheable:
                    self._counts[key] = flops
            self.total += flops
        return out


_COUNTER: ContextVar[_TotalFlops | None] = ContextVar("radbo_flop_counter", default=None)
_SCOPES = itertools.count()


def new_scope() -> int:
    """A fresh integer for the keys of :func:`repeated` blocks: blocks of one call (one CG
    solve, one client's inner loop) share a scope, blocks of different calls never do."""
    return next(_SCOPES)


class _Inert:
    """What :func:`repeated` returns when no count is running: does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_INERT = _Inert()


class _Repeated:
    """One :func:`repeated` block while :func:`count_flops` counts."""

    __slots__ = ("counter", "key", "known", "start", "guard")

    def __init__(self, counter: _TotalFlops, key: tuple[Any, ...]) -> None:
        self.counter = counter
        self.key = key
        self.guard: Any = None

    def __enter__(self) -> None:
        counter = self.counter
        assert counter.repeats is not None
        self.known = counter.repeats.get(self.key)
        self.start = counter.total
        sample = counter.unchecked is not None and self.key in counter.unchecked
        if self.known is not None and not sample and current_dispatch_mode() is counter:
            # the count of this work is known: run it at full speed, outside the mode
            self.guard = pop_mode_temporarily()
            self.guard.__enter__()
            counter.paused = True

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        counter = self.counter
        if self.guard is not None:
            counter.paused = False
            self.guard.__exit__(kind, exc, tb)
            if kind is None and self.known is not None:
                counter.total += self.known
        elif kind is None:
            counted = counter.total - self.start
            if self.known is None:
                assert counter.repeats is not None
                counter.repeats[self.key] = counted
                if counter.unchecked is not None:
                    counter.unchecked.add(self.key)
            else:  # counted again (the check's sample): the promise must hold
                if counter.unchecked is not None:
                    counter.unchecked.discard(self.key)
                if counted != self.known:
                    raise RepeatedWorkError(
                        f"blocks marked repeated{self.key!r} counted {self.known} FLOPs the "
                        f"first time and {counted} the second: blocks with equal keys must run "
                        "the same matrix products on tensors of the same shapes (a step whose "
                        "products differ is not uniform: local_steps(..., uniform=False))"
                    )


def repeated(*key: Any) -> _Inert | _Repeated:
    """Mark a block of work that repeats with the same FLOPs: counted once, then reused.

    Inside :func:`count_flops`, the first block with a given ``key`` is counted operation by
    operation as usual; every later block with the same key runs outside the counter, at
    full speed, and adds the first one's count. Outside a count it does nothing (one lookup).
    The caller promises that blocks with equal keys execute the same matrix products and
    convolutions: straight-line code (no branch that changes the work) on tensors of the same
    shapes, with the same tensors requiring grad -- an inner step of a local loop, one
    conjugate-gradient iteration. Put a :func:`new_scope` in the key so that blocks of
    different calls (two CG solves on different systems) never share a count. Blocks may nest.

    The promise is checked on a sample (``count_flops(..., check=True)``, the default): the
    second block of every key is counted too, and a count that differs from the first raises
    :class:`RepeatedWorkError`. Work that changes only from the third block on is not caught
    (counting every block would undo the saving); the sample catches what the first
    repetition already shows -- a first step that differs from the rest, a product whose
    shapes depend on the data.

    Why by hand (no library skips a counter for known work): counting runs every operation
    through a Python dispatch mode (2-3x the cost of radbo's small operations); a client's
    repeated steps are most of its operations, so counting one of each is what makes measuring
    a new workload cheap (``count_flops(fn, reuse=False)`` counts everything, for tests).

    >>> a = torch.ones(4, 3)
    >>> def work():
    ...     scope = new_scope()
    ...     for _ in range(5):
    ...         with repeated("step", scope):
    ...             a @ a.T
    >>> count_flops(work), count_flops(work, reuse=False)  # 5 x 2*4*3*4
    (480, 480)
    """
    counter = _COUNTER.get()
    if counter is None or counter.repeats is None or counter.paused:
        return _INERT
    return _Repeated(counter, key)


def count_flops(
    fn: Callable[[], Any],
    *,
    reuse: bool = True,
    blocks: dict[tuple[Any, ...], int] | None = None,
    check: bool = True,
) -> int:
    """Total FLOPs executed by ``fn()``: what ``FlopCounterMode(display=False)`` counts.

    Counts forward, backward and double-backward matrix products and convolutions
    (``2 x`` multiply-accumulates); skips elementwise ops, BatchNorm, pooling and reductions
    (see the module docstring). Runs ``fn`` under a lean mode with ``FlopCounterMode``'s rules
    but without its per-module bookkeeping (:class:`_TotalFlops`; about 2x faster), and under
    ``FlopCounterMode`` itself when ``fn`` uses higher-order operators. ``fn``'s return value is
    discarded; ``fn`` may run twice in that fallback, so it must be pure.

    ``reuse`` (default): blocks of ``fn`` marked :func:`repeated` are counted once per key and
    then run outside the counter (the same total, much faster); ``False`` counts every
    operation. ``blocks``, when given, receives the count of each block key met (with
    ``reuse``). ``check`` (default): the second block of each key is counted as well and must
    match the first (:func:`repeated`; :class:`RepeatedWorkError` otherwise).

    >>> a, b = torch.ones(4, 3), torch.ones(3, 5)
    >>> count_flops(lambda: a @ b)  # 2 * 4 * 3 * 5
    120
    """
    counter = _TotalFlops(reuse=reuse, check=check)
    token = _COUNTER.set(counter)
    try:
        with counter:
            fn()
        if blocks is not None and counter.repeats is not None:
            blocks.update(counter.repeats)
        return counter.total
    except _HigherOrderOp:
        pass
    finally:
        _COUNTER.reset(token)
    with FlopCounterMode(display=False) as reference:
        fn()
    return int(reference.get_total_flops())


def _input_shape(module: nn.Module, input_shape: Sequence[int] | None) -> tuple[int, ...]:
    if input_shape is not None:
        shape = tuple(int(s) for s in input_shape)
    else:
        example = getattr(module, "example_input", None)
        if not callable(example):
            raise ValueError(
                f"{type(module).__name__} has no example_input(batch); pass input_shape= "
                "(the shape of one example, without the batch dimension)"
            )
        shape = tuple(example(1).shape[1:])
    if any(s < 1 for s in shape):
        raise ValueError(f"input_shape must hold positive sizes, got {shape}")
    return shape


def trainable_names(
    module: nn.Module, wrt: Wrt, inner_names: Sequence[str] | None = None
) -> list[str]:
    """Names of the parameters a step differentiates: all of them, the inner (y) or outer (x).

    ``inner_names`` defaults to ``module.inner_param_names()`` (radbo's
    :class:`~radbo.models.BilevelModel`). Names unknown to ``module`` raise ``ValueError``.
    """
    names = [n for n, _ in module.named_parameters()]
    if wrt == "all":
        return names
    if wrt not in ("inner", "outer"):
        raise ValueError(f"wrt must be 'all', 'inner' or 'outer', got {wrt!r}")
    if inner_names is None:
        getter = getattr(module, "inner_param_names", None)
        if not callable(getter):
            raise ValueError(
                f"{type(module).__name__} does not declare inner_param_names(); pass "
                "inner_names= (the names of its inner parameters y)"
            )
        inner_names = getter()
    inner = set(inner_names)
    unknown = sorted(inner - set(names))
    if unknown:
        raise ValueError(f"inner_names {unknown} are not parameters of {type(module).__name__}")
    return [n for n in names if (n in inner) == (wrt == "inner")]


def meta_training_inputs(
    module: nn.Module,
    batch_size: int,
    *,
    trainable: Sequence[str],
    input_shape: Sequence[int] | None = None,
) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """``(state, inputs, targets)`` on the ``meta`` device for a shape-only training step.

    ``state`` holds every parameter and buffer of ``module`` as a fresh meta tensor (the
    ``trainable`` ones require grad), so that ``functional_call(module, state, (inputs,))`` runs
    without touching or allocating the module's real tensors (BatchNorm updates the meta
    copies of its running statistics, not the module's). Targets are class 0: FLOPs and
    memory depend on shapes only.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    shape = _input_shape(module, input_shape)
    keep = set(trainable)
    state: dict[str, Tensor] = {}
    for name, p in module.named_parameters():
        state[name] = torch.empty_like(p, device="meta").requires_grad_(name in keep)
    for name, b in module.named_buffers():
        state[name] = torch.empty_like(b, device="meta")
    first = next(module.parameters(), None)
    dtype = torch.get_default_dtype() if first is None else first.dtype
    inputs = torch.empty((batch_size, *shape), device="meta", dtype=dtype)
    targets = torch.zeros(batch_size, dtype=torch.long, device="meta")
    return state, inputs, targets


def training_step_flops(
    module: nn.Module,
    batch_size: int,
    *,
    wrt: Wrt = "all",
    inner_names: Sequence[str] | None = None,
    input_shape: Sequence[int] | None = None,
) -> int:
    """FLOPs of one forward + backward of cross-entropy on a batch, w.r.t. chosen parameters.

    The step is ``torch.autograd.grad(F.cross_entropy(module(inputs), targets), params)`` where
    ``params`` are all parameters (``wrt="all"``), the inner ones y (``"inner"``: e.g. the head
    of a hyper-representation model, so the backbone's backward is not run) or the outer ones x
    (``"outer"``). Parameters not differentiated are constants, so autograd skips their weight
    gradients and every input gradient that no differentiated parameter needs. The data never
    gets a gradient. The optimiser update is elementwise and not counted.

    The batch has ``batch_size`` examples of ``module.example_input``'s shape (or
    ``input_shape`` for a module without ``example_input``). It runs on the ``meta`` device
    (FLOPs depend on shapes only; see the module docstring); ``module`` is not modified.

    Args:
        module: the (sub)model; its output must be class logits ``(batch, classes)``.
        batch_size: examples per step, ``>= 1``.
        wrt: which parameters to differentiate; default ``"all"``.
        inner_names: names of the inner parameters y, for ``wrt`` ``"inner"``/``"outer"``;
            default ``module.inner_param_names()``.
        input_shape: shape of one example, for modules without ``example_input``.

    >>> from radbo.models import MLP
    >>> training_step_flops(MLP(4, [3], 2), 1)  # 2*4*3*2 (layer 1) + 2*3*2*3 (head)
    84
    """
    names = trainable_names(module, wrt, inner_names)
    state, inputs, targets = meta_training_inputs(
        module, batch_size, trainable=names, input_shape=input_shape
    )
    params = [state[n] for n in names]

    def step() -> None:
        with torch.enable_grad():
            logits = functional_call(module, state, (inputs,))
            loss = F.cross_entropy(logits, targets)
            if params:
                # a parameter only a loss reads (a hyperparameter) is not in this graph
                torch.autograd.grad(loss, params, allow_unused=True)

    return count_flops(step)
