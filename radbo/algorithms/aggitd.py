"""FBO-AggITD: federated bilevel optimization with an aggregated iterative-differentiation
hypergradient.

Paper: Xiao and Ji, "Communication-Efficient Federated Hypergradient Computation via Aggregated
Iterative Differentiation", ICML 2023 (PMLR 202, pp. 38059-38086), arXiv:2302.04969. Its text
is not among ``papers/``; radbo follows its public description -- the abstract (hypergradient
estimation "conducted simultaneously" with the lower-level optimization, by differentiating
through the lower-level iterates) and the SimFBO paper's summary (``papers/simfbo_shrofbo.txt``
Sec. 1 and Fig. 1: lower-level optimization and hypergradient computation synthesized into the
same communication sub-loop of products of Hessian- and Jacobian-vector products; Sec. 5 and
App. A.2: FBO-AggITD runs 1 to 10 local lower-level updates per client) -- and the ITD
hypergradient itself (reverse-mode
differentiation through the lower-level iterates; Franceschi et al., ICML 2017,
arXiv:1703.01785; analysed by Ji, Yang and Liang, ICML 2021, arXiv:2010.07962). The paper's
own equation and line numbers are not cited because radbo could not check them.

**What one outer iteration k does** (x = x^k fixed, ``p~_i`` the client weights normalised over
the clients that answered a round, ``tau_i`` a client's local steps):

1. ``inner.r`` for r = 0..R-1 -- the lower level, FedAvg-style: every sampled client i starts
   from the server's y^r and runs tau_i local SGD steps
   ``y_i^{r,m+1} = y_i^{r,m} - beta grad_y g_i(x, y_i^{r,m}; zeta_i^{r,m})`` and sends the sum
   of its gradients; the server sets
   ``y^{r+1} = sum_i p~_i y_i^{r,tau_i} =: Phi_r(x, y^r)`` (the aggregated iterate) and keeps
   y^r on its tape.
2. ``itd.outer`` -- clients return ``grad_x f_i`` and ``grad_y f_i`` at (x, y^R) on one outer
   minibatch; the server starts the hypergradient ``h = sum_i p~_i grad_x f_i`` and the adjoint
   ``v_R = sum_i p~_i grad_y f_i``.
3. ``itd.r`` for r = R-1 down to 0 -- the backward sweep of ITD through the aggregated iterates:
   the server sends (x, y^r, v_{r+1}); each sampled client replays its tau_i local steps from
   y^r and back-propagates v_{r+1} through them with Hessian- and Jacobian-vector products
   (``u^{tau_i} = v_{r+1}``; for m = tau_i-1..0:
   ``a -= beta H_xy g_i(x, y_i^{r,m}) u^{m+1}``, ``u^m = u^{m+1} - beta H_yy g_i(x, y_i^{r,m})
   u^{m+1}``) and returns ``(a, u^0)``, its vector-Jacobian products of its local map; the
   server aggregates ``h += sum_i p~_i a_i`` and ``v_r = sum_i p~_i u_i^0``. After r = 0 it
   steps ``x^{k+1} = x^k - alpha h``; y^R is the next iteration's warm start.

With full participation and full batches, h is exactly the ITD hypergradient
``d/dx F(x, y^R(x))`` of the federated lower-level trajectory (y^0 held fixed)::

    h = grad_x F(x, y^R) + sum_{r<R} d_x Phi_r(x, y^r)^T v_{r+1},
    v_R = grad_y F(x, y^R),   v_r = d_y Phi_r(x, y^r)^T v_{r+1},

which for one client and tau = 1 is the familiar
``grad_x f - beta sum_t H_xy g(y_t) prod_{j>t} (I - beta H_yy g(y_j)) grad_y f(y_T)``. The
global Hessians are never formed: every factor of the product is aggregated across clients in
its own round, so h differentiates the federated trajectory -- not an average of the clients'
own ITD hypergradients, which would carry their drift -- and there is no separate Neumann /
IHGP sub-loop (FedMBO's ``phe.*``): the backward sweep re-traverses the R rounds of the lower
level. (With tau > 1 the lower level itself is FedAvg and drifts on non-iid data; h is the
exact derivative of that drifting trajectory.)

**Communication.** One iteration costs ``2 R + 1`` communication rounds: R lower-level rounds,
one for the outer gradients, R backward rounds (a backward round is skipped when its forward
round aggregated nothing, and all are skipped once the hypergradient is abandoned). Each local
step costs one gradient in ``inner.r`` and one gradient plus one joint product (``H_xy u``,
``H_yy u`` in one backward pass) in ``itd.r``.

**Where radbo deviates, and why.**

* *Backward rounds are counted.* The paper presents the hypergradient as computed within the
  lower-level sub-loop. Reverse-mode ITD needs ``grad_y F`` at the *last* iterate before any
  product can be formed, and radbo's messages are vectors; computing the hypergradient in the
  forward rounds instead (forward-mode ITD) would ship the Jacobian ``dy/dx``
  (``|x| x |y|`` numbers) per client and round. So radbo runs the backward sweep as rounds of
  its own and charges them like every other message exchange.
* *Stateless clients, fresh samples.* Clients keep nothing between rounds (FedMBO's model), so
  each backward round samples its clients afresh (without replacement, ``clients_per_phase``)
  and each client replays its local steps on fresh minibatches. With full participation and
  full batches this is the exact derivative above; otherwise every factor is an unbiased
  estimate of the corresponding population factor at the realised iterate y^r.
* *One outer minibatch* gives both ``grad_x f_i`` and ``grad_y f_i`` (one gradient evaluation).
* *Failures* are handled as FedMBO handles them: a client that drops out or sends an unsound
  update is left out of its round's mean; a lower-level round with no result leaves y
  unchanged (its backward round is skipped, its map being the identity); if the outer round or
  a backward round gets no result, the hypergradient is abandoned and x stays unchanged for
  this iteration (metric ``itd_complete = 0``). ``max_hypergrad_norm`` optionally clips h
  (off by default; not in the paper).

FBO-AggITD trains the full model on every client: use it without masks. Hessian- and
Jacobian-vector products come from the ``[estimator]`` (``autograd``, exact, default; or
``finite_difference``, second-order free).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from radbo.aggregation import coverage_weighted_mean, step_inner
from radbo.algorithms.base import (
    ALGORITHMS,
    AlgorithmBase,
    AlgorithmConfig,
    Wiring,
    clone,
    draw_clients,
    prefixed,
)
from radbo.autodiff import (
    Linearization,
    TensorTuple,
    axpy,
    loss_grads,
    params_norm,
    project_ball,
    tuple_axpy,
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
from radbo.masks.index import alias
from radbo.typing import IndexSet, Params

__all__ = ["AggITD", "AggITDConfig", "AggITDState"]

#: prefix of the adjoint v (shaped like y) on the wire and on the tape
V = "v"
#: prefix of the lower-level iterates y^0..y^{R-1} (stacked, shaped [R, *y]) on the tape
Y = "y"
#: prefix of the running hypergradient h (shaped like x) on the tape
H = "h"
#: tape entry: which lower-level rounds aggregated at least one client (bool, [R])
MOVED = "moved"
#: tape entry: whether the current iteration's hypergradient is still being built (bool, [])
ALIVE = "alive"


@dataclass(frozen=True)
class AggITDState:
    """Global state: x, y and buffers, plus the ITD tape of the current iteration.

    ``tape`` has fixed names and shapes for the whole run (so that checkpoints and shape checks
    see the same state between iterations): ``"y:<y name>"`` stacks the lower-level iterates
    y^0..y^{R-1} (``[R, *shape]``), ``"moved"`` ([R], bool) marks the rounds that aggregated
    some client, ``"v:<y name>"`` is the adjoint, ``"h:<x name>"`` the hypergradient built so
    far and ``"alive"`` (bool) whether the backward sweep is still running. Between iterations
    it holds the last iteration's values, which the next ``inner.0`` overwrites.
    """

    x: Params
    y: Params
    buffers: Params
    tape: Params
    round: int = 0


@ALGORITHMS.register
class AggITDConfig(AlgorithmConfig):
    """FBO-AggITD hyperparameters (Xiao and Ji, ICML 2023, arXiv:2302.04969; see the module
    docstring for the algorithm radbo implements)."""

    name: Literal["aggitd"]
    inner_lr: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="beta, local step on y (<= 1000 without --force)",
    )
    outer_lr: StepSize = Field(
        0.1, gt=0, allow_inf_nan=False, description="alpha, step on x (<= 1000 without --force)"
    )
    inner_rounds: Steps = Field(
        3,
        ge=1,
        description="R, lower-level communication rounds per iteration (<= 10,000 without --force)",
    )
    local_steps: Steps = Field(
        5,
        ge=1,
        description="tau, local SGD steps per lower-level round (fixed local steps; "
        "<= 10,000 without --force)",
    )
    batch_size: BatchSize = Field(32, ge=1, description="inner minibatch per local step")
    outer_batch_size: BatchSize = Field(32, ge=1, description="outer minibatch of grad f at y^R")
    clients_per_phase: int | None = Field(
        None, ge=1, description="clients sampled per communication round; default all available"
    )
    max_hypergrad_norm: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="optional clipping of h before the x step"
    )

    estimator_uses: ClassVar[tuple[str, ...]] = ("products",)
    default_estimator: ClassVar[str | None] = "autograd"
    full_model: ClassVar[bool] = True

    @property
    def local_steps_default(self) -> int:
        return self.local_steps

    def build(self, wiring: Wiring) -> AggITD:
        return self.bind(AggITD, wiring, use_budget_steps=wiring.budget_steps)


class AggITD(AggITDConfig, AlgorithmBase):
    """FBO-AggITD (module docstring): R FedAvg-style lower-level rounds, then the ITD
    hypergradient back-propagated through the aggregated iterates, one round per lower-level
    round.

    Args (besides the hyperparameters of :class:`AggITDConfig`):
        outer_names / inner_names / buffer_names: which model tensors are x, y and buffers.
        inner_lr: beta, the local SGD step on y (the same beta the backward sweep uses).
        outer_lr: alpha, the step on x.
        inner_rounds: R, lower-level rounds (and backward rounds) per iteration.
        local_steps: tau, local steps per lower-level round of every client (unless
            ``use_budget_steps``).
        batch_size: the inner minibatch of each local step (forward and replayed).
        outer_batch_size: the outer minibatch of ``grad_x f`` and ``grad_y f`` at y^R.
        clients_per_phase: clients sampled afresh, without replacement, for every
            communication round; ``None``: every client still in the round.
        max_hypergrad_norm: optional clipping of h (off by default; the paper has none).
        estimator: the Hessian- and Jacobian-vector products (default autograd).
        use_budget_steps: each client runs its budget's local steps tau_i instead of
            ``local_steps`` (``[fleet] local_steps`` other than ``"fixed"``).
        aggregate_buffers: clients return BatchNorm running statistics with their lower-level
            updates and the server averages them.
    """

    name: Literal["aggitd"] = "aggitd"
    estimator: Estimator = Field(default_factory=Autograd)
    use_budget_steps: bool = False

    # -- state ---------------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> AggITDState:
        """x, y and buffers cloned; an empty tape of the run's fixed shapes."""
        rounds = self.inner_rounds
        tape: Params = {
            **{f"{Y}:{n}": t.detach().new_zeros((rounds, *t.shape)) for n, t in y.items()},
            **{f"{V}:{n}": torch.zeros_like(t) for n, t in y.items()},
            **{f"{H}:{n}": torch.zeros_like(t) for n, t in x.items()},
            MOVED: torch.zeros(rounds, dtype=torch.bool),
            ALIVE: torch.zeros((), dtype=torch.bool),
        }
        return AggITDState(x=clone(x), y=clone(y), buffers=clone(buffers), tape=tape)

    def phases(self) -> Sequence[Phase[AggITDState]]:
        both = self.reply_keys(self.outer_names, prefixed(V, self.inner_names))
        local = ClientWork(
            self.run_local, self.prepare_local, self.reply_keys(self.inner_names, buffers=True)
        )
        outer = ClientWork(self.run_outer, self.prepare_outer, both)
        backward = ClientWork(self.run_backward, self.prepare_local, both)
        forward = [
            Phase(f"inner.{r}", self.broadcast, local, self.server_inner(r), self.sample)
            for r in range(self.inner_rounds)
        ]
        sweep = [
            Phase(
                f"itd.{r}",
                self.broadcast_backward(r),
                backward,
                self.server_backward(r),
                self.select_backward(r),
            )
            for r in reversed(range(self.inner_rounds))
        ]
        return (
            *forward,
            Phase("itd.outer", self.broadcast, outer, self.server_outer, self.sample),
            *sweep,
        )

    # -- who takes part --------------------------------------------------------------------------
    def sample(
        self, state: AggITDState, candidates: Sequence[int], generator: torch.Generator
    ) -> list[int]:
        """``clients_per_phase`` of the round's remaining clients, drawn uniformly without
        replacement (all of them, in random order, when ``None`` or fewer remain)."""
        return draw_clients(candidates, self.clients_per_phase, generator)

    def select_backward(
        self, r: int
    ) -> Callable[[AggITDState, Sequence[int], torch.Generator], list[int]]:
        def select(
            state: AggITDState, candidates: Sequence[int], generator: torch.Generator
        ) -> list[int]:
            """A fresh sample while the sweep runs and round r moved y; nobody otherwise."""
            if not bool(state.tape[ALIVE]) or not bool(state.tape[MOVED][r]):
                return []
            return self.sample(state, candidates, generator)

        return select

    # -- broadcasts --------------------------------------------------------------------------------
    def broadcast(self, state: AggITDState, index_set: IndexSet, slot: int = 0) -> Params:
        """The full model (x^k, y^r) and buffers."""
        return dict(self.model_state(state))

    def broadcast_backward(self, r: int) -> Callable[[AggITDState, IndexSet, int], Params]:
        def broadcast(state: AggITDState, index_set: IndexSet, slot: int = 0) -> Params:
            """x^k, the iterate y^r from the tape, buffers and the adjoint v_{r+1}."""
            y_r = {n: state.tape[f"{Y}:{n}"][r] for n in self.inner_names}
            v = {f"{V}:{n}": state.tape[f"{V}:{n}"] for n in self.inner_names}
            return {**state.x, **y_r, **state.buffers, **v}

        return broadcast

    # -- clients -----------------------------------------------------------------------------------
    def prepare_local(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """One inner minibatch for each of the client's tau_i local steps."""
        gen = task.generator()
        steps = task.budget.local_steps if self.use_budget_steps else self.local_steps
        batches = runtime.sampler.inner_steps(task.data, self.batch_size, steps, gen)
        return Prepared(steps={"inner": batches}, num_steps=steps, ragged=frozenset({"inner"}))

    def run_local(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """tau_i local SGD steps on g_i from y^r; returns the summed gradients
        ``G_i = (y^r - y_i^{r,tau_i}) / beta`` (and the buffers). A stacked cohort replays
        its steps from a CUDA graph where the runtime has them
        (:meth:`~radbo.client.Cohort.run_steps`)."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        # a frozen algorithm (inner_lr) and the module skeleton: the capture's key
        key = ("aggitd.local", id(self), id(module))
        run = partial(self._local_steps, runtime, cohort, module)
        done = cohort.run_steps(runtime, key, (x, y, buffers), [("inner", self.batch_size)], run)
        carry, first = done.carry
        n_grad = done.n_grad
        _, total, buffers = carry
        update = {**total, **(buffers if self.aggregate_buffers else {})}
        return cohort.replies(
            update,
            {"inner_loss": first},
            n_grad=n_grad,
            samples=cohort.step_samples("inner"),
        )

    def _local_steps(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        state: tuple[Params, Params, Params],
        step_data: Callable[[str, int], torch.Tensor],
        steps: int | list[int],
        counts: torch.Tensor | None = None,
    ) -> LocalSteps[tuple[tuple[Params, Params, Params], Any]]:
        """``steps`` local SGD steps on g_i from ``state = (x, y, buffers)`` (each client its
        number; or ``steps`` times, each client masked past its entry of ``counts``, a tensor
        on the device), step t on the example indices ``step_data("inner", t)``; the steps'
        carry is the final ``(y, summed gradients, buffers)`` and g at the first step (NaN
        without steps)."""
        x, y, buffers = state
        lead = cohort.lead
        xn, yn = tuple(x), tuple(y)
        first: list[torch.Tensor] = []  # g at the first step

        def step(t: int, carry: tuple[Params, Params, Params]) -> tuple[Any, Work]:
            y, total, buffers = carry
            batch = runtime.batch(step_data("inner", t))

            def inner(x_: Params, y_: Params) -> torch.Tensor:
                # updates the BatchNorm running statistics in ``buffers`` in place
                return cohort.loss(runtime.problem.inner_loss, module, x_, y_, buffers, batch)

            values: list[torch.Tensor] = []
            _, grads = loss_grads(
                inner,
                "inner_loss",
                xn,
                tuple(x.values()),
                yn,
                tuple(y.values()),
                wrt_x=False,
                wrt_y=True,
                lead=lead,
                value=values,
            )
            g = dict(zip(yn, grads, strict=True))
            if not first:
                first.append(values[0])
            return (axpy(-self.inner_lr, g, y), axpy(1.0, g, total), buffers), Work(n_grad=1)

        # clients past their tau_i keep what they had
        total = {n: torch.zeros_like(t) for n, t in y.items()}
        done = local_steps(step, (y, total, buffers), steps, name="aggitd.local", counts=counts)
        loss = first[0] if first else float("nan")
        return LocalSteps((done.carry, loss), done.n_grad, done.n_hvp)

    def prepare_outer(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """One outer minibatch."""
        gen = task.generator()
        idx = runtime.sampler.outer(task.data, self.outer_batch_size, gen)
        return Prepared(data={"outer": idx}, ragged=frozenset({"outer"}))

    def run_outer(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """``grad_x f_i`` and ``grad_y f_i`` at (x^k, y^R) on one outer minibatch (one
        gradient evaluation); ``grad_y f_i`` travels as ``"v:<y name>"``."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        idx = cohort.data("outer")
        batch = runtime.batch(idx)
        outer, _ = cohort.bind(runtime.problem, module, buffers, batch, batch)
        xn, yn = tuple(x), tuple(y)
        values: list[torch.Tensor] = []
        grad_x, grad_y = loss_grads(
            outer,
            "outer_loss",
            xn,
            tuple(x.values()),
            yn,
            tuple(y.values()),
            wrt_x=True,
            wrt_y=True,
            lead=cohort.lead,
            value=values,
        )
        update = {
            **dict(zip(xn, grad_x, strict=True)),
            **{f"{V}:{n}": g for n, g in zip(yn, grad_y, strict=True)},
        }
        return cohort.replies(
            update, {"outer_loss": values[0]}, n_grad=1, samples=cohort.sizes("outer")
        )

    def run_backward(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """Replay tau_i local steps from y^r, then back-propagate v_{r+1} through them:
        returns ``a = d_x Y_i^T v`` (keyed like x) and ``u^0 = d_y Y_i^T v`` (as
        ``"v:<y name>"``), the vector-Jacobian products of the client's local map Y_i. A
        stacked cohort replays both sweeps from a CUDA graph where the runtime has them
        (:meth:`~radbo.client.Cohort.run_steps`)."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        u = tuple(cohort.param(f"{V}:{n}") for n in y)
        # a frozen algorithm (inner_lr, estimator) and the module skeleton: the capture's key
        key = ("aggitd.backward", id(self), id(module))
        run = partial(self._backward_sweep, runtime, cohort, module)
        draws = [("inner", self.batch_size)]
        done = cohort.run_steps(runtime, key, (x, y, buffers, u), draws, run)
        carry, n_grad, n_hvp = done.carry, done.n_grad, done.n_hvp
        a, u = carry
        update = {
            **dict(zip(self.outer_names, a, strict=True)),
            **{f"{V}:{n}": t for n, t in zip(y, u, strict=True)},
        }
        return cohort.replies(
            update,
            n_grad=n_grad,
            n_hvp=n_hvp,
            samples=cohort.step_samples("inner"),
        )

    def _backward_sweep(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        state: tuple[Params, Params, Params, TensorTuple],
        step_data: Callable[[str, int], torch.Tensor],
        steps: int | list[int],
        counts: torch.Tensor | None = None,
    ) -> LocalSteps[tuple[TensorTuple, TensorTuple]]:
        """``steps`` local steps replayed from ``state = (x, y, buffers, u)``'s y (each
        client its number; or ``steps`` times, each client masked past its entry of
        ``counts``, a tensor on the device), step t on the example indices
        ``step_data("inner", t)``, then ``u`` back-propagated through them from the last step
        down; the carry ends as ``(a, u^0)``."""
        x, y, buffers, u = state
        lead = cohort.lead
        yn = tuple(y)
        systems: list[Linearization] = []

        def replay(t: int, y: Params) -> tuple[Params, Work]:
            batch = runtime.batch(step_data("inner", t))
            _, inner = cohort.bind(runtime.problem, module, buffers, batch, batch)
            system = self.estimator.linearize(inner, x, y, lead=lead, with_x=True)
            systems.append(system)
            g = dict(zip(yn, system.grad_y_g, strict=True))
            return axpy(-self.inner_lr, g, y), Work()  # counted with its product below

        def backward(t: int, carry: tuple[TensorTuple, TensorTuple]) -> tuple[Any, Work]:
            a, u = carry
            jv, hv = systems[t].both(u)
            work = Work(systems[t].n_grad, systems[t].n_hvp)  # its gradient and its product
            return (tuple_axpy(-self.inner_lr, jv, a), tuple_axpy(-self.inner_lr, hv, u)), work

        local_steps(replay, y, steps, name="aggitd.replay", counts=counts)
        a = tuple(torch.zeros_like(t) for t in x.values())
        return local_steps(
            backward, (a, u), steps, name="aggitd.backward", reverse=True, counts=counts
        )

    # -- servers -----------------------------------------------------------------------------------
    def _mean(
        self,
        results: Sequence[ClientResult],
        index_sets: Sequence[IndexSet],
        weights: Sequence[float],
        shapes: dict[str, torch.Size],
    ) -> Params:
        """The weighted mean of the results' tensors ``shapes`` (weights normalised over the
        results), on radbo's aggregation path."""
        wire = [{**idx, **alias(idx, V, self.inner_names)} for idx in index_sets]
        return coverage_weighted_mean([r.update for r in results], wire, shapes, weights).mean

    def _wire_shapes(self, state: AggITDState) -> dict[str, torch.Size]:
        return {
            **{n: t.shape for n, t in state.x.items()},
            **{f"{V}:{n}": t.shape for n, t in state.y.items()},
        }

    def server_inner(self, r: int):
        def server(state, results, index_sets, weights):
            """Tape y^r; ``y^{r+1} = y^r - beta sum_i p~_i G_i`` (the mean of the clients'
            last local iterates); buffers averaged. Round 0 starts a new tape."""
            tape = dict(state.tape)
            if r == 0:
                tape[MOVED] = torch.zeros_like(tape[MOVED])
                tape[ALIVE] = torch.zeros_like(tape[ALIVE])
                state = replace(state, round=state.round + 1)
            for n in self.inner_names:
                stacked = tape[f"{Y}:{n}"].clone()
                stacked[r] = state.y[n]
                tape[f"{Y}:{n}"] = stacked
            moved = tape[MOVED].clone()
            moved[r] = bool(results)
            tape[MOVED] = moved
            y, buffers = step_inner(
                state.y,
                state.buffers,
                [res.update for res in results],
                index_sets,
                weights,
                self.inner_lr,
                with_buffers=self.aggregate_buffers,
            )
            metrics = {"inner_loss": mean_metric(results, "inner_loss")}
            return replace(state, y=y, buffers=buffers, tape=tape), metrics

        return server

    def server_outer(self, state, results, index_sets, weights):
        """Start the sweep: ``h = sum_i p~_i grad_x f_i``, ``v_R = sum_i p~_i grad_y f_i``."""
        metrics: dict[str, float] = {"outer_loss": mean_metric(results, "outer_loss")}
        tape = dict(state.tape)
        if not results:
            tape[ALIVE] = torch.zeros_like(tape[ALIVE])
            metrics["itd_complete"] = 0.0
            return replace(state, tape=tape), metrics
        mean = self._mean(results, index_sets, weights, self._wire_shapes(state))
        for n in self.outer_names:
            tape[f"{H}:{n}"] = mean[n]
        for n in self.inner_names:
            tape[f"{V}:{n}"] = mean[f"{V}:{n}"]
        tape[ALIVE] = torch.ones_like(tape[ALIVE])
        state = replace(state, tape=tape)
        if not bool(tape[MOVED].any()):  # y^R does not depend on x: h is complete
            return self._finish(state, metrics)
        return state, metrics

    def server_backward(self, r: int):
        def server(state, results, index_sets, weights):
            """``h += sum_i p~_i a_i``, ``v_r = sum_i p~_i u_i^0``; after the last backward
            round, ``x <- x - alpha h``. No result: the hypergradient is abandoned."""
            tape = dict(state.tape)
            if not results:
                tape[ALIVE] = torch.zeros_like(tape[ALIVE])
                return replace(state, tape=tape), {"itd_complete": 0.0}
            mean = self._mean(results, index_sets, weights, self._wire_shapes(state))
            for n in self.outer_names:
                tape[f"{H}:{n}"] = tape[f"{H}:{n}"] + mean[n]
            for n in self.inner_names:
                tape[f"{V}:{n}"] = mean[f"{V}:{n}"]
            state = replace(state, tape=tape)
            if bool(tape[MOVED][:r].any()):  # earlier rounds still to go back through
                return state, {}
            return self._finish(state, {})

        return server

    def _finish(
        self, state: AggITDState, metrics: dict[str, float]
    ) -> tuple[AggITDState, dict[str, float]]:
        """``x^{k+1} = x^k - alpha h`` (h clipped if asked); the sweep ends."""
        h = {n: state.tape[f"{H}:{n}"] for n in self.outer_names}
        metrics = {**metrics, "hypergrad_norm": float(params_norm(h)), "itd_complete": 1.0}
        if self.max_hypergrad_norm is not None:
            h = project_ball(h, self.max_hypergrad_norm)  # clipping = projection
        tape = {**state.tape, ALIVE: torch.zeros_like(state.tape[ALIVE])}
        return replace(state, x=axpy(-self.outer_lr, h, state.x), tape=tape), metrics
