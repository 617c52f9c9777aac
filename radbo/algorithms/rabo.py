"""RABO: Resource-Adaptive distributed Bilevel Optimization (Alg. 1 of ``papers/rabo_rafbo.txt``).

Each round q has two communication round trips:

1. ``train.inner`` -- every sampled client receives its submodel (x_q^i, y_q^i) (eqs. (3), (4)),
   runs T masked SGD steps on the inner loss g_i (eq. (5)) and returns the summed local
   gradient G_q^i in submodel coordinates. The server takes the parameter-wise
   coverage-weighted mean over the clients holding each coordinate (eq. (6)):
   ``y_{q+1}^k = y_q^k - beta * mean_{i in N^k} G_q^{i,k}``; coordinates nobody holds stay.
2. ``train.outer`` -- the server broadcasts y_{q+1} (each client its own slice), every client
   computes its local hypergradient on the submodel (eq. (7), with a pluggable estimator) and
   the server applies the coverage-weighted mean to x (eq. (8)).

**Sign of G.** Alg. 1 line 10 prints ``G_q^i = (y_{q,T}^i - y_{q,0}^i)/beta``; with that G,
eq. (6) would move y *up* the inner loss. radbo uses the descent direction
``G_q^i = (y_{q,0}^i - y_{q,T}^i)/beta = sum_t G_{q,t}^i``, so that with one client and a full
mask the server reproduces the client's local iterate y_{q,T}.

**Stability option.** ``max_hypergrad_norm`` clips each client's local hypergradient to that
global L2 norm before aggregation (off by default). It is an explicit addition to the paper
for strongly non-iid data with small local validation sets.

BatchNorm running statistics (buffers) are returned by the clients after the inner phase and
averaged coordinate-wise over the clients holding them, like parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from radbo.aggregation import (
    apply_mean,
    apply_step,
    coverage_weighted_mean,
    global_norm,
    project_ball,
    step_inner,
)
from radbo.hypergrad import HypergradEstimator, ImplicitCG, init_state
from radbo.masks.index import alias, extract
from radbo.problem import bind_losses, sample_batch
from radbo.simulation.engine import (
    ClientResult,
    ClientRuntime,
    ClientTask,
    Phase,
    mean_metric,
    reply,
)
from radbo.typing import IndexSet, Params


@dataclass(frozen=True)
class RABOState:
    """Global state of RABO: outer x, inner y and buffers in full-model coordinates, plus the
    hypergradient estimator's state (``aux``, keyed ``"key:name"``, y-shaped: e.g. the first-
    order estimator's y_lambda and z), aggregated coordinate-wise like y."""

    x: Params
    y: Params
    buffers: Params
    round: int = 0
    aux: Params = field(default_factory=dict)


