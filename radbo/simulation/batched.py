"""Batched simulation: clients whose workloads have the same shape are trained together.

:class:`BatchedBackend` implements the engine's :class:`~radbo.simulation.engine.Backend`
protocol. The engine hands it ``functools.partial(run_measured, client_fn, runtime, meter)``;
the backend looks up a batched implementation of ``client_fn`` in a registry keyed by the
function underneath the bound method (``RABO.client_inner``, not one instance's method), so
algorithms need no change. Each implementation says which tasks can share one computation
(:meth:`BatchedImpl.group_key`, ``None`` for "run this one sequentially") and runs a group at
once (:meth:`BatchedImpl.run`). Tasks without an implementation, and functions that are not
the engine's measured client functions, go through the sequential path unchanged.

Registered here: RABO's inner phase (``RABO.client_inner``, T SGD steps on y) for models
without buffers, e.g. the MLP. Per client it draws the minibatches exactly as
``client_inner`` does (the task's generator, same call order), then runs the T steps of the
whole group with ``torch.func.vmap(torch.func.grad_and_value(...))`` over stacked y, x and
inputs, calling the problem's own ``inner_loss`` (``functional_call`` on the shared submodel
skeleton). FLOPs are attached by :func:`~radbo.simulation.engine.run_measured` itself, which
re-runs the *sequential* client function under the FLOP counter for workloads not seen yet,
so the ledger's ``CostRecord`` s are the sequential ones.

**Equality.** Counts, bytes, FLOPs and the ledger are exactly those of the sequential path.
On CPU float32 the states, updates and metrics are bitwise equal too (``tests/test_batched.py``
asserts ``torch.equal``): vmap's batched matmuls gave the same gradients and iterates. The one
value vmap changed is the forward value of cross-entropy's batch mean (reduced in another
order), so the reported ``inner_loss`` is recomputed per client exactly as ``client_inner``
computes it (one extra forward per client). Bitwise equality of batched kernels is what this
torch build does, not a guarantee of torch: the tests would catch a change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radbo.cost import shape_signature
from radbo.problem import Batch, sample_batch
from radbo.simulation.engine import (
    ClientResult,
    ClientRuntime,
    ClientTask,
    reply,
    run_measured,
)


class BatchedImpl(Protocol):
    """A batched implementation of one client function (``owner`` is the algorithm the
    client function is bound to, e.g. the ``RABO`` instance)."""

    def group_key(self, owner: Any, runtime: ClientRuntime, task: ClientTask) -> Hashable | None:
        """Tasks with equal keys run in one batched computation; ``None``: run sequentially."""
        ...

    def run(
        self, owner: Any, runtime: ClientRuntime, tasks: Sequence[ClientTask]
    ) -> list[ClientResult]:
        """Results (without FLOPs) of ``tasks``, which share one group key, in task order."""
        ...


_REGISTRY: dict[Callable[..., Any], BatchedImpl] = {}


def register_batched(function: Callable[..., Any], impl: BatchedImpl) -> None:
    """Register ``impl`` for the client function ``function`` (the plain function, e.g.
    ``RABO.client_inner``; every bound method of it is then batched)."""
    _REGISTRY[function] = impl


def batched_impl(client_fn: Callable[..., Any]) -> BatchedImpl | None:
    """The implementation registered for a (bound) client function, if any."""
    _register_defaults()
    return _REGISTRY.get(getattr(client_fn, "__func__", client_fn))


def _replay(
    client_fn: Callable[[ClientRuntime, ClientTask], ClientResult],
    runtime: ClientRuntime,
    meter: Any,
    task: ClientTask,
    result: ClientResult,
) -> ClientResult:
    """``run_measured`` on a result computed elsewhere: its first call of the client function
    returns ``result``, any later call (the FLOP meter's measurement) runs the real one."""
    pending = [result]

    def replay(rt: ClientRuntime, t: ClientTask) -> ClientResult:
        return pending.pop() if pending else client_fn(rt, t)

    return run_measured(replay, runtime, meter, task)


@dataclass
class BatchedBackend:
    """Runs groups of same-shape client workloads as one batched computation.

    Args:
        min_group: groups smaller than this run sequentially (default 1: every group batched).
        max_group: largest batch; bigger groups are split in chunks (``None``: no limit).
    """

    min_group: int = 1
    max_group: int | None = None

    def map(
        self, fn: Callable[[ClientTask], ClientResult], tasks: Sequence[ClientTask]
    ) -> list[ClientResult]:
        unpacked = _unpack(fn)
        impl = None if unpacked is None else batched_impl(unpacked[0])
        if unpacked is None or impl is None:
            return [fn(task) for task in tasks]
        client_fn, runtime, meter = unpacked
        owner = getattr(client_fn, "__self__", None)
        groups: dict[Hashable, list[int]] = {}
        alone: list[int] = []
        for i, task in enumerate(tasks):
            key = impl.group_key(owner, runtime, task)
            if key is None:
                alone.append(i)
            else:
                groups.setdefault(key, []).append(i)
        results: list[ClientResult | None] = [None] * len(tasks)
        for members in groups.values():
            if len(members) < self.min_group:
                alone += members
                continue
            size = self.max_group or len(members)
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                batch = [tasks[i] for i in chunk]
                for i, r in zip(chunk, impl.run(owner, runtime, batch), strict=True):
                    results[i] = _replay(client_fn, runtime, meter, tasks[i], r)
        for i in alone:
            results[i] = fn(tasks[i])
        return [r for r in results if r is not None]


def _unpack(fn: Callable[..., Any]) -> tuple[Callable[..., Any], ClientRuntime, Any] | None:
    """``(client_fn, runtime, meter)`` of the engine's ``partial(run_measured, ...)``."""
    if (
        isinstance(fn, functools.partial)
        and fn.func is run_measured
        and len(fn.args) == 3
        and not fn.keywords
    ):
        client_fn, runtime, meter = fn.args
        return client_fn, runtime, meter
    return None


# -- RABO's inner phase --------------------------------------------------------------------


class RABOInnerBatched:
    """``RABO.client_inner`` for a group: T SGD steps on y under ``vmap`` (no buffers)."""

    def group_key(self, algo: Any, runtime: ClientRuntime, task: ClientTask) -> Hashable | None:
        if algo is None or algo.buffer_names:
            return None
        steps = task.budget.local_steps if algo.use_budget_steps else algo.inner_steps
        batch = min(algo.batch_size, task.data.inner.numel())
        dtypes = tuple((n, str(t.dtype), str(t.device)) for n, t in sorted(task.params.items()))
        module = runtime.module_for(task.index_set)
        return (task.phase, shape_signature(task.params), dtypes, id(module), steps, batch)

    def run(
        self, algo: Any, runtime: ClientRuntime, tasks: Sequence[ClientTask]
    ) -> list[ClientResult]:
        first = tasks[0]
        module = runtime.module_for(first.index_set)
        steps = first.budget.local_steps if algo.use_budget_steps else algo.inner_steps
        # minibatches: per client, exactly the draws of client_inner (same generator and order)
        inputs, targets = [], []
        for task in tasks:
            gen = task.generator()
            drawn = [
                sample_batch(
                    runtime.features, runtime.labels, task.data.inner, algo.batch_size, gen
                )
                for _ in range(steps)
            ]
            inputs.append(torch.stack([b.inputs for b in drawn]))
            targets.append(torch.stack([b.targets for b in drawn]))
        xs = torch.stack(inputs, dim=1)  # [T, C, B, ...]
        ts = torch.stack(targets, dim=1)  # [T, C, B]
        x = {n: torch.stack([t.params[n].detach() for t in tasks]) for n in algo.outer_names}
        y = {n: torch.stack([t.params[n].detach() for t in tasks]) for n in algo.inner_names}
        problem = runtime.problem

        def loss(y_: dict, x_: dict, inputs_: torch.Tensor, targets_: torch.Tensor):
            return problem.inner_loss(module, x_, y_, {}, Batch(inputs_, targets_))

        step = torch.func.vmap(torch.func.grad_and_value(loss))
        total = {n: torch.zeros_like(t) for n, t in y.items()}
        last = y
        for s in range(steps):
            last = y
            grads, _ = step(y, x, xs[s], ts[s])
            y = {n: t - algo.inner_lr * grads[n] for n, t in y.items()}
            for n in total:
                total[n] += grads[n]
        out = []
        for c, task in enumerate(tasks):
            # the reported loss (last step's): vmap's batched cross-entropy reduces the batch
            # in another order, so recompute it per client as client_inner does (one forward)
            with torch.no_grad():
                value = problem.inner_loss(
                    module,
                    {n: t[c] for n, t in x.items()},
                    {n: t[c] for n, t in last.items()},
                    {},
                    Batch(xs[-1, c], ts[-1, c]),
                )
            update = {n: t[c].clone() for n, t in total.items()}
            out.append(
                reply(
                    task,
                    update,
                    {"inner_loss": float(value)},
                    n_grad=steps,
                    samples=steps * int(ts.shape[2]),
                )
            )
        return out


_DEFAULTS: list[bool] = []


def _register_defaults() -> None:
    """Register the built-in implementations on first use (importing the algorithms here at
    module level would make ``radbo.simulation`` and ``radbo.algorithms`` import each other)."""
    if _DEFAULTS:
        return
    from radbo.algorithms.rabo import RABO

    _REGISTRY.setdefault(RABO.client_inner, RABOInnerBatched())
    _DEFAULTS.append(True)
