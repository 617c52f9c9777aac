"""Device budgets: training memory, measured peak memory, capacity ratio r and local steps τ.

SPEC "Devices": pure functions map a device's budget to a capacity ratio ``r`` -- the largest
``r`` whose submodel's training memory (weights + gradients + optimiser state + activations for
the batch, plus the hypergradient's buffers) fits the device's memory -- and a number of local
steps ``τ`` -- what the round deadline leaves after communication, at the device's sustained
FLOP/s. The idea of per-client compute and communication capacities and a virtual clock is
FedScale's (Lai et al., ICML 2022, ``client_device_capacity``); the capacity-ratio submodels
are HeteroFL's (Diao et al., ICLR 2021).

* :func:`estimate_training_memory` -- a component-wise memory model of one training step,
  whose activation term is exact (the tensors autograd saves, counted on the ``meta`` device);
* :func:`measure_peak_memory` -- the measured peak of live CPU tensor memory while a function
  runs (the allocator's own bookkeeping, read through the profiler), to validate the model;
* :func:`capacity_for`, :func:`local_steps_for` -- the two budget functions;
* :class:`BudgetPlanner` -- caches, per capacity level, the submodel's memory, FLOPs and bytes,
  and turns a device profile and a round deadline into a :class:`Budget`.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from radbo._torch_private import TorchDispatchMode, tree_flatten
from radbo.cost import DeviceLike
from radbo.flops import meta_training_inputs, trainable_names, training_step_flops
from radbo.hypergrad import Estimator, FiniteDifference, FirstOrder, ImplicitCG, MemoryFootprint
from radbo.masks.policies.leading import LeadingPolicy
from radbo.masks.structure import StructurePlan

__all__ = [
    "DEFAULT_LEVELS",
    "Budget",
    "BudgetPlanner",
    "DeviceTooSmallError",
    "MemoryEstimate",
    "capacity_for",
    "estimate_training_memory",
    "local_steps_for",
    "measure_peak_memory",
]

#: HeteroFL's capacity levels: r = 1, 1/2, 1/4, 1/8, 1/16.
DEFAULT_LEVELS: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)

Hypergradient = Literal["none", "implicit", "finite_difference", "first_order"]
#: The estimator whose memory model each name of :data:`Hypergradient` stands for (``None``: no
#: hypergradient buffers); an estimator itself may be given instead of a name.
_HYPERGRADIENTS: dict[str, type[Estimator] | None] = {
    "none": None,
    "implicit": ImplicitCG,
    "finite_difference": FiniteDifference,
    "first_order": FirstOrder,
}
HypergradientModel = Hypergradient | Estimator | type[Estimator] | None


def _memory_model(hypergradient: HypergradientModel) -> Estimator | type[Estimator] | None:
    """What models the buffers of ``hypergradient``: a configured estimator itself (its
    :meth:`~radbo.hypergrad.Estimator.memory_bytes` reads its settings), else the estimator
    class (:meth:`~radbo.hypergrad.Estimator.hypergradient_bytes`) of a name of
    :data:`Hypergradient` or a class; ``None`` or ``"none"``: nothing."""
    if hypergradient is None:
        return None
    if isinstance(hypergradient, Estimator):
        return hypergradient  # its settings may matter (Estimator.memory_bytes)
    if isinstance(hypergradient, type) and issubclass(hypergradient, Estimator):
        return hypergradient
    if not isinstance(hypergradient, str) or hypergradient not in _HYPERGRADIENTS:
        raise ValueError(
            f"hypergradient must be one of {list(_HYPERGRADIENTS)}, got {hypergradient!r}"
        )
    return _HYPERGRADIENTS[hypergradient]


class MemoryProfile(Protocol):
    """What :func:`capacity_for` reads from a device profile (:class:`DeviceProfile`)."""

    @property
    def name(self) -> str: ...

    @property
    def memory_bytes(self) -> int: ...


class ComputeProfile(Protocol):
    """What :func:`local_steps_for` reads from a device profile."""

    @property
    def name(self) -> str: ...

    @property
    def compute_flops(self) -> float: ...


class DeviceTooSmallError(ValueError):
    """A device cannot hold even the smallest submodel's training memory."""