@dataclass(frozen=True)
class RABO:
    """RABO (Alg. 1, eqs. (3)-(8) of ``papers/rabo_rafbo.txt``) with a pluggable estimator.

    Args:
        inner_lr: beta, the inner step size (local SGD and server step on y, eq. (6)).
        outer_lr: alpha, the outer step size (eq. (8)).
        inner_steps: T, local inner SGD steps per round (a client's ``budget.local_steps``
            overrides it when ``use_budget_steps`` is true).
        batch_size: minibatch size of the inner loss.
        outer_batch_size: minibatch size of the outer loss in the hypergradient.
        estimator: local hypergradient estimator (default: exact implicit, CG with 10 steps).
        max_hypergrad_norm: optional per-client clipping of the hypergradient (off: ``None``).
        outer_names / inner_names: which model tensors are x and y.
        buffer_names: non-trainable model tensors (BatchNorm running statistics).
        aggregate_buffers: clients send their BatchNorm running statistics and the server
            averages them coordinate-wise (default); ``False`` is static BN: clients normalise
            with batch statistics only and the server recomputes the statistics on a
            calibration set before evaluating (HeteroFL's sBN).
    """

    outer_names: tuple[str, ...]
    inner_names: tuple[str, ...]
    buffer_names: tuple[str, ...] = ()
    inner_lr: float = 0.1
    outer_lr: float = 0.1
    inner_steps: int = 5
    batch_size: int = 32
    outer_batch_size: int = 32
    estimator: HypergradEstimator = ImplicitCG(max_iter=10)
    max_hypergrad_norm: float | None = None
    use_budget_steps: bool = False
    aggregate_buffers: bool = True
    name: str = "rabo"

    def __post_init__(self) -> None:
        for field_name in ("inner_lr", "outer_lr"):
            value = getattr(self, field_name)
            if not value > 0:
                raise ValueError(f"RABO.{field_name} must be > 0, got {value}")
        for field_name in ("inner_steps", "batch_size", "outer_batch_size"):
            value = getattr(self, field_name)
            if value < 1:
                raise ValueError(f"RABO.{field_name} must be >= 1, got {value}")
        if self.max_hypergrad_norm is not None and not self.max_hypergrad_norm > 0:
            raise ValueError(
                f"RABO.max_hypergrad_norm must be > 0 or None, got {self.max_hypergrad_norm}"
            )
        if set(self.outer_names) & set(self.inner_names):
            raise ValueError("outer and inner parameter names must be disjoint")

    # -- state ---------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> RABOState:
        """Initial state from full-model tensors (cloned, detached)."""
        clone = lambda d: {k: v.detach().clone() for k, v in d.items()}  # noqa: E731
        aux = init_state(self.estimator, y)
        return RABOState(x=clone(x), y=clone(y), buffers=clone(buffers), aux=aux)

    def model_state(self, state: RABOState) -> Params:
        """All model tensors (x, y and buffers) in full-model coordinates."""
        return {**state.x, **state.y, **state.buffers}

    def phases(self) -> Sequence[Phase[RABOState]]:
        return (
            Phase("train.inner", self.broadcast_inner, self.client_inner, self.server_inner),
            Phase("train.outer", self.broadcast_outer, self.client_outer, self.server_outer),
        )

    # -- phase 1: inner update of y (Alg. 1 lines 3-20) -----------------------------------
    def broadcast_inner(self, state: RABOState, index_set: IndexSet, slot: int = 0) -> Params:
        """Submodel (x_q^i, y_{q,0}^i) and buffers for one client (eqs. (3), (4))."""
        return extract(self.model_state(state), index_set)

    def client_inner(self, runtime: ClientRuntime, task: ClientTask) -> ClientResult:
        """T local SGD steps on g_i over y (eq. (5)); returns G = sum_t G_t and buffers."""
        gen = task.generator()
        module = runtime.module_for(task.index_set)
        x = {n: task.params[n].detach() for n in self.outer_names}
        y = {n: task.params[n].detach().clone() for n in self.inner_names}
        buffers = {n: task.params[n].detach().clone() for n in self.buffer_names}
        total = {n: torch.zeros_like(t) for n, t in y.items()}
        steps = task.budget.local_steps if self.use_budget_steps else self.inner_steps
        loss_value = float("nan")
        samples = 0
        for _ in range(steps):
            batch = sample_batch(
                runtime.features, runtime.labels, task.data.inner, self.batch_size, gen
            )
            y_var = {n: t.requires_grad_(True) for n, t in y.items()}
            loss = runtime.problem.inner_loss(module, x, y_var, buffers, batch)
            grads = torch.autograd.grad(loss, list(y_var.values()))
            y = {}
            for (n, t), g in zip(y_var.items(), grads, strict=True):
                y[n] = (t - self.inner_lr * g).detach()
                total[n] += g
            loss_value = float(loss.detach())
            samples += batch.targets.numel()
        update = {**total, **(buffers if self.aggregate_buffers else {})}
        return reply(task, update, {"inner_loss": loss_value}, n_grad=steps, samples=samples)

    def server_inner(
        self,
        state: RABOState,
        results: Sequence[ClientResult],
        index_sets: Sequence[IndexSet],
        weights: Sequence[float],
    ) -> tuple[RABOState, dict[str, float]]:
        """Coverage-weighted step on y (eq. (6)) and coverage-weighted mean of buffers."""
        y, buffers = step_inner(
            state.y,
            state.buffers,
            [r.update for r in results],
            index_sets,
            weights,
            self.inner_lr,
            with_buffers=self.aggregate_buffers,
        )
        metrics = {"inner_loss": mean_metric(results, "inner_loss")}
        return replace(state, y=y, buffers=buffers), metrics

    # -- phase 2: hypergradient and outer update of x (Alg. 1 lines 21-33) ---------------
    def _aux_index(self, index_set: IndexSet) -> IndexSet:
        keys = getattr(self.estimator, "state_keys", ())
        return {k: v for key in keys for k, v in alias(index_set, key, self.inner_names).items()}

    def broadcast_outer(self, state: RABOState, index_set: IndexSet, slot: int = 0) -> Params:
        """The updated y_{q+1}^i (with the client's x_q^i, buffers and estimator state)."""
        return extract(
            {**self.model_state(state), **state.aux}, {**index_set, **self._aux_index(index_set)}
        )

    def client_outer(self, runtime: ClientRuntime, task: ClientTask) -> ClientResult:
        """Local hypergradient on the submodel (eq. (7)) with the configured estimator."""
        gen = task.generator()
        module = runtime.module_for(task.index_set)
        x = {n: task.params[n] for n in self.outer_names}
        y = {n: task.params[n] for n in self.inner_names}
        buffers = {n: task.params[n] for n in self.buffer_names}
        inner_batch = sample_batch(
            runtime.features, runtime.labels, task.data.inner, self.batch_size, gen
        )
        outer_batch = sample_batch(
            runtime.features, runtime.labels, task.data.outer, self.outer_batch_size, gen
        )
        outer, inner = bind_losses(runtime.problem, module, buffers, inner_batch, outer_batch)
        aux = {k: task.params[k] for k in self._aux_index(task.index_set)}
        result = self.estimator(outer, inner, x, y, generator=gen, state=aux or None)
        grad = result.grad
        norm = global_norm(grad)
        if self.max_hypergrad_norm is not None:
            grad = project_ball(grad, self.max_hypergrad_norm)  # clipping = projection
        with torch.no_grad():
            outer_value = float(outer(x, y))
        # x and buffers are already on the client from the inner phase
        sent = {n: task.params[n] for n in (*self.inner_names, *aux)}
        update = {**grad, **result.state}
        return reply(
            task,
            update,
            {"outer_loss": outer_value, "hypergrad_norm": norm},
            received=sent,
            n_grad=result.n_grad,
            n_hvp=result.n_hvp,
            samples=inner_batch.targets.numel() + outer_batch.targets.numel(),
        )

    def server_outer(
        self,
        state: RABOState,
        results: Sequence[ClientResult],
        index_sets: Sequence[IndexSet],
        weights: Sequence[float],
    ) -> tuple[RABOState, dict[str, float]]:
        """Coverage-weighted step on x (eq. (8))."""
        shapes = {n: state.x[n].shape for n in self.outer_names}
        updates = [r.update for r in results]
        agg = coverage_weighted_mean(updates, index_sets, shapes, weights)
        x = apply_step(state.x, agg, self.outer_lr)
        aux = state.aux
        if aux:
            aux_sets = [self._aux_index(idx) for idx in index_sets]
            aux_shapes = {k: t.shape for k, t in aux.items()}
            aux = apply_mean(aux, coverage_weighted_mean(updates, aux_sets, aux_shapes, weights))
        metrics = {"outer_loss": mean_metric(results, "outer_loss")}
        return replace(state, x=x, aux=aux, round=state.round + 1), metrics
