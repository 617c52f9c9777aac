"""Bilevel problems: per-client inner loss g_i and outer loss f_i over parameter dicts.

A problem is evaluated functionally on a module whose parameters are split into outer
variables x and inner variables y (see :class:`radbo.models.BilevelModel`): through the
module's own functional form (``functional_forward``, the zoo's models) where it has one, else
``torch.func.functional_call`` (see :func:`forward`). The module may be the full model or a
physically smaller submodel: only tensor shapes must match.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call

from radbo._torch_private import carries_vmap_dim
from radbo.typing import BilevelLoss, Params


@dataclass(frozen=True)
class Batch:
    """One minibatch: model inputs and integer class targets."""

    inputs: Tensor
    targets: Tensor


#: The index a stacked cohort pads a shorter minibatch with (see :class:`radbo.client.Cohort`).
PAD_INDEX = -1
#: The target of a padded example: ``F.cross_entropy``'s default ``ignore_index``, so a mean
#: cross-entropy over a padded minibatch is the mean over its real examples.
PAD_TARGET = -100


def nll_loss(log_probs: Tensor, targets: Tensor, ignore_index: int = PAD_TARGET) -> Tensor:
    """``F.nll_loss(log_probs, targets, ignore_index=ignore_index)``: the mean of
    ``-log_probs[n, targets[n]]`` over the examples whose target is not ``ignore_index``
    (``[N, C]`` log-probabilities, ``[N]`` integer targets).

    Inside ``torch.vmap`` -- a stacked cohort's loss (:class:`radbo.client.Cohort`) --
    PyTorch has no batching rule for ``nll_loss_forward`` with per-client targets and runs its
    Python decomposition (``torch._decomp.decompositions.nll_loss_forward``) through two
    wrappers at every call. This runs that decomposition's operations directly, in its order
    (gather, negate, mask the ignored examples, sum, divide by their count): the same values,
    gradients and second derivatives, bit for bit (``tests/test_losses.py``), without the
    wrappers and repeated comparisons (BENCHMARKS.md, "Cross-entropy of a stacked cohort").
    Elsewhere, and for other shapes, it is ``F.nll_loss``, whose kernel sums in its own
    order."""
    if log_probs.ndim != 2 or targets.ndim != 1 or not carries_vmap_dim(log_probs, targets):
        return torch.nn.functional.nll_loss(log_probs, targets, ignore_index=ignore_index)
    return _stacked_nll_loss(log_probs, targets, ignore_index)


def _stacked_nll_loss(log_probs: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """:func:`nll_loss`'s path inside ``torch.vmap`` (its shapes and vmap already checked)."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0)
    picked = -torch.gather(log_probs, 1, safe.unsqueeze(1)).squeeze(1)
    picked = torch.where(valid, picked, 0)
    return picked.sum() / valid.sum().to(picked)


def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = PAD_TARGET) -> Tensor:
    """``F.cross_entropy(logits, targets, ignore_index=ignore_index)`` for ``[N, C]`` logits
    and ``[N]`` integer class targets: :func:`nll_loss` of ``log_softmax(logits, 1)``, as
    PyTorch composes it (bitwise the same inside ``torch.vmap``; ``F.cross_entropy`` itself
    elsewhere)."""
    if logits.ndim != 2 or targets.ndim != 1 or not carries_vmap_dim(logits, targets):
        return torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index)
    return _stacked_nll_loss(torch.log_softmax(logits, 1), targets, ignore_index)


@dataclass(frozen=True)
class ClientData:
    """Indices of one client's samples in the training set.

    ``inner`` feeds the inner loss g_i (training split), ``outer`` the outer loss f_i
    (validation split), as in the hyper-representation setups of the papers.
    """

    inner: Tensor
    outer: Tensor

    def __post_init__(self) -> None:
        if self.inner.numel() == 0 or self.outer.numel() == 0:
            raise ValueError(
                f"a client needs at least one inner and one outer sample, got "
                f"{self.inner.numel()} inner and {self.outer.numel()} outer"
            )