# ---------------------------------------------------------------------------------------------
# memory model


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes needed to train a model on one batch, by component, as
    :func:`estimate_training_memory` models them (SPEC "Devices": the training memory a device
    must hold at a capacity level):

    * ``weights``: every parameter (numel x element size). Buffers (BatchNorm running
      statistics) are not counted; they are a few vectors per layer.
    * ``gradients``: one gradient per parameter, the size of the weights (both x and y are
      trained in a bilevel round: y by inner SGD steps, x by the hypergradient).
    * ``optimizer_state``: ``optimizer_slots`` x the weights (0 for plain SGD, 1 for momentum,
      2 for Adam).
    * ``activations``: exactly what autograd saves for backward in one forward pass of
      cross-entropy on this batch with every parameter trainable -- the tensors passed to
      ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, parameters
      excluded (they are in ``weights``), the input batch and the targets included -- plus a
      *backward working set* of twice the largest saved tensor: during backward, the gradient
      arriving at a layer's output and the one it produces for its input coexist with the
      saved tensors not yet released. The working-set term is the approximation; it ignores
      that backward frees each node's saved tensors once the node has run, so the sum is an
      upper bound in practice (see ``tests/devices/test_budget.py`` for measured numbers).
    * ``hypergradient``: the estimator's buffers beyond a plain training step, its
      :meth:`~radbo.hypergrad.Estimator.hypergradient_bytes` (|x|, |y| are the bytes of the
      outer and inner parameters); by the name given to :func:`estimate_training_memory`:

      - ``"none"``: 0.
      - ``"implicit"`` (RABO eq. (7), :class:`radbo.hypergrad.ImplicitCG` / ``Neumann``): the
        graph of ``∇_y g`` built with ``create_graph=True`` and kept alive for the
        Hessian-vector products -- a second set of saved activations (the forward of ``g``,
        next to the first set that ``f``'s graph holds:
        :class:`radbo.hypergrad.base.ImplicitSystem` keeps ``f``'s graph alive while it builds
        ``g``'s) plus the tensors the backward itself saves for double backward, both counted
        exactly with ``saved_tensors_hooks`` -- plus the CG vectors ``v, r, p, Ap`` (4|y|),
        ``∇_x f, ∇_y f`` (|x| + |y|), and the mixed product ``∇²_xy g · v`` and the
        hypergradient itself (2|x|). ``ImplicitSystem`` also makes detached copies of x and y
        (|x| + |y|); they are not added, because the inner step's gradients (the
        ``gradients`` term, same size) are not alive during the hypergradient call. The
        transient gradients of the activations during Hessian-vector products are not added
        either (the ``activations`` working set covers them).
      - ``"finite_difference"`` (RAFBO, Alg. 2): ``∇_x f, ∇_y f`` (|x| + |y|), two gradient
        buffers of y (``∇_y g`` at ``x`` and at ``x + μ e_p``), one of x (the hypergradient
        being accumulated) and the CG vectors of the finite-difference solve (4|y|); no
        second-order graph.
      - ``"first_order"`` (penalty method, ``papers/fedsbo_first_order.txt``): the auxiliary
        copies ``y_λ`` and ``z`` of y (2|y|).

      The hypergradient call and the inner steps of a round run one after the other, so
      adding their memory is conservative by up to one set of gradients.
    """

    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    hypergradient: int

    @property
    def total(self) -> int:
        """Sum of all components, in bytes."""
        return (
            self.weights
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.hypergradient
        )


class _SavedTensors:
    """Bytes of the distinct storages autograd saves for backward (``saved_tensors_hooks``).

    Storages are identified by their Python object, which PyTorch keeps unique per storage as
    long as the storage lives (views share it); the recorder holds a reference to every storage
    it saw so that identities cannot be reused. Storages in ``exclude`` (the parameters) are
    not counted.
    """

    def __init__(self, exclude: Sequence[Tensor]) -> None:
        self._exclude = {id(t.untyped_storage()) for t in exclude}
        self._seen: dict[int, Any] = {}
        self.bytes = 0
        self.largest = 0

    def pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self._exclude and key not in self._seen:
            self._seen[key] = storage
            nbytes = int(storage.nbytes())
            self.bytes += nbytes
            self.largest = max(self.largest, nbytes)
        return t

    @staticmethod
    def unpack(t: Tensor) -> Tensor:
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _param_bytes(params: Sequence[Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def estimate_training_memory(
    module: nn.Module,
    batch_size: int,
    *,
    optimizer_slots: int = 0,
    hypergradient: HypergradientModel = "implicit",
    inner_names: Sequence[str] | None = None,
) -> MemoryEstimate:
    """Bytes needed to train ``module`` on a batch of ``batch_size`` examples, by component.

    SPEC "Devices": the training memory a device must hold at a capacity level, by component:
    weights, gradients, optimiser state, the activations autograd saves (counted exactly) with
    a backward working set, and the hypergradient estimator's buffers -- each is described,
    with what it includes and leaves out, on :class:`MemoryEstimate`.

    The forward/backward is run on the ``meta`` device (shapes only: nothing is allocated or
    computed, ``module`` is untouched), in ``module``'s current train/eval mode. Assumes
    cross-entropy on class logits, as in radbo's tasks; a custom loss saving larger tensors
    would need more.

    Args:
        module: the (sub)model to train.
        batch_size: examples per step, ``>= 1``.
        optimizer_slots: optimiser state tensors per parameter, ``>= 0``; default 0 (SGD).
        hypergradient: which estimator's buffers to add: a name above (default
            ``"implicit"``), an estimator or its class, or ``None`` (as ``"none"``).
        inner_names: names of the inner parameters y; default ``module.inner_param_names()``
            (needed for every ``hypergradient`` but ``"none"``).

    >>> from radbo.models import MLP
    >>> est = estimate_training_memory(MLP(4, [3], 2), 1, hypergradient="none")
    >>> est.weights, est.gradients  # (4*3 + 3 + 3*2 + 2) floats
    (92, 92)
    """
    batch_size = _check_positive_int("batch_size", batch_size)
    if isinstance(optimizer_slots, bool) or not isinstance(optimizer_slots, int):
        raise ValueError(f"optimizer_slots must be an integer >= 0, got {optimizer_slots!r}")
    if optimizer_slots < 0:
        raise ValueError(
            f"optimizer_slots must be >= 0 (0 SGD, 1 momentum, 2 Adam), got {optimizer_slots}"
        )
    model = _memory_model(hypergradient)
    params = dict(module.named_parameters())
    weights = _param_bytes(list(params.values()))
    step = _MetaForward(module, batch_size)
    extra = 0
    if model is not None:
        inner = trainable_names(module, "inner", inner_names)
        y_bytes = _param_bytes([params[n] for n in inner])
        footprint = MemoryFootprint(
            weights - y_bytes, y_bytes, lambda: step.second_order(inner), step.activations
        )
        if isinstance(model, Estimator):
            extra = model.memory_bytes(footprint)
        else:
            extra = model.hypergradient_bytes(footprint)
    return MemoryEstimate(
        weights=weights,
        gradients=weights,
        optimizer_state=optimizer_slots * weights,
        activations=step.activations,
        hypergradient=extra,
    )


class _MetaForward:
    """One forward of cross-entropy on a batch on the ``meta`` device, every parameter
    trainable, and the bytes autograd saved for its backward (:class:`_SavedTensors`)."""

    def __init__(self, module: nn.Module, batch_size: int) -> None:
        names = trainable_names(module, "all")
        self.state, inputs, targets = meta_training_inputs(module, batch_size, trainable=names)
        self.params = [self.state[n] for n in names]
        self.saved = _SavedTensors(exclude=self.params)
        with torch.enable_grad(), self.saved.hooks():
            self.loss = F.cross_entropy(functional_call(module, self.state, (inputs,)), targets)

    @property
    def activations(self) -> int:
        """The saved tensors plus a backward working set of twice the largest one."""
        return self.saved.bytes + 2 * self.saved.largest

    def second_order(self, inner: Sequence[str]) -> int:
        """``g``'s saved forward plus what ``∇_y g`` (``y``: the parameters named ``inner``)
        with ``create_graph`` saves."""
        backward = _SavedTensors(exclude=self.params)
        backward._seen.update(self.saved._seen)  # already counted in the second set
        with backward.hooks():
            torch.autograd.grad(self.loss, [self.state[n] for n in inner], create_graph=True)
        return self.saved.bytes + backward.bytes


# ---------------------------------------------------------------------------------------------
# measured peak memory


class _LiveStorages(TorchDispatchMode):
    """Tracks the bytes of storages that operators allocate, until each is released."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        inputs = {id(t.untyped_storage()) for t in flat_in if isinstance(t, Tensor)}
        out = func(*args, **kwargs)
        flat_out, _ = tree_flatten(out)
        for t in flat_out:
            if not isinstance(t, Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            # A view or an in-place result aliases an input: nothing new was allocated.
            if key in inputs or key in self._live:
                continue
            nbytes = int(storage.nbytes())
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._release, key).atexit = False
        return out


