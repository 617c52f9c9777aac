"""What crosses between the server and a client, and how client work is written and run.

These types sit below the mask policies, the algorithms, the simulation engine and every
backend, which all speak them:

* :class:`ClientBudget` -- what one client can afford in a round (capacity r, local steps);
* :class:`ClientTask` -- everything one client receives for one phase of one round;
* :class:`ClientResult` / :class:`CostRecord` -- its reply: an update, metrics, and the work
  and bytes it cost;
* :class:`ClientRuntime` -- the read-only context client work runs in (problem, data, model);
* :class:`ClientWork`, :class:`Prepared`, :class:`Cohort` -- client work, written once, that a
  backend can run for one client or for a cohort of clients at once;
* :class:`Phase` and :class:`Algorithm` -- an algorithm as state plus pure phase functions;
* :class:`Backend` and :class:`MaskAssigner` -- the engine's pluggable parts.

**Client work.** A phase's client work is a :class:`ClientWork`: ``prepare(runtime, task)``
makes every random draw of the task from the task's own generator (minibatches, sampled
coordinates) and returns them as a :class:`Prepared`; ``run(runtime, cohort)`` does the
arithmetic for a :class:`Cohort` -- one client with its own tensors, or several clients whose
tensors have equal shapes stacked along a new leading dimension -- and returns one
:class:`ClientResult` per client. ``run`` is written once, with the cohort-aware helpers of
:mod:`radbo.autodiff` (per-client inner products, step sizes and stopping tests) and
:meth:`Cohort.loss` (the problem's loss, under ``torch.vmap`` for a stacked cohort), its
local steps with :meth:`Cohort.local_steps` (:mod:`radbo.loops`: finished clients masked,
repeated steps marked for the FLOP meter, work counted), so the sequential, batched and
Flower backends all run the same code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor, nn

from radbo.cost import FlopMeter, shape_signature, tensor_bytes
from radbo.graphs import PhaseGraphs
from radbo.loops import LocalSteps, Work, cg_iteration_flops, local_steps
from radbo.problem import (
    PAD_INDEX,
    PAD_TARGET,
    Batch,
    BilevelProblem,
    ClientData,
    MinibatchSampler,
    Sampler,
    bind_losses,
)
from radbo.typing import IndexSet, Params

__all__ = [
    "Algorithm",
    "Backend",
    "ClientBudget",
    "ClientResult",
    "ClientRuntime",
    "ClientTask",
    "ClientWork",
    "Cohort",
    "CostRecord",
    "MaskAssigner",
    "Phase",
    "Prepared",
    "mean_metric",
    "pads_minibatches",
    "reply",
    "run_measured",
]

State = TypeVar("State")
Carry = TypeVar("Carry")


@dataclass(frozen=True)
class ClientBudget:
    """What one client can afford this round: capacity ratio r in (0, 1] and local steps."""

    capacity: float = 1.0
    local_steps: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.capacity <= 1:
            raise ValueError(f"ClientBudget.capacity must be in (0, 1], got {self.capacity}")
        if self.local_steps < 1:
            raise ValueError(f"ClientBudget.local_steps must be >= 1, got {self.local_steps}")


@dataclass(frozen=True)
class CostRecord:
    """Work one client did in one phase, and what crossed the (simulated) wire.

    ``n_grad`` counts first-order gradient evaluations, ``n_hvp`` second-order products
    (Hessian- or Jacobian-vector), ``samples`` the examples forwarded, ``bytes_down`` /
    ``bytes_up`` the payload tensors received / sent (numel x element size). ``flops`` is
    filled in by the engine's :class:`~radbo.cost.FlopMeter` (measured, not modelled).
    """

    n_grad: int = 0
    n_hvp: int = 0
    samples: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    flops: int = 0


@dataclass(frozen=True)
class ClientTask:
    """Everything one client receives for one phase of one round.

    ``slot`` is the client's position among the phase's participants (see ``Phase.select``).
    """

    client: int
    round: int
    phase: str
    params: Params
    index_set: IndexSet
    data: ClientData
    seed: int
    budget: ClientBudget
    slot: int = 0

    def generator(self) -> torch.Generator:
        """A fresh generator seeded for this (client, round, phase)."""
        return torch.Generator().manual_seed(self.seed)


@dataclass(frozen=True)
class ClientResult:
    """A client's reply: an update in submodel coordinates, its cost and scalar metrics.

    ``slot`` is set by the engine to the task's slot (client functions need not fill it).

    A backend that runs clients elsewhere (Flower) reports a failed client without raising:
    ``lost`` (why) when the reply never arrived -- the engine treats the client as a dropout
    of that phase (``RoundRecord.dropped``; ``cost`` is what was spent: the bytes sent down,
    no compute, nothing up) -- and ``rejected`` (why) when a reply arrived but failed the
    backend's checks: left out of aggregation and counted like an update failing
    :func:`~radbo.simulation.engine.update_problem` (``RoundRecord.rejected``), ``cost``
    charged. Either reason is listed in ``RoundRecord.failures``.
    """

    client: int
    update: Params
    cost: CostRecord
    metrics: Mapping[str, float] = field(default_factory=dict)
    slot: int = 0
    lost: str | None = None
    rejected: str | None = None


#: a cohort's local steps for :meth:`Cohort.run_steps`: ``run(state, step_data, steps,
#: counts)``, ``step_data(key, t)`` the example indices of per-step key ``key`` at step t
StepsRun = Callable[
    [tuple[Any, ...], Callable[[str, int], Tensor], Any, Tensor | None], LocalSteps[Any]
]


def _shape_key(index_set: IndexSet) -> tuple:
    if all(i is None for idx in index_set.values() for i in idx):
        return ("dense",)
    return tuple(
        (n, tuple(-1 if i is None else i.numel() for i in idx))
        for n, idx in sorted(index_set.items())
    )


@dataclass
class ClientRuntime:
    """Read-only context shared by all client work: problem, training data, how minibatches are
    drawn (``sampler``; see :class:`~radbo.problem.Sampler`) and the factory of submodel
    skeletons (modules whose tensor shapes match an index set).

    Skeletons are cached by shape: ``functional_call`` supplies every parameter and buffer, so
    clients whose submodels have the same shapes share one module.

    ``pads`` says that a stacked cohort may pad its clients' shorter minibatches (see
    :attr:`Prepared.ragged`): the problem's losses average over examples with
    ``F.cross_entropy``'s default ``ignore_index`` (:data:`~radbo.problem.PAD_TARGET`, which
    :meth:`batch` gives a padded example) and the model mixes no examples (no BatchNorm, no
    dropout); :func:`pads_minibatches` decides it.

    ``graphs``: where set (``[runtime] cuda_graphs``), client work that supports it replays
    a stacked cohort's phase from a CUDA graph (:class:`radbo.graphs.PhaseGraphs`; RABO's and
    RAFBO's two phases, the local steps of FedAvg, Dist-ProtoNet, Dist-MAML, SimFBO,
    ShroFBO, FedSVRBGD-FO, AggITD, FedNest and LFedNest: :meth:`Cohort.run_steps`).

    ``channels_last``: :meth:`batch` gives a client's image minibatches (``N x C x H x W``) in
    ``torch.channels_last`` layout (``[runtime] memory_format``); a stacked cohort's (one
    dimension more) keep theirs.
    """

    problem: BilevelProblem
    features: Tensor
    labels: Tensor
    model: nn.Module
    build_submodel: Callable[[IndexSet], nn.Module] | None = None
    sampler: Sampler = field(default_factory=MinibatchSampler)
    pads: bool = False
    channels_last: bool = False
    #: CUDA graphs of stacked cohorts' phases (``[runtime] cuda_graphs``; ``None``: eager)
    graphs: PhaseGraphs | None = None
    _cache: dict[tuple, nn.Module] = field(default_factory=dict, repr=False)

    def module_for(self, index_set: IndexSet) -> nn.Module:
        """A module in training mode whose tensor shapes are those selected by ``index_set``."""
        key = _shape_key(index_set)
        module = self._cache.get(key)
        if module is None:
            if key == ("dense",):
                module = copy.deepcopy(self.model)
            elif self.build_submodel is None:
                raise ValueError("a submodel was requested but no mask structure is configured")
            else:
                module = self.build_submodel(index_set)
            module.train()
            self._cache[key] = module
        return module

    def batch(self, indices: Tensor) -> Batch:
        """The examples at ``indices`` of the training set (any leading shape); where
        :attr:`pads`, an index :data:`~radbo.problem.PAD_INDEX` is a padded example (the last
        one's features, target :data:`~radbo.problem.PAD_TARGET`)."""
        labels = self.labels[indices]
        if self.pads and indices.ndim > 1:  # only a stacked cohort's minibatches are padded
            labels = labels.masked_fill((indices == PAD_INDEX).to(labels.device), PAD_TARGET)
        features = self.features[indices]
        if self.channels_last and features.ndim == 4:  # one client's images, N x C x H x W
            features = features.contiguous(memory_format=torch.channels_last)
        return Batch(features, labels)


def pads_minibatches(problem: BilevelProblem, model: nn.Module) -> bool:
    """Whether stacked cohorts may pad minibatches (:attr:`ClientRuntime.pads`): the problem
    says its losses are means of ``F.cross_entropy`` over examples plus terms free of the
    batch (a class attribute ``pads_minibatches = True``), and no layer of ``model`` mixes
    examples (BatchNorm normalises with the batch's statistics; dropout draws per example)."""
    mixing = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    return bool(getattr(problem, "pads_minibatches", False)) and not any(
        isinstance(m, mixing) for m in model.modules()
    )


# ---------------------------------------------------------------------------- client work
@dataclass(frozen=True)
class Prepared:
    """A client's random draws for one task, made before any arithmetic.

    Attributes:
        data: tensors drawn once (e.g. a minibatch's example indices); a cohort stacks them
            along a new first dimension.
        steps: tensors drawn once per local step, step first (``[num_steps, ...]``); a cohort
            stacks them along a new *second* dimension (``[steps, clients, ...]``) and pads a
            client with fewer steps by repeating its last entry (those steps are masked out,
            see :meth:`Cohort.local_steps`).
        num_steps: the client's number of local steps (the length of every ``steps`` entry).
        key: anything else clients must share to run together (hashable; default none).
        ragged: keys of ``data`` or ``steps`` whose last dimension is a minibatch of example
            indices (read through :meth:`ClientRuntime.batch`): where the runtime
            :attr:`~ClientRuntime.pads`, clients whose minibatches differ only in length run
            as one cohort, the shorter ones padded (:meth:`Cohort.data`).
    """

    data: Mapping[str, Tensor] = field(default_factory=dict)
    steps: Mapping[str, Tensor] = field(default_factory=dict)
    num_steps: int = 0
    key: Hashable = ()
    ragged: frozenset[str] = frozenset()

    def signature(self, pad: bool = False) -> Hashable:
        """What two clients' draws must have in common to run as one cohort (shapes, dtypes
        and ``key``; not the number of steps; with ``pad``, not the length of a
        :attr:`ragged` minibatch)."""

        def sig(items: Mapping[str, Tensor], skip: int) -> tuple:
            return tuple(
                (k, tuple(t.shape[skip : -1 if pad and k in self.ragged else None]), t.dtype)
                for k, t in sorted(items.items())
            )

        return (sig(self.data, 0), sig(self.steps, 1), self.key)

    def size(self, key: str) -> int:
        """The length of minibatch ``key`` (its last dimension, unpadded)."""
        return (self.data[key] if key in self.data else self.steps[key]).shape[-1]


def no_draws(runtime: ClientRuntime, task: ClientTask) -> Prepared:
    """The ``prepare`` of client work that draws nothing."""
    return Prepared()


def padded_stack(tensors: Sequence[Tensor], longest: int) -> Tensor:
    """``tensors`` (equal shapes but the last axis, at most ``longest`` long) stacked along
    the axis before the last, each padded at the end with :data:`~radbo.problem.PAD_INDEX` to
    ``longest``: what padding each and stacking them gives, in a fixed number of operations
    (one concatenation and one indexed copy into a filled block, its positions computed from
    the lengths) instead of one padding per short tensor.

    >>> import torch
    >>> padded_stack([torch.tensor([1, 2, 3]), torch.tensor([4])], 3).tolist()
    [[1, 2, 3], [4, -1, -1]]
    """
    lengths = torch.tensor([t.shape[-1] for t in tensors])
    flat = torch.cat(list(tensors), dim=-1)
    lead = tuple(flat.shape[:-1])
    clients = len(tensors)
    # client c's j-th entry goes to c * longest + j: its offset in flat is the lengths before it
    shift = torch.arange(clients) * longest - (torch.cumsum(lengths, 0) - lengths)
    where = torch.arange(flat.shape[-1]) + torch.repeat_interleave(shift, lengths)
    out = torch.full((*lead, clients * longest), PAD_INDEX, dtype=flat.dtype, device=flat.device)
    out.index_copy_(-1, where.to(flat.device), flat)
    return out.view(*lead, clients, longest)


@dataclass(frozen=True)
class Cohort:
    """Clients that run one phase's work together: one client, or several whose tensors have
    equal shapes, stacked along a new first dimension (``stacked``).

    Client work reads its inputs through the cohort (:meth:`params`, :meth:`data`,
    :meth:`step_data`), evaluates the problem's losses through :meth:`loss`, and answers with
    :meth:`replies`; with :mod:`radbo.autodiff`'s helpers at ``lead = cohort.lead`` the same
    code serves both cases.
    """

    tasks: tuple[ClientTask, ...]
    prepared: tuple[Prepared, ...]
    stacked: bool = False
    #: per-step tensors of a stacked cohort whose clients run equally many steps, stacked
    #: once (``[steps, clients, ...]``) on first use
    _all_steps: dict[str, Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def single(cls, task: ClientTask, prepared: Prepared) -> Cohort:
        return cls((task,), (prepared,), stacked=False)

    @classmethod
    def stack(cls, tasks: Sequence[ClientTask], prepared: Sequence[Prepared]) -> Cohort:
        """A stacked cohort (every task's tensors must have equal shapes)."""
        if not tasks or len(tasks) != len(prepared):
            raise ValueError(
                f"a cohort needs tasks and draws, got {len(tasks)} and {len(prepared)}"
            )
        return cls(tuple(tasks), tuple(prepared), stacked=True)

    # -- shape of the cohort
    @property
    def lead(self) -> int:
        """Leading client dimensions of every tensor: 1 when stacked, else 0."""
        return 1 if self.stacked else 0

    @property
    def size(self) -> int:
        return len(self.tasks)

    @property
    def index_set(self) -> IndexSet:
        """The submodel's index set (the clients' index sets select equal shapes)."""
        return self.tasks[0].index_set

    def module(self, runtime: ClientRuntime) -> nn.Module:
        """The submodel skeleton the cohort's clients share."""
        return runtime.module_for(self.index_set)

    # -- inputs
    def _gather(self, tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
        return torch.stack(list(tensors), dim=dim) if self.stacked else tensors[0]

    def _draws(
        self, key: str, tensors: Sequence[Tensor], dim: int = 0, pad_to: int | None = None
    ) -> Tensor:
        """Drawn ``tensors`` gathered; a :attr:`Prepared.ragged` minibatch's shorter entries
        padded at the end with :data:`~radbo.problem.PAD_INDEX` (the cohort was grouped
        with padding, :func:`stack_key`) to the longest, or to ``pad_to`` where that is
        longer."""
        if self.stacked and key in self.prepared[0].ragged:
            longest = max(max(t.shape[-1] for t in tensors), pad_to or 0)
            if any(t.shape[-1] != longest for t in tensors):
                if dim == tensors[0].ndim - 1:  # clients just before the ragged axis
                    return padded_stack(tensors, longest)
                tensors = [
                    t
                    if t.shape[-1] == longest
                    else torch.nn.functional.pad(t, (0, longest - t.shape[-1]), value=PAD_INDEX)
                    for t in tensors
                ]
        return self._gather(tensors, dim)

    def sizes(self, *keys: str) -> list[int]:
        """Each client's length of minibatch ``keys`` (summed over them), unpadded
        (:meth:`Prepared.size`): the examples its work read, for ``samples`` counts."""
        return [sum(p.size(k) for k in keys) for p in self.prepared]

    def step_samples(self, *keys: str) -> list[int]:
        """Each client's examples over its local steps: its :attr:`num_steps` times the
        per-step minibatch lengths ``keys`` of :attr:`Prepared.steps` (0 without steps)."""
        return [
            p.num_steps * sum(p.size(k) for k in keys) if p.num_steps else 0 for p in self.prepared
        ]

    def param(self, name: str) -> Tensor:
        """Received tensor ``name`` (stacked over clients when stacked)."""
        return self._gather([t.params[name] for t in self.tasks])

    def params(self, names: Sequence[str], *, clone: bool = False) -> Params:
        """Received tensors ``names``, detached (cloned when ``clone``: safe to write to)."""
        out = {}
        for n in names:
            t = self.param(n).detach()
            out[n] = t.clone() if clone and not self.stacked else t
        return out

    def has(self, name: str) -> bool:
        return name in self.tasks[0].params

    def data(self, key: str, pad_to: int | None = None) -> Tensor:
        """A once-drawn tensor of :attr:`Prepared.data` (a ragged minibatch padded; with
        ``pad_to``, of a stacked cohort, to that length at least: see :meth:`steps_block`)."""
        return self._draws(key, [p.data[key] for p in self.prepared], pad_to=pad_to)

    @property
    def num_steps(self) -> list[int]:
        return [p.num_steps for p in self.prepared]

    @property
    def max_steps(self) -> int:
        return max(self.num_steps)

    def step_data(self, key: str, step: int) -> Tensor:
        """The per-step tensor ``key`` at ``step`` (clients past their last step see their last
        entry again; :meth:`local_steps` masks what they compute)."""
        whole = self._all_steps.get(key)
        if whole is None and self.stacked:
            per_client = [p.steps[key] for p in self.prepared]
            if len({t.shape[0] for t in per_client}) == 1:
                whole = self._all_steps[key] = self._draws(key, per_client, dim=1)
        if whole is not None:
            return whole[min(step, whole.shape[0] - 1)]
        entries = []
        for p in self.prepared:
            t = p.steps[key]
            entries.append(t[min(step, t.shape[0] - 1)])
        return self._draws(key, entries)

    def steps_block(self, key: str, pad_to: int | None = None) -> Tensor:
        """The per-step tensor ``key`` of every step, ``[steps, clients, ...]``, of a stacked
        cohort whose clients run at least one step each, up to the largest count (clients
        past their last step see their last entry again, as :meth:`step_data` gives it;
        :meth:`local_steps` masks what they compute); ``pad_to``: a :attr:`Prepared.ragged`
        minibatch padded at the end with :data:`~radbo.problem.PAD_INDEX` to this length, so
        that cohorts whose longest minibatch differs share one shape."""
        if not self.stacked or min(self.num_steps) < 1:
            raise ValueError("Cohort.steps_block needs a stacked cohort of clients that step")
        per_client = [p.steps[key] for p in self.prepared]
        longest = max(t.shape[0] for t in per_client)
        per_client = [
            t
            if t.shape[0] == longest
            else torch.cat([t, t[-1:].expand(longest - len(t), *t.shape[1:])])
            for t in per_client
        ]
        return self._draws(key, per_client, dim=1, pad_to=pad_to)

    def replays(self, runtime: ClientRuntime) -> bool:
        """Whether this cohort's local steps replay from the runtime's CUDA graphs
        (:meth:`run_steps`): the runtime has :attr:`~ClientRuntime.graphs` (``[runtime]
        cuda_graphs``), the cohort is stacked and each of its clients steps."""
        return runtime.graphs is not None and self.stacked and min(self.num_steps) >= 1

    def run_steps(
        self,
        runtime: ClientRuntime,
        key: Hashable,
        state: tuple[Any, ...],
        draws: Sequence[tuple[str, int]],
        run: StepsRun,
    ) -> LocalSteps[Any]:
        """The cohort's local steps ``run(state, step_data, steps, counts)`` from ``state``
        (trees of tensors with the clients first), step ``t`` on ``step_data(name, t)``, the
        example indices of per-step key ``name`` (one of ``draws``' names) at that step.

        Eagerly that is ``run(state, self.step_data, self.num_steps, None)``. Where the
        cohort :meth:`replays`, it goes through ``runtime.graphs``
        (:class:`radbo.graphs.PhaseGraphs`: captured once per key and shapes, replayed after):
        ``step_data`` reads the steps' minibatches stacked on the training set's device (where
        the runtime :attr:`~ClientRuntime.pads`, padded to the size given beside each name in
        ``draws``, so that every cohort of a shape shares a capture), ``steps`` is the
        largest step count and ``counts`` each client's count on the device (``None`` where
        all are equal), by which ``run`` masks each client past its own. ``run`` must read
        nothing else that changes between rounds unless ``key`` names it (the capture
        replays its first call's kernels); the carry's tensors come back cut to the cohort's
        clients, and each client's work is its count times the work of one step (every step
        of a local loop does the same work: checked)."""
        if not self.replays(runtime):
            return run(state, self.step_data, self.num_steps, None)
        assert runtime.graphs is not None  # replays() saw to it
        device = runtime.features.device
        blocks = {  # [clients, steps, batch] each
            name: self.steps_block(name, size if runtime.pads else None).transpose(0, 1).to(device)
            for name, size in draws
        }
        steps = self.num_steps
        # each client's count, read on the device only (an input: one capture serves any
        # counts of a shape; its presence is part of the inputs' structure)
        counts = (torch.tensor(steps, device=device),) if len(set(steps)) > 1 else ()
        longest, n = max(steps), len(state)

        def phase(inputs: tuple[Any, ...]) -> Any:
            state, blocks, counts = inputs[:n], inputs[n], inputs[n + 1 :]

            def step_data(name: str, t: int) -> Tensor:
                return blocks[name][:, t]

            done = run(state, step_data, longest, counts[0] if counts else None)
            # with counts every client ran (and was counted for) all ``longest`` steps
            grads, left_grad = divmod(done.n_grad[0], longest)
            hvps, left_hvp = divmod(done.n_hvp[0], longest)
            if left_grad or left_hvp or len(set(done.n_grad)) > 1 or len(set(done.n_hvp)) > 1:
                raise ValueError(
                    f"Cohort.run_steps: the steps' work ({done.n_grad}, {done.n_hvp}) is not "
                    f"the same in each of {longest} steps"
                )
            return done.carry, grads, hvps

        carry, grads, hvps = runtime.graphs.run(key, phase, (*state, blocks, *counts), self.size)
        return LocalSteps(carry, [grads * c for c in steps], [hvps * c for c in steps])

    def active(self, step: int) -> Tensor | None:
        """Which clients still run ``step`` (a bool per client), or ``None`` when all do (what
        :meth:`local_steps` masks by)."""
        flags = [step < n for n in self.num_steps]
        if all(flags):
            return None
        return torch.tensor(flags)

    def local_steps(
        self,
        step: Callable[[int, Carry], tuple[Carry, Work]],
        carry: Carry,
        *,
        name: str,
        uniform: bool = True,
        reverse: bool = False,
    ) -> LocalSteps[Carry]:
        """Each client's local steps (:attr:`num_steps`) of ``carry, work = step(t, carry)``,
        for the whole cohort at once: a client past its last step keeps its carry, each step is
        a repeated block for the FLOP meter (``name``; ``uniform = False``: steps whose products
        differ), and the work is counted per client. See :func:`radbo.loops.local_steps`."""
        return local_steps(step, carry, self.num_steps, name=name, uniform=uniform, reverse=reverse)

    # -- losses
    def loss(
        self,
        fn: Callable[..., Tensor],
        module: nn.Module,
        x: Params,
        y: Params,
        buffers: Params,
        batch: Batch,
    ) -> Tensor:
        """``fn(module, x, y, buffers, batch)`` (a problem's ``inner_loss`` or ``outer_loss``)
        per client: a scalar for one client, ``torch.vmap`` over the stacked clients (one value
        each) otherwise. BatchNorm running statistics in ``buffers`` are updated in place."""
        if not self.stacked:
            return fn(module, x, y, buffers, batch)

        def one(x_: Params, y_: Params, b_: Params, inputs: Tensor, targets: Tensor) -> Tensor:
            return fn(module, x_, y_, b_, Batch(inputs, targets))

        return torch.vmap(one)(x, y, buffers, batch.inputs, batch.targets)

    def bind(
        self,
        problem: BilevelProblem,
        module: nn.Module,
        buffers: Params,
        inner_batch: Batch,
        outer_batch: Batch,
    ) -> tuple[Callable[[Params, Params], Tensor], Callable[[Params, Params], Tensor]]:
        """``(outer(x, y), inner(x, y))`` closed over module, batches and a private copy of
        ``buffers`` (so that a hypergradient's many evaluations do not move BatchNorm
        statistics), evaluated per client as :meth:`loss` does."""
        return bind_losses(problem, module, buffers, inner_batch, outer_batch, call=self.loss)

    # -- outputs
    def numbers(self, value: Tensor | float | int | Sequence[float]) -> list[float]:
        """A per-client scalar (a number, a 0-dim tensor, a ``[C]`` tensor or a list) as one
        Python number per client."""
        if isinstance(value, Tensor):
            if value.ndim == 0:
                return [value.item()] * self.size
            if value.ndim == 1:  # one read (on a GPU, one host synchronisation) for all
                return value.detach().cpu().tolist()
            return [v.item() for v in value.detach().cpu()]
        if isinstance(value, Sequence):
            return list(value)
        return [value] * self.size

    def unstack(self, tensors: Params) -> list[Params]:
        """Per-client dicts of stacked ``tensors`` (the dict itself for one client)."""
        if not self.stacked:
            return [dict(tensors)]
        return [{k: t[c] for k, t in tensors.items()} for c in range(self.size)]

    def replies(
        self,
        update: Params,
        metrics: Mapping[str, Tensor | float | Sequence[float]] | None = None,
        *,
        received: Sequence[str] | None = None,
        **counts: Tensor | int | Sequence[int],
    ) -> list[ClientResult]:
        """One :class:`ClientResult` per client: its slice of ``update``, its ``metrics`` and
        work ``counts`` (``n_grad``, ``n_hvp``, ``samples``; numbers or one per client), and
        the bytes that crossed the wire: the received tensors named ``received`` down (default:
        all of them) and the update up."""
        metric_values = {k: self.numbers(v) for k, v in (metrics or {}).items()}
        count_values = {k: [int(c) for c in self.numbers(v)] for k, v in counts.items()}
        out = []
        for c, (task, part) in enumerate(zip(self.tasks, self.unstack(update), strict=True)):
            down = task.params if received is None else {n: task.params[n] for n in received}
            out.append(
                ClientResult(
                    client=task.client,
                    update=part,
                    cost=CostRecord(
                        bytes_down=tensor_bytes(down),
                        bytes_up=tensor_bytes(part),
                        **{k: v[c] for k, v in count_values.items()},
                    ),
                    metrics={k: float(v[c]) for k, v in metric_values.items()},
                    slot=task.slot,
                )
            )
        return out


@dataclass(frozen=True)
class ClientWork:
    """A phase's client work: ``prepare`` draws, ``run`` computes (see the module docstring).

    Calling it runs one client: ``work(runtime, task) -> ClientResult``.

    ``update_keys(task) -> names`` (optional) is the exact set of update keys of a client's
    result to ``task``: a backend that receives replies from elsewhere (Flower) rejects a
    reply with any other key set before the server function sees it.
    """

    run: Callable[[ClientRuntime, Cohort], list[ClientResult]]
    prepare: Callable[[ClientRuntime, ClientTask], Prepared] = no_draws
    update_keys: Callable[[ClientTask], Collection[str]] | None = None

    def __call__(self, runtime: ClientRuntime, task: ClientTask) -> ClientResult:
        (result,) = self.run(runtime, Cohort.single(task, self.prepare(runtime, task)))
        return result


def reply(
    task: ClientTask,
    update: Params,
    metrics: Mapping[str, float] | None = None,
    *,
    received: Params | None = None,
    **counts: int,
) -> ClientResult:
    """A client's result for ``task``: ``update``, its work ``counts`` (``n_grad``, ``n_hvp``,
    ``samples``) and the bytes that crossed the wire: ``received`` down (default: all of
    ``task.params``) and ``update`` up."""
    down = task.params if received is None else received
    return ClientResult(
        client=task.client,
        update=update,
        cost=CostRecord(bytes_down=tensor_bytes(down), bytes_up=tensor_bytes(update), **counts),
        metrics=dict(metrics or {}),
        slot=task.slot,
    )


def mean_metric(results: Sequence[ClientResult], key: str) -> float:
    """Mean of one scalar client metric over a phase's results (NaN when there are none)."""
    return sum(r.metrics[key] for r in results) / len(results) if results else float("nan")


def run_measured(
    work: Callable[[ClientRuntime, ClientTask], ClientResult],
    runtime: ClientRuntime,
    meter: FlopMeter | None,
    task: ClientTask,
    result: ClientResult | None = None,
) -> ClientResult:
    """Run one client's work (or take its ``result`` computed elsewhere, e.g. in a batched
    cohort) and attach its FLOPs, measured by ``meter`` (:meth:`~radbo.cost.FlopMeter.measure`:
    cached per workload, composed along CG iterations, the first of a kind counted while it
    runs), so every backend charges what the client alone would execute.

    A :class:`ClientWork` is run as ``run(prepare(task))``, which is what calling it does; its
    FLOPs are those of ``run`` (the draws of ``prepare`` are random indices, no arithmetic).
    What this function tells the meter:

    * the workload -- (phase, submodel shapes, gradient count, samples, local steps) and the
      Hessian-vector count its FLOPs are affine in (a CG iteration is one more product of the
      same shapes; :func:`~radbo.loops.cg_iteration_flops` reads that product's FLOPs from a
      count): FLOPs of these models are linear in the batch, so equal counts on equal shapes
      mean equal work;
    * the family -- phase, submodel shapes, local steps and, for a :class:`ClientWork` run
      here, the shapes of its draws (so that a client drawing smaller batches is a kind of its
      own, counted while it runs).
    """
    if meter is None:
        return work(runtime, task) if result is None else result
    shapes = shape_signature(task.params)
    one = _OneClient(work, runtime, task)
    family: tuple = (task.phase, shapes, task.budget.local_steps)
    if result is None and isinstance(work, ClientWork):
        # the draws (random indices, made before any arithmetic) tell this client's batch
        # sizes; its work is run (and counted) on these draws
        prepared = one.draws()
        family = (*family, repr(prepared.signature()), prepared.num_steps)

    def workload(out: ClientResult) -> tuple[tuple, int]:
        c = out.cost
        return (task.phase, shapes, c.n_grad, c.samples, task.budget.local_steps), c.n_hvp

    out, flops = meter.measure(one, family, workload, result=result, unit=cg_iteration_flops)
    return replace(out, cost=replace(out.cost, flops=flops))


@dataclass
class _OneClient:
    """One client's work as :func:`run_measured` hands it to the meter: runnable as often as
    the meter asks, on the same draws (made once, from the task's own generator)."""

    work: Callable[[ClientRuntime, ClientTask], ClientResult]
    runtime: ClientRuntime
    task: ClientTask
    prepared: Prepared | None = None

    def draws(self) -> Prepared:
        """The draws of a :class:`ClientWork` for the task, made on the first call."""
        assert isinstance(self.work, ClientWork)
        if self.prepared is None:
            self.prepared = self.work.prepare(self.runtime, self.task)
        return self.prepared

    def __call__(self) -> ClientResult:
        if not isinstance(self.work, ClientWork):
            return self.work(self.runtime, self.task)
        (out,) = self.work.run(self.runtime, Cohort.single(self.task, self.draws()))
        return out


# ------------------------------------------------------------------ algorithms and backends
@dataclass(frozen=True)
class Phase(Generic[State]):
    """One communication round trip of an algorithm.

    ``broadcast(state, index_set, slot) -> params`` builds what the server sends one client (in
    submodel coordinates); ``client`` is the client's local work (a :class:`ClientWork`, or any
    ``(runtime, task) -> ClientResult`` callable, which backends run one client at a time);
    ``server(state, results, index_sets, weights) -> (state, metrics)`` aggregates.

    By default every client sampled for the round (and still in it) takes part, in sampled
    order. ``select(state, candidates, generator) -> clients`` instead picks the participants
    of this phase from those candidates, in slot order: FedMBO samples afresh for every
    communication round, FedMSA sends its local phase to one client. The engine passes each
    participant's position as ``slot`` to ``broadcast`` and in ``ClientTask.slot``, and sets
    ``ClientResult.slot``, so that a server can match results to per-slot state (FedMBO's
    Hessian-inverse chains) even when some results are missing. A phase whose ``select``
    returns no client is skipped: nothing is sent, the server function is not called and it
    does not count as a communication round.
    """

    name: str
    broadcast: Callable[[State, IndexSet, int], Params]
    client: Callable[[ClientRuntime, ClientTask], ClientResult]
    server: Callable[
        [State, Sequence[ClientResult], Sequence[IndexSet], Sequence[float]],
        tuple[State, dict[str, float]],
    ]
    select: Callable[[State, Sequence[int], torch.Generator], Sequence[int]] | None = None
    #: ``broadcast_many(state, index_sets, slots) -> [params]``: optional, what ``broadcast``
    #: sends each of many clients, built at once (the engine then calls it instead; it must
    #: equal ``[broadcast(state, s, slot) ...]``): :func:`~radbo.masks.index.extract_many`
    #: gathers every client's submodel in a few operations per tensor
    broadcast_many: Callable[[State, Sequence[IndexSet], Sequence[int]], list[Params]] | None = None


class Algorithm(Protocol[State]):
    """A federated bilevel algorithm: initial state, phases, and the full model state."""

    name: str

    def init(self, x: Params, y: Params, buffers: Params) -> State: ...

    def phases(self) -> Sequence[Phase[State]]: ...

    def model_state(self, state: State) -> Params: ...


class Backend(Protocol):
    """Runs a phase's client work for a list of tasks, returning results in task order, each
    with its FLOPs measured by ``meter`` (:func:`run_measured`)."""

    def run(
        self,
        work: Callable[[ClientRuntime, ClientTask], ClientResult],
        runtime: ClientRuntime,
        meter: FlopMeter | None,
        tasks: Sequence[ClientTask],
    ) -> list[ClientResult]: ...


class MaskAssigner(Protocol):
    """Chooses each sampled client's submodel (index sets in full-model coordinates)."""

    def prepare(
        self,
        model_state: Params,
        round: int,
        clients: Sequence[int],
        budgets: Sequence[ClientBudget],
    ) -> None: ...

    def assign(
        self, budget: ClientBudget, client: int, round: int, generator: torch.Generator
    ) -> IndexSet: ...


def stack_key(task: ClientTask, prepared: Prepared, pad: bool = False) -> Hashable:
    """What two tasks must share to run as one stacked cohort: phase, index-set shapes, the
    received tensors' shapes and dtypes, and the draws' signature (with ``pad``, ragged
    minibatches of any length: :attr:`Prepared.ragged`)."""
    received = tuple((n, tuple(t.shape), t.dtype) for n, t in sorted(task.params.items()))
    return (task.phase, _shape_key(task.index_set), received, prepared.signature(pad))
