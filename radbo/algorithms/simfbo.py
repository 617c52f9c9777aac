"""SimFBO: simple federated bilevel optimization (Alg. 1 of the SimFBO / ShroFBO paper).

Paper: Yang, Xiao and Ji, "SimFBO: Towards Simple, Flexible and Communication-efficient
Federated Bilevel Learning", NeurIPS 2023, arXiv:2305.19442 (``papers/simfbo_shrofbo.txt``).

One communication round per iteration. Each sampled client i starts from the server's
(x, y, v) and runs tau_i local steps that update the three variables *simultaneously* (eq. (3)):

    y <- y - a_k eta_y  grad_y g_i(x, y)
    v <- v - a_k eta_v  grad_v R_i(x, y, v),  grad_v R_i = H_yy g_i(x, y) v - grad_y f_i(x, y)
    x <- x - a_k eta_x  (grad_x f_i(x, y) - H_xy g_i(x, y) v)

and sends the local aggregates q_i = sum_k a_k (gradient at step k) for y, v and x (eq. (4)).
The server averages them with the client weights normalized over the sample (p~_i of eq. (4))
and steps with server step sizes, projecting v on the ball of radius r (eq. (5)):
``x <- x - gamma_x q_x``, ``v <- P_r(v - gamma_v q_v)``, ``y <- y - gamma_y q_y``.

On masked submodels the average is taken per coordinate over the clients holding it (RABO's
coverage weighting); coordinates nobody holds stay unchanged. The three directions are
:func:`radbo.autodiff.bilevel_directions`, with the Hessian- and Jacobian-vector products of
the ``[estimator]``: ``autograd`` (exact, default) or ``finite_difference`` (differences of
gradients, second-order free; only its ``hvp_mu`` matters here).

**Fully first-order mode.** With ``[estimator] name = "first_order"`` the method follows the
penalty reformulation of ``papers/fedsbo_first_order.txt`` (only its ``lam`` matters): the v
slot carries y_lam (the minimizer of f + lam g), y plays z, and the directions are the penalty
oracle :func:`radbo.autodiff.penalty_gradients` -- the same code as the ``first_order``
estimator and FedSVRBGD-FO: ``x`` follows ``∇_x f(x, y_lam) + lam (∇_x g(x, y_lam) −
∇_x g(x, y))``, ``y`` follows ``∇_y g(x, y)``, and ``v`` follows ``(∇_y f(x, y_lam) + lam
∇_y g(x, y_lam)) / (1 + lam)``, the estimator's step normalization that keeps the v-step stable
for every lam (``f + lam g`` is ``(L_f + lam L_g)``-smooth). The projection of v is off there.

Each local step draws one inner and one outer minibatch shared by the three updates (the paper
draws independent samples zeta, psi, xi; sharing halves the data passes and keeps the updates
consistent). The client coefficients a_i^(t,k) are constant (``coefficient``), so
||a_i||_1 = coefficient * tau_i.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from pydantic import Field, model_validator

from radbo.aggregation import (
    CoverageMean,
    apply_step,
    average_buffers,
    coverage_weighted_mean,
)
from radbo.algorithms.base import (
    ALGORITHMS,
    AlgorithmBase,
    AlgorithmConfig,
    Wiring,
    clone,
    prefixed,
)
from radbo.autodiff import (
    axpy,
    bilevel_directions,
    broadcast,
    penalty_gradients,
    project_ball,
)
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
from radbo.hypergrad import Autograd, Estimator
from radbo.limits import BatchSize, Steps, StepSize
from radbo.loops import LocalSteps, Work, local_steps
from radbo.masks.index import alias, extract, extract_many
from radbo.typing import IndexSet, Params

__all__ = ["V", "SimFBO", "SimFBOConfig", "SimFBOState"]

#: prefix of the v tensors (shaped like y) on the wire and in aggregation
V = "v"

_Rate = Field(gt=0, allow_inf_nan=False)


@runtime_checkable
class _Penalty(Protocol):
    """An estimator with the ``"penalty"`` capability: it holds the penalty ``lam``
    (:class:`~radbo.hypergrad.FirstOrder`)."""

    lam: float


@dataclass(frozen=True)
class SimFBOState:
    """Global state: x, y, v (keyed like y) and buffers, in full-model coordinates."""

    x: Params
    y: Params
    v: Params
    buffers: Params
    round: int = 0


@ALGORITHMS.register
class SimFBOConfig(AlgorithmConfig):
    """SimFBO hyperparameters (Alg. 1 of ``papers/simfbo_shrofbo.txt``), which ShroFBO
    (:class:`radbo.algorithms.shrofbo.ShroFBOConfig`) shares."""

    name: Literal["simfbo"] = "simfbo"
    inner_lr: StepSize = Field(
        0.05, gt=0, allow_inf_nan=False, description="eta_y (<= 1000 without --force)"
    )
    v_lr: StepSize = Field(
        0.05, gt=0, allow_inf_nan=False, description="eta_v (<= 1000 without --force)"
    )
    outer_lr: StepSize = Field(
        0.05, gt=0, allow_inf_nan=False, description="eta_x (<= 1000 without --force)"
    )
    server_lr_y: StepSize = Field(
        0.2, gt=0, allow_inf_nan=False, description="gamma_y (<= 1000 without --force)"
    )
    server_lr_v: StepSize = Field(
        0.05, gt=0, allow_inf_nan=False, description="gamma_v (<= 1000 without --force)"
    )
    server_lr_x: StepSize = Field(
        0.05, gt=0, allow_inf_nan=False, description="gamma_x (<= 1000 without --force)"
    )
    radius: float | None = Field(
        10.0, gt=0, allow_inf_nan=False, description="r of the projection on v"
    )
    coefficient: float = Field(
        1.0,
        ge=1e-6,
        le=1e6,
        allow_inf_nan=False,
        description="a_i^(t,k), in [1e-6, 1e6] (it scales q_i; ShroFBO's h_i = q_i / ||a_i||_1 "
        "cancels it): beyond, q_i under- or overflows in float32",
    )
    local_steps: Steps = Field(
        5, ge=1, description="tau when fleet.local_steps = 'fixed' (<= 10,000 without --force)"
    )
    # ShroFBO's (radbo.algorithms.shrofbo.ShroFBOConfig.rho); SimFBO never reads it. It stays
    # a field here, in the same place, so that configs written when the two were one kind
    # (rho included in every dump) still validate, dump bitwise as before and resume.
    rho: Literal["holders", "printed"] = Field(
        "holders", description="not read by SimFBO (ShroFBO's rho, kept for older configs)"
    )
    batch_size: BatchSize = Field(32, ge=1, description="inner minibatch per local step")
    outer_batch_size: BatchSize = Field(32, ge=1, description="outer minibatch per local step")

    estimator_uses: ClassVar[tuple[str, ...]] = ("products", "penalty")
    default_estimator: ClassVar[str | None] = "autograd"
    step_sizes: ClassVar[tuple[str, ...]] = (
        "inner_lr",
        "v_lr",
        "outer_lr",
        "server_lr_y",
        "server_lr_v",
        "server_lr_x",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_settings(cls, data: Any) -> Any:
        if isinstance(data, dict):
            moved = [k for k in ("products", "fd_mu", "penalty") if k in data]
            if moved:
                raise ValueError(
                    f"{', '.join(moved)} moved to the [estimator] section: products = "
                    '"finite_difference" with fd_mu = m is [estimator] name = '
                    '"finite_difference", hvp_mu = m; products = "first_order" with penalty '
                    '= l is [estimator] name = "first_order", lam = l'
                )
        return data

    @property
    def local_steps_default(self) -> int:
        return self.local_steps

    def build(self, wiring: Wiring) -> SimFBO:
        return self.bind(SimFBO, wiring)


class SimFBO(SimFBOConfig, AlgorithmBase):
    """SimFBO (Alg. 1, eqs. (3)-(5) of ``papers/simfbo_shrofbo.txt``) on masked submodels.

    Args (besides the hyperparameters of :class:`SimFBOConfig`):
        outer_names / inner_names / buffer_names: which model tensors are x, y and buffers.
        estimator: the second-order products (default :class:`~radbo.hypergrad.Autograd`), or
            :class:`~radbo.hypergrad.FirstOrder` for the fully first-order penalty mode.
        aggregate_buffers: average BatchNorm running statistics (default) or static BN (see
            :class:`~radbo.algorithms.RABO`).
    """

    estimator: Estimator = Field(default_factory=Autograd)

    @property
    def penalty(self) -> float | None:
        """The penalty lam of the first-order mode (``None``: second-order products)."""
        if "products" in self.estimator.capabilities:
            return None
        # without products, the wiring check made sure the estimator offers a penalty
        assert isinstance(self.estimator, _Penalty), "a penalty estimator holds its lam"
        return float(self.estimator.lam)

    # -- state ---------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> SimFBOState:
        """x, y and buffers cloned; v = 0 (or y_lam = y in first-order mode)."""
        v = clone(y) if self.penalty is not None else {k: torch.zeros_like(t) for k, t in y.items()}
        return SimFBOState(x=clone(x), y=clone(y), v=v, buffers=clone(buffers))

    def phases(self) -> Sequence[Phase[SimFBOState]]:
        keys = self.reply_keys(
            self.outer_names, self.inner_names, prefixed(V, self.inner_names), buffers=True
        )
        work = ClientWork(self.run_client, self.prepare_client, keys)
        return (
            Phase("train", self.broadcast, work, self.server, broadcast_many=self.broadcast_many),
        )

    def _wire_index(self, index_set: IndexSet) -> IndexSet:
        return {**index_set, **alias(index_set, V, self.inner_names)}

    # -- the one phase ---------------------------------------------------------------------
    def broadcast(self, state: SimFBOState, index_set: IndexSet, slot: int = 0) -> Params:
        """Submodel of x, y, v and buffers for one client."""
        wire = {**self.model_state(state), **{f"{V}:{k}": t for k, t in state.v.items()}}
        return extract(wire, self._wire_index(index_set))

    def broadcast_many(
        self, state: SimFBOState, index_sets: Sequence[IndexSet], slots: Sequence[int]
    ) -> list[Params]:
        """:meth:`broadcast` for every client at once (:func:`extract_many`)."""
        wire = {**self.model_state(state), **{f"{V}:{k}": t for k, t in state.v.items()}}
        return extract_many(wire, [self._wire_index(index_set) for index_set in index_sets])

    def prepare_client(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """An inner and an outer minibatch for each of the client's tau_i local steps."""
        gen = task.generator()
        inner, outer = runtime.sampler.pair_steps(
            task.data, self.batch_size, self.outer_batch_size, task.budget.local_steps, gen
        )
        steps = {"inner": inner, "outer": outer}
        return Prepared(
            steps=steps, num_steps=task.budget.local_steps, ragged=frozenset({"inner", "outer"})
        )

    def run_client(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """tau_i simultaneous local steps (eq. (3)) and the local aggregates (eq. (4)).

        A stacked cohort replays its steps from a CUDA graph where the runtime has
        :attr:`~radbo.client.ClientRuntime.graphs` (``[runtime] cuda_graphs``): the steps as
        one pure function of x, y, v, buffers and the steps' minibatches on the device
        (:meth:`~radbo.client.Cohort.run_steps`); clients with unequal tau_i run the
        largest, each masked past its own by the counts on the device."""
        module = cohort.module(runtime)
        x = cohort.params(self.outer_names)
        y = cohort.params(self.inner_names)
        v = {n: cohort.param(f"{V}:{n}") for n in self.inner_names}
        buffers = cohort.params(self.buffer_names, clone=True)
        # a frozen algorithm (step sizes, coefficient, estimator) and the module skeleton: the
        # capture's key
        key = ("simfbo.step", id(self), id(module))
        draws = [("inner", self.batch_size), ("outer", self.outer_batch_size)]
        run = partial(self._local_steps, runtime, cohort, module)
        done = cohort.run_steps(runtime, key, (x, y, v, buffers), draws, run)
        carry, losses = done.carry
        n_grad, n_hvp = done.n_grad, done.n_hvp
        x, y, v, q_x, q_y, q_v, buffers = carry
        a = self.coefficient
        taus = torch.tensor(
            cohort.num_steps, dtype=torch.float64, device=next(iter(q_y.values())).device
        )
        a_norm: Any = a * taus if cohort.stacked else a * cohort.num_steps[0]
        update = self.local_message(q_x, q_y, q_v, a_norm)
        if self.aggregate_buffers:
            update.update(buffers)
        inner_loss, outer_loss = losses
        return cohort.replies(
            update,
            {
                "inner_loss": inner_loss,
                "outer_loss": outer_loss,
                "a_norm": a_norm,
                "local_steps": taus if cohort.stacked else float(cohort.num_steps[0]),
            },
            n_grad=n_grad,
            n_hvp=n_hvp,
            samples=cohort.step_samples("inner", "outer"),
        )

    def _local_steps(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        start: tuple[Params, ...],
        step_data: Callable[[str, int], torch.Tensor],
        steps: int | list[int],
        counts: torch.Tensor | None = None,
    ) -> LocalSteps[tuple[tuple[Params, ...], tuple[Any, Any]]]:
        """Eq. (3) ``steps`` times from ``start = (x, y, v, buffers)`` (each client its number
        of steps; or ``steps`` times, each client masked past its entry of ``counts``, a
        tensor on the device), step t on the example indices ``step_data("inner", t)`` and
        ``step_data("outer", t)``. The steps' carry is the final ``(x, y, v, q_x, q_y, q_v,
        buffers)`` and the losses ``(g, f)`` at the first step ((0, 0) without steps)."""
        lead = cohort.lead
        x, y, v, buffers = start
        q_x = {k: torch.zeros_like(t) for k, t in x.items()}
        q_y = {k: torch.zeros_like(t) for k, t in y.items()}
        q_v = {k: torch.zeros_like(t) for k, t in v.items()}
        a = self.coefficient
        lam = self.penalty
        first: list[tuple[Any, Any]] = []  # (g, f) at the first step

        def step(t: int, carry: tuple[Params, ...]) -> tuple[tuple[Params, ...], Work]:
            x, y, v, q_x, q_y, q_v, buffers = carry
            inner_batch = runtime.batch(step_data("inner", t))
            outer_batch = runtime.batch(step_data("outer", t))
            if buffers:  # BatchNorm running statistics follow the local training batches
                with torch.no_grad():
                    cohort.loss(runtime.problem.inner_loss, module, x, y, buffers, inner_batch)
            outer, inner = cohort.bind(runtime.problem, module, buffers, inner_batch, outer_batch)
            if lam is None:
                system = self.estimator.linearize(inner, x, y, lead=lead)
                dirs = bilevel_directions(system, outer, x, y, v)
                d_x, d_y, d_v = dirs.x, dirs.y, dirs.v
                losses, work = (dirs.g, dirs.f), Work(dirs.n_grad, dirs.n_hvp)
            else:  # v is y_lam, y is z
                oracle = penalty_gradients(outer, inner, x, v, y, lam, lead=lead)
                d_x, d_y = oracle.x, oracle.z
                d_v = {k: d / (1.0 + lam) for k, d in oracle.y.items()}
                losses, work = (oracle.g, oracle.f), Work(oracle.n_grad, 0)
            if not first:
                first.append(losses)
            x = axpy(-a * self.outer_lr, d_x, x)
            y = axpy(-a * self.inner_lr, d_y, y)
            v = axpy(-a * self.v_lr, d_v, v)
            q_x, q_y, q_v = axpy(a, d_x, q_x), axpy(a, d_y, q_y), axpy(a, d_v, q_v)
            return (x, y, v, q_x, q_y, q_v, buffers), work

        # the same work every step; clients past their tau_i keep what they had
        carry: tuple[Params, ...] = (x, y, v, q_x, q_y, q_v, buffers)
        done = local_steps(step, carry, steps, name="simfbo.step", counts=counts)
        losses = first[0] if first else (0.0, 0.0)
        return LocalSteps((done.carry, losses), done.n_grad, done.n_hvp)

    def local_message(self, q_x: Params, q_y: Params, q_v: Params, a_norm: Any) -> Params:
        """What a client sends: SimFBO sends the local aggregates q_i themselves (eq. (4))."""
        return {**q_x, **q_y, **{f"{V}:{k}": t for k, t in q_v.items()}}

    def server(
        self,
        state: SimFBOState,
        results: Sequence[ClientResult],
        index_sets: Sequence[IndexSet],
        weights: Sequence[float],
    ) -> tuple[SimFBOState, dict[str, float]]:
        """Coverage-weighted server step on x, y and v (eq. (5)); buffers averaged."""
        wire_sets = [self._wire_index(idx) for idx in index_sets]
        shapes = {
            **{n: t.shape for n, t in state.x.items()},
            **{n: t.shape for n, t in state.y.items()},
            **{f"{V}:{n}": t.shape for n, t in state.v.items()},
        }
        scales = [r.metrics["a_norm"] for r in results]
        agg = coverage_weighted_mean(
            [r.update for r in results], wire_sets, shapes, weights, scales
        )
        x, y, v_wire = self.server_step(state, agg)
        v = {n: v_wire[f"{V}:{n}"] for n in self.inner_names}
        if self.radius is not None and self.penalty is None:
            v = project_ball(v, self.radius)
        buffers = state.buffers
        if self.aggregate_buffers:
            buffers = average_buffers(buffers, [r.update for r in results], index_sets, weights)
        metrics = {
            "inner_loss": mean_metric(results, "inner_loss"),
            "outer_loss": mean_metric(results, "outer_loss"),
            "local_steps_mean": mean_metric(results, "local_steps"),
        }
        new = replace(state, x=x, y=y, v=v, buffers=buffers, round=state.round + 1)
        return new, metrics

    def server_step(self, state: SimFBOState, agg: CoverageMean) -> tuple[Params, Params, Params]:
        """SimFBO eq. (5): ``p <- p - gamma * q`` per block (before the projection of v)."""
        v_wire = {f"{V}:{k}": t for k, t in state.v.items()}
        return (
            apply_step(state.x, agg, self.server_lr_x),
            apply_step(state.y, agg, self.server_lr_y),
            apply_step(v_wire, agg, self.server_lr_v),
        )


def normalize(tensors: Params, a_norm: Any) -> Params:
    """``t / ||a_i||_1`` per client (ShroFBO eq. (6))."""
    if isinstance(a_norm, torch.Tensor):
        return {k: t * broadcast(1.0 / a_norm, t) for k, t in tensors.items()}
    scale = 1.0 / a_norm
    return {k: t * scale for k, t in tensors.items()}
