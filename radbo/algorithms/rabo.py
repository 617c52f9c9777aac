"""RABO: Resource-Adaptive distributed Bilevel Optimization (Alg. 1 of the RABO paper).

Paper: Li, Zhang, Zheng, Shi, Yuan, Cheng and Yu, "Distributed Bilevel Optimization with Dual
Pruning for Resource-limited Clients" (RABO / RAFBO; ``papers/rabo_rafbo.txt``).

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

**Refit option (radbo's addition).** ``refit_steps = S > 0``: before eq. (7) each client
takes S SGD steps of size ``inner_lr`` on the inner loss of the outer phase's own inner
minibatch, from the received ``y_{q+1}^i`` with ``x_q^i`` fixed, and evaluates the local
hypergradient (and the reported ``outer_loss``) at that ``y``; the refitted ``y`` stays on
the client. Eq. (7) is the derivative of ``f(x, y*(x))`` only at ``y = y*(x)``: away from it
the implicit term ``−∇²_xy g · [∇²_yy g]⁻¹ ∇_y f`` (which then carries the large ``∇_y f``
through an inverse Hessian whose smallest eigenvalue is the inner L2 weight) rewards x for
making the current ``y`` worse. On few-shot Omniglot with masks the server's ``y_{q+1}``, a
coverage average of sub-heads trained for other feature subsets, is far from every client's
own optimum: the default run's outer loss climbs from 1.6 to 3-9 in 30 rounds and the
backbone does not learn, while with ``S = 100`` the outer loss falls and meta-test accuracy
rises (``BENCHMARKS.md``, "RABO on Omniglot"). Each step costs one gradient of g in y
(counted in ``n_grad`` and in the FLOP meter); a zoo model computes its backbone once for all
S steps (:meth:`radbo.models.BilevelModel.reusing_body`), so on Conv-4 S = 100 adds about 7 %
to RABO's FLOPs. Default ``0``: Alg. 1 as printed.

**RAFBO** (Alg. 2) is RABO with the finite-difference estimator: its own kind,
:class:`RAFBOConfig` (``name = "rafbo"``), whose only estimator is ``[estimator] name =
"finite_difference"`` (its default); :class:`RAFBO` refuses any other.

BatchNorm running statistics (buffers) are returned by the clients after the inner phase and
averaged coordinate-wise over the clients holding them, like parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.aggregation import apply_mean, apply_step, coverage_weighted_mean, step_inner
from radbo.algorithms.base import (
    ALGORITHMS,
    AlgorithmBase,
    AlgorithmConfig,
    Wiring,
    clone,
    prefixed,
)
from radbo.autodiff import params_norm, project_ball, scalar
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
from radbo.hypergrad import Estimator, FiniteDifference, ImplicitCG, init_state
from radbo.limits import BatchSize, Steps, StepSize
from radbo.loops import LocalSteps, Work, local_steps
from radbo.masks.index import alias, extract, extract_many
from radbo.typing import IndexSet, Params

__all__ = ["RABO", "RAFBO", "RABOConfig", "RABOState", "RAFBOConfig"]


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


@ALGORITHMS.register
class RABOConfig(AlgorithmConfig):
    """RABO hyperparameters (Alg. 1 of the RABO paper)."""

    name: Literal["rabo"] = "rabo"
    inner_lr: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="beta, inner step size (<= 1000 without --force)",
    )
    outer_lr: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="alpha, outer step size (<= 1000 without --force)",
    )
    inner_steps: Steps = Field(
        5, ge=1, description="T, local inner SGD steps per round (<= 10,000 without --force)"
    )
    batch_size: BatchSize = Field(32, ge=1, description="minibatch of the inner loss")
    outer_batch_size: BatchSize = Field(32, ge=1, description="minibatch of the outer loss")
    max_hypergrad_norm: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="clip each client's hypergradient (off)"
    )
    refit_steps: Steps = Field(
        0,
        ge=0,
        description="SGD steps on the outer phase's inner minibatch before eq. (7) (0: the paper)",
    )

    estimator_uses: ClassVar[tuple[str, ...]] = ("hypergradient",)
    default_estimator: ClassVar[str | None] = "cg"
    flower_actions: ClassVar[tuple[str, ...]] = ("inner", "outer")

    @property
    def local_steps_default(self) -> int:
        return self.inner_steps

    def build(self, wiring: Wiring) -> RABO:
        return self.bind(RABO, wiring, use_budget_steps=wiring.budget_steps)


class RABO(RABOConfig, AlgorithmBase):
    """RABO (Alg. 1, eqs. (3)-(8) of ``papers/rabo_rafbo.txt``) with a pluggable estimator.

    Args (besides the hyperparameters of :class:`RABOConfig`):
        estimator: local hypergradient estimator (default: exact implicit, CG with 10 steps).
        outer_names / inner_names: which model tensors are x and y.
        buffer_names: non-trainable model tensors (BatchNorm running statistics).
        use_budget_steps: each client runs its budget's local steps instead of T.
        aggregate_buffers: clients send their BatchNorm running statistics and the server
            averages them coordinate-wise (default); ``False`` is static BN: clients normalise
            with batch statistics only and the server recomputes the statistics on a
            calibration set before evaluating (HeteroFL's sBN).
    """

    estimator: Estimator = Field(default_factory=ImplicitCG)
    use_budget_steps: bool = False

    # -- state ---------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> RABOState:
        """Initial state from full-model tensors (cloned, detached)."""
        aux = init_state(self.estimator, y)
        return RABOState(x=clone(x), y=clone(y), buffers=clone(buffers), aux=aux)

    def phases(self) -> Sequence[Phase[RABOState]]:
        return (
            Phase(
                "train.inner",
                self.broadcast_inner,
                ClientWork(
                    self.run_inner,
                    self.prepare_inner,
                    self.reply_keys(self.inner_names, buffers=True),
                ),
                self.server_inner,
                broadcast_many=self.broadcast_inner_many,
            ),
            Phase(
                "train.outer",
                self.broadcast_outer,
                ClientWork(
                    self.run_outer,
                    self.prepare_outer,
                    self.reply_keys(
                        self.outer_names,
                        *(prefixed(k, self.inner_names) for k in self.estimator.state_keys),
                    ),
                ),
                self.server_outer,
                broadcast_many=self.broadcast_outer_many,
            ),
        )

    # -- phase 1: inner update of y (Alg. 1 lines 3-20) -----------------------------------
    def broadcast_inner(self, state: RABOState, index_set: IndexSet, slot: int = 0) -> Params:
        """Submodel (x_q^i, y_{q,0}^i) and buffers for one client (eqs. (3), (4))."""
        return extract(self.model_state(state), index_set)

    def broadcast_inner_many(
        self, state: RABOState, index_sets: Sequence[IndexSet], slots: Sequence[int]
    ) -> list[Params]:
        """:meth:`broadcast_inner` for every client at once (:func:`extract_many`)."""
        return extract_many(self.model_state(state), index_sets)

    def prepare_inner(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """The minibatch of each of the client's T local steps."""
        gen = task.generator()
        steps = task.budget.local_steps if self.use_budget_steps else self.inner_steps
        batches = runtime.sampler.inner_steps(task.data, self.batch_size, steps, gen)
        return Prepared(steps={"inner": batches}, num_steps=steps, ragged=frozenset({"inner"}))

    def run_inner(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """T local SGD steps on g_i over y (eq. (5)); returns G = sum_t G_t and buffers.

        A stacked cohort replays its phase from a CUDA graph where the runtime has
        :attr:`~radbo.client.ClientRuntime.graphs` (``[runtime] cuda_graphs``): the steps as
        one pure function of x, y, buffers and the steps' minibatches on the device
        (:meth:`~radbo.client.Cohort.run_steps`); clients with unequal step counts run the
        largest count, each masked past its own by the counts on the device (as the eager
        loop masks them)."""
        module = cohort.module(runtime)
        x = cohort.params(self.outer_names)
        y = cohort.params(self.inner_names, clone=True)
        buffers = cohort.params(self.buffer_names, clone=True)

        def run(state: Any, step_data: Any, steps: Any, counts: Any) -> LocalSteps[Any]:
            x, y, buffers = state
            if cohort.replays(runtime):  # the capture's own inputs: the steps set requires_grad
                y = {n: t.clone() for n, t in y.items()}
            minibatch = partial(step_data, "inner")
            return self._inner_steps(
                runtime, cohort, module, x, y, buffers, minibatch, steps, counts
            )

        # a frozen algorithm (inner_lr) and the module skeleton: the capture's key
        key = ("rabo.inner", id(self), id(module))
        draws = [("inner", self.batch_size)]
        done = cohort.run_steps(runtime, key, (x, y, buffers), draws, run)
        _, total, buffers, loss_value = done.carry
        n_grad = done.n_grad
        update = {**total, **(buffers if self.aggregate_buffers else {})}
        samples = cohort.step_samples("inner")
        return cohort.replies(update, {"inner_loss": loss_value}, n_grad=n_grad, samples=samples)

    def _inner_steps(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        x: Params,
        y: Params,
        buffers: Params,
        minibatch: Callable[[int], torch.Tensor],
        steps: int | list[int],
        counts: torch.Tensor | None = None,
    ) -> LocalSteps[Any]:
        """Eq. (5) ``steps`` times from ``y`` (each client its number of steps; or ``steps``
        times, each client masked past its entry of ``counts``, a tensor on the device), step
        t on the example indices ``minibatch(t)``; the carry ends as ``(y, G, buffers,
        loss)``."""
        total = {n: torch.zeros_like(t) for n, t in y.items()}
        Carry = tuple[Params, Params, Params, Any]  # y, summed gradients G, buffers, loss

        def step(t: int, carry: Carry) -> tuple[Carry, Work]:
            y, total, buffers, _ = carry
            batch = runtime.batch(minibatch(t))
            y_var = {n: p.requires_grad_(True) for n, p in y.items()}
            # updates the BatchNorm running statistics in ``buffers`` in place
            loss = cohort.loss(runtime.problem.inner_loss, module, x, y_var, buffers, batch)
            grads = torch.autograd.grad(
                scalar("inner_loss", loss, cohort.lead), list(y_var.values())
            )
            stepped = {
                n: (p - self.inner_lr * g).detach()
                for (n, p), g in zip(y_var.items(), grads, strict=True)
            }
            total = {n: s + g for (n, s), g in zip(total.items(), grads, strict=True)}
            return (stepped, total, buffers, loss.detach()), Work(n_grad=1)

        # every step does the same work (on a slice of the stacked minibatches)
        start = (y, total, buffers, float("nan"))
        return local_steps(step, start, steps, name="rabo.inner", counts=counts)

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
        keys = self.estimator.state_keys
        return {k: v for key in keys for k, v in alias(index_set, key, self.inner_names).items()}

    def broadcast_outer(self, state: RABOState, index_set: IndexSet, slot: int = 0) -> Params:
        """The updated y_{q+1}^i (with the client's x_q^i, buffers and estimator state)."""
        return extract(
            {**self.model_state(state), **state.aux}, {**index_set, **self._aux_index(index_set)}
        )

    def broadcast_outer_many(
        self, state: RABOState, index_sets: Sequence[IndexSet], slots: Sequence[int]
    ) -> list[Params]:
        """:meth:`broadcast_outer` for every client at once (:func:`extract_many`)."""
        return extract_many(
            {**self.model_state(state), **state.aux},
            [{**index_set, **self._aux_index(index_set)} for index_set in index_sets],
        )

    def prepare_outer(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """The inner and outer minibatches, then the estimator's own draws."""
        gen = task.generator()
        inner, outer = runtime.sampler.pair(task.data, self.batch_size, self.outer_batch_size, gen)
        data = {"inner": inner, "outer": outer}
        x = {n: task.params[n] for n in self.outer_names}
        data.update({f"estimator:{k}": t for k, t in self.estimator.draw(gen, x).items()})
        return Prepared(data=data, ragged=frozenset({"inner", "outer"}))

    def run_outer(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """Local hypergradient on the submodel (eq. (7)) with the configured estimator.

        Where the runtime has :attr:`~radbo.client.ClientRuntime.graphs`, a stacked cohort
        replays the phase (:meth:`_outer_phase`) from a CUDA graph, as the inner phase does."""
        module = cohort.module(runtime)
        x = cohort.params(self.outer_names)
        y = cohort.params(self.inner_names)
        buffers = cohort.params(self.buffer_names)
        aux_names = list(self._aux_index(cohort.index_set))
        aux = cohort.params(aux_names)
        prefix = "estimator:"
        keys = [k for k in cohort.prepared[0].data if k.startswith(prefix)]
        phase = self._outer_phase(runtime, cohort, module)
        if runtime.graphs is not None and cohort.stacked:
            device = next(iter(y.values())).device
            inner_idx = cohort.data("inner", self.batch_size if runtime.pads else None)
            outer_idx = cohort.data("outer", self.outer_batch_size if runtime.pads else None)
            draws = {k[len(prefix) :]: cohort.data(k).to(device) for k in keys}
            inputs = (x, y, buffers, inner_idx.to(device), outer_idx.to(device), aux, draws)
            key = ("rabo.outer", id(self), id(module))
            out = runtime.graphs.run(key, phase, inputs, cohort.size)
        else:
            inner_idx, outer_idx = cohort.data("inner"), cohort.data("outer")
            draws = {k[len(prefix) :]: cohort.data(k) for k in keys}
            out = phase((x, y, buffers, inner_idx, outer_idx, aux, draws))
        grad, state, norm, outer_value, n_grad, n_hvp = out
        update = {**grad, **state}
        samples = cohort.sizes("inner", "outer")
        # x is already on the client from the inner phase; so are the buffers unless the
        # inner phase re-averaged them (then the client needs the server's new ones)
        fresh = list(self.buffer_names) if self.aggregate_buffers else []
        return cohort.replies(
            update,
            {"outer_loss": outer_value, "hypergrad_norm": norm},
            received=[*self.inner_names, *fresh, *aux_names],
            n_grad=n_grad,
            n_hvp=n_hvp,
            samples=samples,
        )

    def _outer_phase(
        self, runtime: ClientRuntime, cohort: Cohort, module: nn.Module
    ) -> Callable[[Any], Any]:
        """The outer phase as a pure function of ``(x, y, buffers, inner minibatch, outer
        minibatch, estimator state, estimator draws)`` returning ``(hypergradient, estimator
        state, its norm before clipping, outer loss, n_grad, n_hvp)``: what
        :class:`radbo.graphs.PhaseGraphs` captures for a stacked cohort (the estimator, the
        refit and the clipping are this algorithm's settings, in its key). Inside a capture,
        CG runs its full iteration count with converged clients masked
        (:func:`radbo.autodiff.solve_cg`): the same values."""
        lead = cohort.lead

        def phase(inputs: Any) -> Any:
            x, y, buffers, inner_idx, outer_idx, aux, draws = inputs
            outer, inner = cohort.bind(
                runtime.problem, module, buffers, runtime.batch(inner_idx), runtime.batch(outer_idx)
            )
            if self.refit_steps:
                y = self._refit(module, inner, x, y, lead)
            result = self.estimator(outer, inner, x, y, state=aux or None, draws=draws, lead=lead)
            grad = result.grad
            norm = params_norm(grad, lead)
            if self.max_hypergrad_norm is not None:
                grad = project_ball(grad, self.max_hypergrad_norm, lead)  # clipping = projection
            with torch.no_grad():
                outer_value = outer(x, y)
            n_grad = result.n_grad + self.refit_steps
            return grad, result.state, norm, outer_value, n_grad, result.n_hvp

        return phase

    def _refit(
        self,
        module: nn.Module,
        inner: Callable[[Params, Params], Tensor],
        x: Params,
        y: Params,
        lead: int,
    ) -> Params:
        """``refit_steps`` SGD steps of size ``inner_lr`` on ``inner`` over y from the received
        y, x held fixed (see the module docstring); every client of a cohort steps on its own
        loss. A zoo model computes its body (the x part of the forward pass) once for all the
        steps (:meth:`radbo.models.BilevelModel.reusing_body`): bitwise the same steps."""
        fixed = {n: t.detach() for n, t in x.items()}

        def step(y: Params) -> Params:
            y_var = {n: t.detach().requires_grad_(True) for n, t in y.items()}
            loss = scalar("inner_loss", inner(fixed, y_var), lead)
            grads = torch.autograd.grad(loss, list(y_var.values()))
            return {
                n: (t - self.inner_lr * g).detach()
                for (n, t), g in zip(y_var.items(), grads, strict=True)
            }

        reusing = getattr(module, "reusing_body", None)
        with reusing() if reusing is not None else nullcontext():
            y = step(y)  # the first step computes the body, the others reuse it
            return local_steps(
                lambda t, y: (step(y), Work(n_grad=1)), y, self.refit_steps - 1, name="rabo.refit"
            ).carry

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


@ALGORITHMS.register
class RAFBOConfig(RABOConfig):
    """RAFBO hyperparameters (Alg. 2 of the RABO paper): RABO's, with the finite-difference
    estimator as its only one."""

    # its own tag: RABO's narrowed to a kind of its own, which the type checker calls unsafe
    name: Literal["rafbo"] = "rafbo"  # type: ignore[assignment]

    default_estimator: ClassVar[str | None] = "finite_difference"
    estimators: ClassVar[tuple[str, ...] | None] = ("finite_difference",)

    def build(self, wiring: Wiring) -> RAFBO:
        return self.bind(RAFBO, wiring, use_budget_steps=wiring.budget_steps)


class RAFBO(RAFBOConfig, RABO):
    """RAFBO (Alg. 2 of ``papers/rabo_rafbo.txt``): RABO whose local hypergradient is the
    finite-difference estimator (default :class:`~radbo.hypergrad.FiniteDifference`; any other
    is refused)."""

    estimator: Estimator = Field(default_factory=FiniteDifference)