def draw_indices(indices: Tensor, batch_size: int, generator: torch.Generator) -> Tensor:
    """``min(batch_size, len(indices))`` of ``indices`` drawn without replacement."""
    n = indices.numel()
    pick = torch.randperm(n, generator=generator)[: min(batch_size, n)]
    # the elements of indices[pick], with less dispatch work per call (one call per client
    # and local step)
    return indices.index_select(0, pick.to(indices.device))


def draw_steps(
    sources: Sequence[tuple[Tensor, int]], steps: int, generator: torch.Generator
) -> list[Tensor]:
    """What ``steps`` rounds of :func:`draw_indices` over ``sources`` draw -- in each step, for
    each ``(indices, batch_size)`` in turn, ``min(batch_size, len(indices))`` of ``indices``
    without replacement -- from the same generator in the same order, as one
    ``[steps, min(batch_size, len(indices))]`` tensor per source.

    The permutations are drawn one by one (they are the generator's stream), then stacked and
    gathered once per source: a client's minibatches for T steps take T + 2 operations and one
    view per source instead of 2T operations and T views (and, with the data on a GPU, one
    copy of the picks instead of T).

    >>> g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    >>> data = torch.arange(10, 20)
    >>> (many,) = draw_steps([(data, 4)], 3, g1)
    >>> torch.equal(many, torch.stack([draw_indices(data, 4, g2) for _ in range(3)]))
    True
    """
    perms: list[list[Tensor]] = [[] for _ in sources]
    for _ in range(steps):
        for drawn, (indices, _) in zip(perms, sources, strict=True):
            drawn.append(torch.randperm(indices.numel(), generator=generator))
    out = []
    for drawn, (indices, size) in zip(perms, sources, strict=True):
        k = min(size, indices.numel())
        if not drawn:  # no steps
            out.append(indices.new_empty((0, k)))
            continue
        picks = torch.stack(drawn)[:, :k].to(indices.device)  # [steps, k]: each step's first k
        out.append(torch.take(indices, picks))  # indices[picks], of the picks' shape
    return out


