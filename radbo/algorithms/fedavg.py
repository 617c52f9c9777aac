"""Single-level submodel federated learning: FedAvg, HeteroFL ("Static") and FedRolex.

Papers: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (FedAvg), AISTATS 2017, arXiv:1602.05629; Diao et al., "HeteroFL: Computation and
Communication Efficient Federated Learning for Heterogeneous Clients", ICLR 2021,
arXiv:2010.01264 (leading-channel submodels and static BatchNorm: the "Static" row of the RABO
paper's Table II); Alam et al., "FedRolex: Model-Heterogeneous Federated Learning with Rolling
Sub-Model Extraction", NeurIPS 2022, arXiv:2212.01548 (a window of channels rolling with the
round).

The baselines the RABO paper compares its submodel training with (``papers/rabo_rafbo.txt``,
Sec. V-A): no bilevel structure at all. Each sampled client receives its submodel of the whole
model (x and y together), runs ``local_steps`` SGD steps on the task's training loss with
respect to every parameter, and returns the summed gradients in submodel coordinates; the server
averages each coordinate over the clients that hold it and steps with the same ``lr``:

    w_s <- w_s - lr * mean_{i in N_s} G_{i,s},   G_i = sum_t grad L_i(w_i,t) = (w_i,0 - w_i,T) / lr

which is HeteroFL's / FedRolex's coordinate-wise average of the clients' models (every holder of
a coordinate starts the round from the same value). The mask policy makes the method:
``[mask] policy = "leading"`` with ``[model] batchnorm = "static"`` is HeteroFL, ``"rolling"``
is FedRolex, ``"fiarse"`` is FIARSE's submodel extraction (Wu et al., NeurIPS 2024,
arXiv:2407.19389; its masked local step is not reproduced, see
:class:`~radbo.masks.policies.FiarsePolicy`), ``"oap"`` is radbo's reading of the RABO paper's
OAP (:class:`~radbo.masks.policies.OAPPolicy`), ``"none"`` is plain FedAvg.

Each local step trains on one inner and one outer minibatch of the client together (all of its
data: single-level training has no validation split); on a few-shot task that is one episode's
support and query sets, with the episode's N-way loss, so the backbone and the head are trained
jointly on the client's classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from radbo.aggregation import apply_step, average_buffers, coverage_weighted_mean
from radbo.algorithms.base import ALGORITHMS, AlgorithmBase, AlgorithmConfig, Wiring, clone
from radbo.autodiff import scalar
from radbo.client import (
    ClientResult,
    ClientRuntime,
    ClientTask,
    ClientWork,
    Cohort,
    Phase,
    Prepared,
    mean_metric,
)
from radbo.limits import BatchSize, Steps, StepSize
from radbo.loops import LocalSteps, Work, local_steps
from radbo.masks.index import extract, extract_many
from radbo.typing import IndexSet, Params

__all__ = ["FedAvg", "FedAvgConfig", "FedAvgState"]


@dataclass(frozen=True)
class FedAvgState:
    """Global model: x, y and buffers in full-model coordinates."""

    x: Params
    y: Params
    buffers: Params
    round: int = 0


@ALGORITHMS.register
class FedAvgConfig(AlgorithmConfig):
    """FedAvg / HeteroFL / FedRolex hyperparameters (single-level; see the module docstring)."""

    name: Literal["fedavg"]
    lr: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="local and server step (<= 1000 without --force)",
    )
    local_steps: Steps = Field(
        5, ge=1, description="local SGD steps per round (<= 10,000 without --force)"
    )
    batch_size: BatchSize = Field(32, ge=1, description="inner minibatch per step")
    outer_batch_size: BatchSize = Field(32, ge=1, description="outer minibatch per step")

    flower_actions: ClassVar[tuple[str, ...]] = ()
    step_sizes: ClassVar[tuple[str, ...]] = ("lr",)

    @property
    def local_steps_default(self) -> int:
        return self.local_steps

    def baseline_settings(self) -> dict[str, Any]:
        return {
            "inner_lr": self.lr,
            "outer_lr": self.lr,
            "inner_steps": self.local_steps,
            "batch_size": self.batch_size,
            "outer_batch_size": self.outer_batch_size,
            "weighting": self.weighting,
            "max_hypergrad_norm": None,
            **self.divergence_settings(),
        }

    def build(self, wiring: Wiring) -> FedAvg:
        return self.bind(FedAvg, wiring, use_budget_steps=wiring.budget_steps)


class FedAvg(FedAvgConfig, AlgorithmBase):
    """FedAvg on masked submodels (HeteroFL with leading masks, FedRolex with rolling ones).

    Args (besides :class:`FedAvgConfig`'s hyperparameters):
        outer_names / inner_names / buffer_names: the model's tensors (trained alike here).
        use_budget_steps: each client runs its budget's local steps instead of ``local_steps``.
        aggregate_buffers: average BatchNorm statistics, or static BN (HeteroFL's sBN).
    """

    name: Literal["fedavg"] = "fedavg"
    use_budget_steps: bool = False

    def init(self, x: Params, y: Params, buffers: Params) -> FedAvgState:
        return FedAvgState(x=clone(x), y=clone(y), buffers=clone(buffers))

    def phases(self) -> Sequence[Phase[FedAvgState]]:
        keys = self.reply_keys(self.trained_names(), buffers=True)
        work = ClientWork(self.run_client, self.prepare_client, keys)
        return (
            Phase("train", self.broadcast, work, self.server, broadcast_many=self.broadcast_many),
        )

    def trained_names(self) -> tuple[str, ...]:
        """The parameters local SGD trains, the clients send and the server steps: x and y
        (a variant training fewer, ProtoNet's x alone, carries the others unchanged)."""
        return (*self.outer_names, *self.inner_names)

    def local_loss(self, problem: Any) -> Callable[..., Tensor]:
        """The loss of a local step, ``loss(module, x, y, buffers, batch)`` on the step's inner
        and outer minibatches together: the task's inner loss g."""
        loss: Callable[..., Tensor] = problem.inner_loss
        return loss

    def broadcast(self, state: FedAvgState, index_set: IndexSet, slot: int = 0) -> Params:
        """The client's submodel of x, y and buffers."""
        return extract(self.model_state(state), index_set)

    def broadcast_many(
        self, state: FedAvgState, index_sets: Sequence[IndexSet], slots: Sequence[int]
    ) -> list[Params]:
        """:meth:`broadcast` for every client at once (:func:`extract_many`)."""
        return extract_many(self.model_state(state), index_sets)

    def prepare_client(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """An inner and an outer minibatch (one episode on a few-shot task) per local step."""
        gen = task.generator()
        steps = task.budget.local_steps if self.use_budget_steps else self.local_steps
        inner, outer = runtime.sampler.pair_steps(
            task.data, self.batch_size, self.outer_batch_size, steps, gen
        )
        batches = torch.cat([inner, outer], dim=1)
        return Prepared(steps={"batch": batches}, num_steps=steps, ragged=frozenset({"batch"}))

    def run_client(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """Local SGD on the trained parameters (:meth:`trained_names`); returns their summed
        gradients and the buffers.

        A stacked cohort replays its steps from a CUDA graph where the runtime has
        :attr:`~radbo.client.ClientRuntime.graphs` (``[runtime] cuda_graphs``): the steps as
        one pure function of the trained and fixed parameters, buffers and the steps'
        minibatches on the device (:meth:`~radbo.client.Cohort.run_steps`); clients with
        unequal step counts run the largest count, each masked past its own by the counts on
        the device."""
        module = cohort.module(runtime)
        names = self.trained_names()
        params = cohort.params(names, clone=True)
        fixed = cohort.params([n for n in (*self.outer_names, *self.inner_names) if n not in names])
        buffers = cohort.params(self.buffer_names, clone=True)

        def run(state: Any, step_data: Any, steps: Any, counts: Any) -> LocalSteps[Any]:
            params, fixed, buffers = state
            if cohort.replays(runtime):  # the capture's own inputs: the steps set requires_grad
                params = {n: t.clone() for n, t in params.items()}  # and update them in place
            minibatch = partial(step_data, "batch")
            return self._local_steps(
                runtime, cohort, module, params, fixed, buffers, minibatch, steps, counts
            )

        # a frozen algorithm (lr, the trained names, the loss it picks from the runtime's
        # problem) and the module skeleton: the capture's key
        key = ("fedavg.step", id(self), id(module))
        width = self.batch_size + self.outer_batch_size  # an inner and an outer minibatch
        done = cohort.run_steps(runtime, key, (params, fixed, buffers), [("batch", width)], run)
        _, total, buffers, loss_value = done.carry
        n_grad = done.n_grad
        update = {**total, **(buffers if self.aggregate_buffers else {})}
        return cohort.replies(
            update,
            {"train_loss": loss_value},
            n_grad=n_grad,
            samples=cohort.step_samples("batch"),
        )

    def _local_steps(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        params: Params,
        fixed: Params,
        buffers: Params,
        minibatch: Callable[[int], Tensor],
        steps: int | list[int],
        counts: Tensor | None = None,
    ) -> LocalSteps[Any]:
        """``steps`` local SGD steps from ``params`` (each client its number of steps; or
        ``steps`` times, each client masked past its entry of ``counts``, a tensor on the
        device), step t on the example indices ``minibatch(t)``; the carry ends as ``(params,
        summed gradients, buffers, loss)``. ``params`` are updated in place: the caller's own
        copy."""
        loss_fn = self.local_loss(runtime.problem)
        total = {n: torch.zeros_like(t) for n, t in params.items()}
        Carry = tuple[Params, Params, Params, Any]  # params, summed gradients, buffers, loss

        def step(t: int, carry: Carry) -> tuple[Carry, Work]:
            params, total, buffers, _ = carry
            batch = runtime.batch(minibatch(t))
            var = {n: p.requires_grad_(True) for n, p in params.items()}
            every = {**fixed, **var}
            x = {n: every[n] for n in self.outer_names}
            y = {n: every[n] for n in self.inner_names}
            # updates the BatchNorm running statistics in ``buffers`` in place
            loss = cohort.loss(loss_fn, module, x, y, buffers, batch)
            grads = dict(
                zip(
                    var,
                    torch.autograd.grad(scalar("loss", loss, cohort.lead), list(var.values())),
                    strict=True,
                )
            )
            # in place (the carry is this client's own copy, radbo.loops.local_steps): the same
            # operations as ``total + g`` and ``p - lr * g``, so the same bits, without
            # allocating two new copies of every parameter per step (16 % of a sequential
            # round and 50 % of a batched one on pfl's CIFAR-10 CNN, BENCHMARKS.md)
            with torch.no_grad():
                for n, p in var.items():
                    total[n].add_(grads[n])
                    p.sub_(grads[n].mul_(self.lr))
            stepped = {n: p.detach() for n, p in var.items()}  # views: the carry needs no grad
            return (stepped, total, buffers, loss.detach()), Work(n_grad=1)

        start = (params, total, buffers, float("nan"))
        return local_steps(step, start, steps, name="fedavg.step", counts=counts)

    def server(
        self,
        state: FedAvgState,
        results: Sequence[ClientResult],
        index_sets: Sequence[IndexSet],
        weights: Sequence[float],
    ) -> tuple[FedAvgState, dict[str, float]]:
        """Coverage-weighted step on every trained parameter with ``lr`` (the coordinate-wise
        average of the clients' models); buffers averaged, or left to static BN."""
        trained = set(self.trained_names())
        shapes = {n: t.shape for n, t in {**state.x, **state.y}.items() if n in trained}
        updates = [r.update for r in results]
        agg = coverage_weighted_mean(updates, index_sets, shapes, weights)
        x = apply_step(state.x, agg, self.lr)
        y = apply_step(state.y, agg, self.lr)
        buffers = state.buffers
        if self.aggregate_buffers:
            buffers = average_buffers(buffers, updates, index_sets, weights)
        metrics = {"train_loss": mean_metric(results, "train_loss")}
        return replace(state, x=x, y=y, buffers=buffers, round=state.round + 1), metrics