def _peak_dispatch(fn: Callable[[], Any]) -> int:
    with _LiveStorages() as tracker:
        fn()
    return tracker.peak


def _peak_allocator(fn: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    if not torch.autograd.kineto_available():
        raise RuntimeError(
            "measure_peak_memory(method='allocator') needs PyTorch's Kineto profiler, which this "
            "build lacks; use method='dispatch'"
        )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), int(e.nbytes()))
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda ev: ev[0])  # stable: same-time events keep their recorded order
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


#: How :func:`measure_peak_memory` measures, by its ``method``.
_PEAK_METHODS: dict[str, Callable[[Callable[[], Any]], int]] = {
    "allocator": _peak_allocator,
    "dispatch": _peak_dispatch,
}


def measure_peak_memory(
    fn: Callable[[], Any], *, method: Literal["allocator", "dispatch"] = "allocator"
) -> int:
    """Measured peak bytes of CPU tensor memory allocated while ``fn()`` runs.

    The peak, over the run, of (bytes allocated since ``fn`` started) − (bytes freed since),
    floored at 0: memory that existed before (the model's weights, say) is not included, and
    freeing it during ``fn`` lowers the count. ``fn``'s return value is discarded, and
    everything it returns is freed only after the measurement.

    Methods:

    * ``"allocator"`` (default): every allocation and free of PyTorch's CPU allocator, as
      recorded by ``torch.profiler.profile(profile_memory=True)`` (Kineto ``[memory]``
      events), integrated in time order. It sees kernel-internal workspaces too. It cannot be
      used inside another profiler session, and Kineto may log a line to stderr.
    * ``"dispatch"``: a ``TorchDispatchMode`` that records the storage of every operator
      output that does not alias an input (views and in-place results are counted once) and
      its release through ``weakref.finalize`` on the storage, which fires when the storage
      is freed. It misses memory a kernel allocates internally and releases before returning
      (about 1.5 % of a ResNet-18 training step's peak).

    Both count storage bytes as requested (the CPU allocator's alignment padding of at most
    64 bytes per tensor is ignored) and only CPU memory.

    >>> def three_then_one():
    ...     a, b, c = (torch.empty(250_000) for _ in range(3))  # 3 x 1 MB
    ...     del b
    ...     d = torch.empty(250_000)
    >>> measure_peak_memory(three_then_one, method="dispatch")
    3000000
    """
    measure = _PEAK_METHODS.get(method) if isinstance(method, str) else None
    if measure is None:
        allowed = " or ".join(repr(m) for m in _PEAK_METHODS)
        raise ValueError(f"method must be {allowed}, got {method!r}")
    return measure(fn)