class Sampler(Protocol):
    """Which examples a client's minibatches hold. Client work draws every minibatch through
    the runtime's sampler with the task's generator, so that a task can change what a batch is
    (an episode of a few-shot task) without touching any algorithm.

    * ``inner(data, size, generator)`` -- a minibatch for the inner loss g;
    * ``outer(data, size, generator)`` -- a minibatch for the outer loss f;
    * ``pair(data, inner_size, outer_size, generator)`` -- an inner and an outer minibatch that
      belong together (one episode's support and query sets);
    * ``inner_steps`` / ``outer_steps`` / ``pair_steps`` (the same arguments and ``steps``) --
      the minibatches of ``steps`` local steps at once, stacked on a leading dimension: exactly
      what ``steps`` calls of ``inner`` / ``outer`` / ``pair`` return, drawn from the generator
      in the same order, in fewer operations where the sampler can (:func:`draw_steps`).
    """

    def inner(self, data: ClientData, size: int, generator: torch.Generator) -> Tensor: ...

    def outer(self, data: ClientData, size: int, generator: torch.Generator) -> Tensor: ...

    def pair(
        self, data: ClientData, inner_size: int, outer_size: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]: ...

    def inner_steps(
        self, data: ClientData, size: int, steps: int, gen: torch.Generator
    ) -> Tensor: ...

    def outer_steps(
        self, data: ClientData, size: int, steps: int, gen: torch.Generator
    ) -> Tensor: ...

    def pair_steps(
        self, data: ClientData, inner_size: int, outer_size: int, steps: int, gen: torch.Generator
    ) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class MinibatchSampler:
    """Minibatches drawn uniformly without replacement from the client's inner (training)
    and outer (validation) examples; a pair is an inner draw followed by an outer one."""

    def inner(self, data: ClientData, size: int, generator: torch.Generator) -> Tensor:
        return draw_indices(data.inner, size, generator)

    def outer(self, data: ClientData, size: int, generator: torch.Generator) -> Tensor:
        return draw_indices(data.outer, size, generator)

    def pair(
        self, data: ClientData, inner_size: int, outer_size: int, generator: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        first = draw_indices(data.inner, inner_size, generator)
        return first, draw_indices(data.outer, outer_size, generator)

    def inner_steps(self, data: ClientData, size: int, steps: int, gen: torch.Generator) -> Tensor:
        return draw_steps([(data.inner, size)], steps, gen)[0]

    def outer_steps(self, data: ClientData, size: int, steps: int, gen: torch.Generator) -> Tensor:
        return draw_steps([(data.outer, size)], steps, gen)[0]

    def pair_steps(
        self, data: ClientData, inner_size: int, outer_size: int, steps: int, gen: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        inner, outer = draw_steps([(data.inner, inner_size), (data.outer, outer_size)], steps, gen)
        return inner, outer


def sample_batch(
    features: Tensor, labels: Tensor, indices: Tensor, batch_size: int, generator: torch.Generator
) -> Batch:
    """Draw ``min(batch_size, len(indices))`` samples without replacement using ``generator``."""
    chosen = draw_indices(indices, batch_size, generator)
    return Batch(features[chosen], labels[chosen])


class BilevelProblem(Protocol):
    """Per-client losses of a bilevel problem.

    ``inner_loss`` is g_i(x, y; batch) (strongly convex in y where the theory needs it) and
    ``outer_loss`` is f_i(x, y; batch). ``buffers`` are non-trainable tensors of the module
    (BatchNorm running statistics), updated in place in training mode.
    """

    def inner_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor: ...

    def outer_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor: ...


#: Whether :func:`forward` may use a module's ``functional_forward`` (see
#: :func:`module_calls_only`).
_functional_forms = True

#: Parameter and buffer names of each module :func:`forward` has seen (weakly held).
_names: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


@contextmanager
def module_calls_only() -> Iterator[None]:
    """Within the block, :func:`forward` always evaluates through
    ``torch.func.functional_call`` (the reference path the functional forms are checked and
    measured against); results are bitwise the same either way."""
    global _functional_forms
    before = _functional_forms
    _functional_forms = False
    try:
        yield
    finally:
        _functional_forms = before


def _state_names(module: nn.Module) -> frozenset[str]:
    names = _names.get(module)
    if names is None:
        names = frozenset(
            [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
        )
        _names[module] = names
    return names


def forward(module: nn.Module, x: Params, y: Params, buffers: Params, inputs: Tensor) -> Tensor:
    """Evaluate ``module`` with parameters ``x | y`` and ``buffers`` (functional, no mutation
    of the module; buffers are updated in place when the module is in training mode).

    A module with a ``functional_forward(state, inputs)`` (radbo's model zoo, see
    :meth:`radbo.models.BilevelModel.functional_forward`) is evaluated through it when ``x | y
    | buffers`` names exactly its parameters and buffers: bitwise the result of
    ``torch.func.functional_call``, without swapping the tensors into the module. Otherwise,
    or when it answers ``None``, through ``functional_call`` (``strict``).
    """
    state = {**x, **y, **buffers}
    if _functional_forms:
        fast = getattr(module, "functional_forward", None)
        if fast is not None and state.keys() == _state_names(module):
            out = fast(state, inputs)
            if out is not None:
                return out
    return functional_call(module, state, (inputs,), strict=True)


def l2_penalty(y: Params, weight: float) -> Tensor | float:
    """``weight/2 * ||y||^2`` over all tensors of ``y`` (0 when ``weight`` is 0): the term the
    tasks add to the inner loss to make it strongly convex in y."""
    if not weight:
        return 0.0
    return 0.5 * weight * sum((t * t).sum() for t in y.values())


#: ``call(loss_fn, module, x, y, buffers, batch)``: how a bound loss is evaluated (directly, or
#: per client of a cohort; see :meth:`radbo.client.Cohort.loss`).
LossCall = Callable[..., Tensor]


def _direct(fn: Callable[..., Tensor], *args: object) -> Tensor:
    return fn(*args)


class BoundLoss:
    """One of a problem's losses closed over module, buffers and batch: ``loss(x, y)``.

    Evaluates ``call(fn, module, x, y, scratch, batch)`` on the private buffer copy
    ``scratch`` it shares with its sibling (see :func:`bind_losses`). :meth:`at_points`
    evaluates it at several points at once.
    """

    def __init__(
        self,
        fn: Callable[..., Tensor],
        module: nn.Module,
        scratch: Params,
        batch: Batch,
        call: LossCall,
    ) -> None:
        self.fn, self.module, self.scratch, self.batch, self.call = fn, module, scratch, batch, call

    def __call__(self, x: Params, y: Params) -> Tensor:
        return self.call(self.fn, self.module, x, y, self.scratch, self.batch)

    def at_points(self, x: Params, y: Params) -> Tensor:
        """The loss at ``n`` points ``(x[j], y[j])`` at once (every tensor of x and y carries
        one more leading dim ``n``), one value per point (under ``torch.vmap``). Each point
        runs on its own copy of the buffers, and those copies are then dropped: BatchNorm
        running statistics move neither in ``scratch`` nor between points (they do not
        enter a training-mode loss)."""
        count = next(iter({**x, **y}.values())).shape[0]
        points = {k: v.expand(count, *v.shape).clone() for k, v in self.scratch.items()}

        def one(x_: Params, y_: Params, buffers: Params) -> Tensor:
            return self.call(self.fn, self.module, x_, y_, buffers, self.batch)

        return torch.vmap(one)(x, y, points)


def at_points(loss: BilevelLoss) -> BilevelLoss:
    """``(x, y) -> values``: ``loss`` at ``n`` points at once, x and y (and the values) with one
    more leading dim ``n``. A :class:`BoundLoss` (what :func:`bind_losses` returns) evaluates
    each point on its own buffers (:meth:`BoundLoss.at_points`); any other loss runs under
    ``torch.vmap`` as it is, so it must be a pure function of its inputs.

    >>> f = at_points(lambda x, y: (x["a"] * y["b"]).sum())
    >>> f({"a": torch.tensor([[1.0], [2.0]])}, {"b": torch.tensor([[3.0], [3.0]])}).tolist()
    [3.0, 6.0]
    """
    if isinstance(loss, BoundLoss):
        return loss.at_points
    return torch.vmap(loss)


def bind_losses(
    problem: BilevelProblem,
    module: nn.Module,
    buffers: Params,
    inner_batch: Batch,
    outer_batch: Batch,
    call: LossCall = _direct,
) -> tuple[BoundLoss, BoundLoss]:
    """Close the losses over module, buffers and batches: returns ``(outer(x, y), inner(x, y))``.

    The returned losses run on a private copy of ``buffers`` so that the many evaluations
    a hypergradient estimator makes do not move BatchNorm running statistics.
    """
    scratch = {k: v.clone() for k, v in buffers.items()}
    return (
        BoundLoss(problem.outer_loss, module, scratch, outer_batch, call),
        BoundLoss(problem.inner_loss, module, scratch, inner_batch, call),
    )


def split_state(state: Params, outer: set[str], inner: set[str]) -> tuple[Params, Params, Params]:
    """``(x, y, buffers)`` of a full model state; the buffers are copies (evaluation in
    training mode may update them)."""
    x = {k: v for k, v in state.items() if k in outer}
    y = {k: v for k, v in state.items() if k in inner}
    buffers = {k: v.clone() for k, v in state.items() if k not in outer and k not in inner}
    return x, y, buffers


def calibrate_batchnorm(
    module: nn.Module, x: Params, y: Params, buffers: Params, inputs: torch.Tensor
) -> Params:
    """Static BN: BatchNorm statistics of (x, y) recomputed over ``inputs`` (one pass, exact
    cumulative mean and variance via ``momentum = None``); returns the new buffers."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    fresh = {
        k: (torch.zeros_like(v) if not k.endswith("running_var") else torch.ones_like(v))
        for k, v in buffers.items()
    }
    try:
        for m in bns:
            m.momentum = None
        module.train()
        forward(module, x, y, fresh, inputs)
    finally:
        for m, momentum in zip(bns, momenta, strict=True):
            m.momentum = momentum
    return fresh