# ---------------------------------------------------------------------------------------------
# budget functions


def _check_levels(levels: Sequence[float]) -> tuple[float, ...]:
    out = tuple(levels)
    if not out:
        raise ValueError("levels must hold at least one capacity ratio in (0, 1], got none")
    for r in out:
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0.0 < float(r) <= 1.0:
            raise ValueError(f"every capacity level must be a number in (0, 1], got {r!r}")
    return tuple(float(r) for r in out)


def _check_number(name: str, value: object, *, positive: bool = True) -> float:
    if not (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and (float(value) > 0 if positive else float(value) >= 0)
    ):
        what = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {what}, got {value!r}")
    return float(value)


def capacity_for(
    profile: MemoryProfile,
    memory_at: Callable[[float], int],
    levels: Sequence[float] = DEFAULT_LEVELS,
) -> float:
    """Largest capacity level ``r`` whose training memory ``memory_at(r)`` fits the device.

    SPEC "Devices": ``r`` is the largest level with ``memory_at(r) <= profile.memory_bytes``
    (levels need not be sorted, and ``memory_at`` need not be monotone).

    Raises:
        ValueError: ``levels`` is empty or holds a value outside ``(0, 1]``.
        DeviceTooSmallError: no level fits; the message names the device, its memory and
            what the smallest submodel needs.

    >>> from types import SimpleNamespace
    >>> capacity_for(SimpleNamespace(name="pi", memory_bytes=300), lambda r: int(1000 * r * r))
    0.5
    """
    levels = _check_levels(levels)
    memory = profile.memory_bytes
    fits = [r for r in levels if memory_at(r) <= memory]
    if fits:
        return max(fits)
    smallest = min(levels)
    raise DeviceTooSmallError(
        f"device {profile.name!r} has {memory} bytes of memory for training, but the smallest "
        f"submodel (capacity {smallest:g}) needs {memory_at(smallest)} bytes; lower the batch "
        "size, add a smaller capacity level, or leave the device out of the fleet"
    )


def local_steps_for(
    profile: ComputeProfile, step_flops: float, deadline_s: float, *, fixed_s: float = 0.0
) -> int:
    """Local steps that fit in the round deadline at the device's sustained FLOP/s.

    ``τ = floor((deadline_s − fixed_s) / (step_flops / profile.compute_flops))``, at least 1:
    a device too slow for one step still does one, and the caller's clock sees it miss the
    deadline. ``fixed_s`` is time the round spends on other things (communication, the
    hypergradient). A quotient within a relative 1e-12 of the next integer is rounded up, so
    float noise does not lose a step (``1.5 / 0.1`` is 15 steps).

    Raises:
        ValueError: ``step_flops``, ``deadline_s`` or ``profile.compute_flops`` not finite and
            positive, or ``fixed_s`` not finite and ``>= 0``.

    >>> from types import SimpleNamespace
    >>> local_steps_for(SimpleNamespace(name="pi", compute_flops=1e9), 1e8, 2.05, fixed_s=0.5)
    15
    """
    compute = _check_number(f"compute_flops of device {profile.name!r}", profile.compute_flops)
    step_flops = _check_number("step_flops", step_flops)
    deadline_s = _check_number("deadline_s", deadline_s)
    fixed_s = _check_number("fixed_s", fixed_s, positive=False)
    step_s = step_flops / compute
    steps = (deadline_s - fixed_s) / step_s
    if not steps >= 1.0:
        return 1
    if math.isinf(steps):
        raise ValueError(
            f"device {profile.name!r} would fit infinitely many steps of {step_flops:g} FLOPs; "
            "check compute_flops and step_flops"
        )
    n = math.floor(steps)
    if math.isclose(steps, n + 1, rel_tol=1e-12):  # float noise: 1.5 / 0.1 = 14.999...
        n += 1
    return max(1, n)


# ---------------------------------------------------------------------------------------------
# planner


@dataclass(frozen=True)
class Budget:
    """A device's budget for one round (see :meth:`BudgetPlanner.budget`).

    Attributes:
        capacity: capacity ratio r of the submodel the device trains.
        local_steps: local steps τ that fit the round deadline, ``>= 1``.
        memory: training memory of the submodel at ``capacity``.
        memory_fits: whether ``memory.total`` fits the device (false only for budgets made
            with ``allow_oversize=True``).
        step_flops: FLOPs of one local training step of the submodel.
        step_time_s: ``step_flops / compute_flops``.
        comm_time_s: time to download and upload the submodel's parameters.
        round_time_s: expected round time at this (r, τ): communication plus ``τ`` steps plus
            the hypergradient (``hypergradient_step_factor`` steps).
    """

    capacity: float
    local_steps: int
    memory: MemoryEstimate
    memory_fits: bool
    step_flops: int
    step_time_s: float
    comm_time_s: float
    round_time_s: float


class BudgetPlanner:
    """Budgets (r, τ) of a whole fleet for one model, with per-level costs cached.

    For every capacity level ``r`` the planner builds the submodel once -- HeteroFL's leading
    channels (:class:`radbo.masks.policies.leading.LeadingPolicy`) at ratio ``r`` for every
    prunable group of ``plan`` -- and caches its training memory
    (:func:`estimate_training_memory`), the FLOPs of one training step w.r.t. all its
    parameters (:func:`radbo.flops.training_step_flops`) and its parameter bytes. Then
    :meth:`budget` is arithmetic (SPEC "Devices"; FedScale's per-client compute and
    communication capacities).

    Args:
        plan: the model's structure plan (its model is the full model).
        batch_size: examples per local step, ``>= 1``.
        levels: capacity levels to choose from; default 1, 1/2, 1/4, 1/8, 1/16.
        optimizer_slots: optimiser state per parameter (0 SGD, 1 momentum, 2 Adam); default 0.
        hypergradient: hypergradient buffers to budget for, as
            :func:`estimate_training_memory` takes them; default ``"implicit"``.
        inner_names: names of the inner parameters y; default
            ``plan.model.inner_param_names()``.
        hypergradient_step_factor: the hypergradient computation's time, in training steps;
            default 3 (an implicit hypergradient costs two gradient evaluations plus a few
            Hessian-vector products, each about one training step). It is charged once per
            round, before the local steps are counted.
    """

    def __init__(
        self,
        plan: StructurePlan,
        batch_size: int,
        *,
        levels: Sequence[float] = DEFAULT_LEVELS,
        optimizer_slots: int = 0,
        hypergradient: HypergradientModel = "implicit",
        inner_names: Sequence[str] | None = None,
        hypergradient_step_factor: float = 3.0,
    ) -> None:
        self.plan = plan
        self.batch_size = _check_positive_int("batch_size", batch_size)
        self.levels = _check_levels(levels)
        if isinstance(optimizer_slots, bool) or not isinstance(optimizer_slots, int):
            raise ValueError(f"optimizer_slots must be an integer >= 0, got {optimizer_slots!r}")
        if optimizer_slots < 0:
            raise ValueError(
                f"optimizer_slots must be >= 0 (0 SGD, 1 momentum, 2 Adam), got {optimizer_slots}"
            )
        self.optimizer_slots = optimizer_slots
        _memory_model(hypergradient)  # a name it does not know is an error now
        self.hypergradient: HypergradientModel = hypergradient
        self.inner_names = None if inner_names is None else tuple(inner_names)
        self.hypergradient_step_factor = _check_number(
            "hypergradient_step_factor", hypergradient_step_factor, positive=False
        )
        self._submodels: dict[float, nn.Module] = {}
        self._memory: dict[float, MemoryEstimate] = {}
        self._flops: dict[float, int] = {}
        self._bytes: dict[float, int] = {}

    def submodel(self, r: float) -> nn.Module:
        """The leading-channel submodel at capacity ``r`` (built once, then cached)."""
        r = _check_levels([r])[0]
        if r not in self._submodels:
            ratios = dict.fromkeys(self.plan.groups, r)
            kept = LeadingPolicy()(
                self.plan, ratios, round=0, client=0, generator=torch.Generator()
            )
            self._submodels[r] = self.plan.submodel(self.plan.index_sets(kept))
        return self._submodels[r]

    def memory_at(self, r: float) -> MemoryEstimate:
        """Training memory of the submodel at capacity ``r`` (cached)."""
        r = _check_levels([r])[0]
        if r not in self._memory:
            self._memory[r] = estimate_training_memory(
                self.submodel(r),
                self.batch_size,
                optimizer_slots=self.optimizer_slots,
                hypergradient=self.hypergradient,
                inner_names=self.inner_names,
            )
        return self._memory[r]

    def step_flops_at(self, r: float) -> int:
        """FLOPs of one training step (forward + backward w.r.t. all parameters) at ``r``."""
        r = _check_levels([r])[0]
        if r not in self._flops:
            self._flops[r] = training_step_flops(self.submodel(r), self.batch_size)
        return self._flops[r]

    def param_bytes_at(self, r: float) -> int:
        """Bytes of the submodel's parameters at ``r`` (what is sent down and back up)."""
        r = _check_levels([r])[0]
        if r not in self._bytes:
            self._bytes[r] = _param_bytes(list(self.submodel(r).parameters()))
        return self._bytes[r]

    def budget(
        self, profile: DeviceLike, deadline_s: float, *, allow_oversize: bool = False
    ) -> Budget:
        """The device's capacity ``r``, local steps ``τ`` and expected round time.

        * ``r = capacity_for(profile, memory_at(·).total, levels)``;
        * ``comm_time_s = 8 · param_bytes_at(r) · (1/downlink_bps + 1/uplink_bps)`` (the
          submodel's parameters down and the same amount back up; index metadata ignored);
        * ``step_time_s = step_flops_at(r) / compute_flops``;
        * ``τ = local_steps_for(profile, step_flops_at(r), deadline_s,
          fixed_s=comm_time_s + hypergradient_step_factor · step_time_s)``;
        * ``round_time_s = comm_time_s + (τ + hypergradient_step_factor) · step_time_s``, which
          exceeds ``deadline_s`` when even one step does not fit.

        Raises:
            DeviceTooSmallError: no level fits the device's memory, unless ``allow_oversize``,
                in which case the smallest level is returned with ``memory_fits=False``.
            ValueError: a non-positive or non-finite deadline, bandwidth or FLOP/s.
        """
        deadline_s = _check_number("deadline_s", deadline_s)
        down = _check_number(f"downlink_bps of device {profile.name!r}", profile.downlink_bps)
        up = _check_number(f"uplink_bps of device {profile.name!r}", profile.uplink_bps)
        compute = _check_number(f"compute_flops of device {profile.name!r}", profile.compute_flops)
        try:
            r = capacity_for(profile, lambda c: self.memory_at(c).total, self.levels)
            fits = True
        except DeviceTooSmallError:
            if not allow_oversize:
                raise
            r, fits = min(self.levels), False
        step_flops = self.step_flops_at(r)
        step_s = step_flops / compute
        comm_s = 8.0 * self.param_bytes_at(r) * (1.0 / down + 1.0 / up)
        hyper_s = self.hypergradient_step_factor * step_s
        tau = local_steps_for(profile, step_flops, deadline_s, fixed_s=comm_s + hyper_s)
        return Budget(
            capacity=r,
            local_steps=tau,
            memory=self.memory_at(r),
            memory_fits=fits,
            step_flops=step_flops,
            step_time_s=step_s,
            comm_time_s=comm_s,
            round_time_s=comm_s + (tau + self.hypergradient_step_factor) * step_s,
        )

    def budgets(
        self, profiles: Sequence[DeviceLike], deadline_s: float, *, allow_oversize: bool = False
    ) -> list[Budget]:
        """:meth:`budget` of every profile, computed once per distinct profile: clients whose
        profiles are equal (the same catalog device, or equal records of a fleet file) share
        one :class:`Budget` object, so a fleet of 100,000 clients from a handful of devices
        computes and holds a handful of budgets.

        >>> from radbo.devices import load_catalog
        >>> from radbo.masks.structure import StructurePlan
        >>> from radbo.models import MLPConfig
        >>> model = MLPConfig(hidden=[8]).build((4,), 2)
        >>> planner = BudgetPlanner(StructurePlan(model, model.example_input(1)), 4)
        >>> pi, phone = load_catalog()["raspberry_pi_4"], load_catalog()["phone_low"]
        >>> out = planner.budgets([pi, phone, pi, pi], 5.0)
        >>> out[0] is out[2] is out[3], out[0] == planner.budget(pi, 5.0), len({id(b) for b in out})
        (True, True, 2)
        """
        by_id: dict[int, Budget] = {}
        by_value: dict[Any, Budget] = {}
        out = []
        for profile in profiles:
            found = by_id.get(id(profile))
            if found is None:
                try:
                    found = by_value.get(profile)
                except TypeError:  # an unhashable profile: shared by identity only
                    found = None
                if found is None:
                    found = self.budget(profile, deadline_s, allow_oversize=allow_oversize)
                    try:
                        by_value[profile] = found
                    except TypeError:
                        pass
                by_id[id(profile)] = found
            out.append(found)
        return out

    def at(self, profile: DeviceLike, capacity: float, local_steps: int) -> Budget:
        """Costs of a given ``(capacity, local_steps)`` on ``profile`` (e.g. a capacity fixed
        by the configuration rather than chosen by :meth:`budget`): memory and whether it fits,
        step time, communication time and the expected round time, with the same model as
        :meth:`budget`."""
        local_steps = _check_positive_int("local_steps", local_steps)
        compute = _check_number(f"compute_flops of device {profile.name!r}", profile.compute_flops)
        down = _check_number(f"downlink_bps of device {profile.name!r}", profile.downlink_bps)
        up = _check_number(f"uplink_bps of device {profile.name!r}", profile.uplink_bps)
        memory = self.memory_at(capacity)
        step_flops = self.step_flops_at(capacity)
        step_s = step_flops / compute
        comm_s = 8.0 * self.param_bytes_at(capacity) * (1.0 / down + 1.0 / up)
        return Budget(
            capacity=capacity,
            local_steps=local_steps,
            memory=memory,
            memory_fits=memory.total <= profile.memory_bytes,
            step_flops=step_flops,
            step_time_s=step_s,
            comm_time_s=comm_s,
            round_time_s=comm_s + (local_steps + self.hypergradient_step_factor) * step_s,
        )
