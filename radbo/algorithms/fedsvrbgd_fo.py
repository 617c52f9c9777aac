"""FedSVRBGD-FO: federated variance-reduced bilevel gradient descent with first-order oracles.

Paper: Zhang, Dhaipule, Tan, Ling and Gao, "Federated Stochastic Bilevel Optimization with
Fully First-Order Gradients", IJCAI 2025, pp. 7047-7055, doi:10.24963/ijcai.2025/784 (no
arXiv version is known to radbo; ``papers/fedsbo_first_order.txt``). Alg. 1 there.

The bilevel problem is penalised into the minimax problem eqs. (3)-(4),
``min_{x,y} max_z L_λ(x, y, z) = f(x, y) + λ (g(x, y) − g(x, z))``: y tends to
``y_λ = argmin_y f + λ g`` and z to ``y*(x) = argmin_y g``. Every client n keeps local x, y, z
and six STORM estimators, one per gradient part of the penalty oracle
:func:`radbo.autodiff.penalty_gradients` (the same code as the ``first_order`` estimator and
SimFBO's first-order mode):

* ``u1, u2, u3`` track ``∇_x f(x, y)``, ``∇_x g(x, y)``, ``∇_x g(x, z)`` (eq. (5));
* ``v1, v2`` track ``∇_y f(x, y)``, ``∇_y g(x, y)``; ``w1`` tracks ``∇_y g(x, z)`` (Alg. 1,
  the updates of ``m_y`` and ``m_z``).

Local iteration t of Alg. 1 (the updates of x, y, z, then of the estimators), with the
constant rates ``α_x η``, ``α_y η``, ``α_z η``::

    m_x = u1 + λ (u2 − u3)         (eq. (6))     x ← x − α_x η m_x   (eq. (7))
    m_y = v1 + λ v2                               y ← y − α_y η m_y
    m_z = λ w1                                    z ← z − α_z η m_z
    for every estimator e with its gradient part ∇ and a fresh minibatch ξ_{t+1}:
    e ← (1 − a)(e − ∇(x_t, y_t, z_t; ξ_{t+1})) + ∇(x_{t+1}, y_{t+1}, z_{t+1}; ξ_{t+1})

so the STORM difference takes the oracle at the old and the new point on the *same*
minibatch (one call of :func:`~radbo.autodiff.penalty_gradients` at each: 6 gradient
evaluations per local iteration). Every p local iterations the server averages the variables
AND the estimators and resets the clients to the averages (Alg. 1 line 9).

**Typos in the printed paper** (radbo follows the consistent reading): eq. (5) prints
``u_{2,t}`` and ``u_{3,t}`` inside their own recursions where ``u_{·,t−1}`` is meant (as for
``u_1`` and in Alg. 1); Alg. 1 line 1 (garbled in the text radbo has) shows ``m_{z,0}`` with
an extra ``λ ∇_2 g(x_0, y_0)`` term, and radbo takes ``m_{z,0} = λ w_{1,0} =
λ ∇_2 g(x_0, z_0; ξ_0)``, the form every later ``m_z`` has; line 9 prints ``u_1`` and ``v_1``
where it averages ``u_2`` and ``v_2``.

**Momentum.** ``momentum`` is ``a = β η²`` of the recursion above (the paper's ``1 − β_x η²``
multiplies the old estimator's correction), one value for ``β_x = β_y = β_z`` as in the
paper's Sec. 5: "the coefficient of the momentum [is] 0.1" is read as ``a = 0.1``, the weight
of the fresh stochastic gradient, as in STORM (Cutkosky and Orabona, 2019), whose ``a = c η²``
this recursion copies; with η = 0.01 that is ``β = a / η² = 1000``. ``momentum = 1`` is plain
local SGD on the penalty (each estimator is the fresh minibatch gradient at the new point; the
oracle at the old point is then skipped: 3 gradients per iteration).

**Defaults** are the paper's Sec. 5 with ε = 0.1: ``η = ε² = 0.01``, ``α_x = α_y = α_z = ε =
0.1`` (local step ``α η = 10⁻³``), momentum 0.1, communication period p = 4, minibatches of 10
per worker. The penalty λ is NOT a field here: it is the ``lam`` of the ``[estimator] name =
"first_order"`` section (the one place it is declared). Without an ``[estimator]`` section
(and in the Python API without an ``estimator``) radbo uses the paper's ``λ = 5/ε = 50``; an
``[estimator] name = "first_order"`` section without ``lam`` takes the estimator's own
default, 10.

**radbo's engine.** One engine round = one communication period: every sampled client runs
its p local iterations from the server's averages, sends x, y, z and the six estimators, and
the server averages them (the clients' reset is the next round's broadcast). The averages
live in :class:`FedSVRBGDState`, so checkpoints carry them. Client weights are the run's
``weighting`` (the paper: uniform 1/N).

**Initialisation** (Alg. 1 line 1): before the first round the estimators hold zeros and are
not sent; a client of the first round that runs (``primed`` is false) first sets every
estimator to the minibatch gradient at the received point, from its own minibatch of size B
(``init_batch_size``), then runs its p iterations. ``primed`` turns true after the first round
with at least one sound reply.

**Where radbo deviates, and why.**

* Partial participation: only the round's sampled clients run and are averaged (the paper has
  all N every period).
* Masked submodels (the paper trains full models): the average of Step 9 is taken per
  coordinate over the clients holding it (:func:`radbo.aggregation.coverage_weighted_mean`),
  for the variables and the estimators alike; coordinates nobody holds stay unchanged. A
  coordinate that no client of the priming round held keeps a zero estimator until a client
  holding it runs; STORM then brings it towards the gradient (the error shrinks by ``1 − a``
  per iteration).
* Local steps per client: ``local_steps`` is p; with a budget- or schedule-driven fleet
  (``fleet.local_steps`` not ``"fixed"``) client n runs its own p_n iterations (a stacked
  cohort freezes the clients that are done), and the server still averages once per round.
* z's minibatch: the oracle evaluates ``g`` at z on the inner minibatch of the same ξ as y
  (the paper writes one ξ for all parts), and f on the outer (validation) minibatch of ξ.
* The model the engine evaluates (``model_state``) holds z, the lower-level solution
  ``y*(x)``, for the inner tensors; y (→ ``y_λ``) is the auxiliary variable of the penalty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
from pydantic import Field

from radbo.aggregation import apply_mean, average_buffers, coverage_weighted_mean
from radbo.algorithms.base import (
    ALGORITHMS,
    AlgorithmBase,
    AlgorithmConfig,
    Wiring,
    clone,
    prefixed,
)
from radbo.autodiff import axpy, penalty_gradients
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
from radbo.hypergrad import Estimator, FirstOrder
from radbo.limits import BatchSize, Steps, StepSize
from radbo.loops import LocalSteps, Work, local_steps
from radbo.masks.index import alias, extract
from radbo.typing import IndexSet, Params

__all__ = ["ESTIMATOR_PARTS", "Z", "FedSVRBGD", "FedSVRBGDConfig", "FedSVRBGDState"]

#: prefix of z (shaped like y) on the wire
Z = "z"

#: the STORM estimators: prefix -> (the penalty oracle's gradient part, "x" or "y" shaped)
ESTIMATOR_PARTS: dict[str, tuple[str, str]] = {
    "u1": ("f_x", "x"),  # ∇_x f(x, y)
    "u2": ("g_x", "x"),  # ∇_x g(x, y)
    "u3": ("gz_x", "x"),  # ∇_x g(x, z)
    "v1": ("f_y", "y"),  # ∇_y f(x, y)
    "v2": ("g_y", "y"),  # ∇_y g(x, y)
    "w1": ("gz_y", "y"),  # ∇_y g(x, z)
}


@runtime_checkable
class _Penalty(Protocol):
    """An estimator with the ``"penalty"`` capability: it holds the penalty ``lam``."""

    lam: float


@dataclass(frozen=True)
class FedSVRBGDState:
    """Global state, every tensor in full-model coordinates: the server averages of x, y (the
    paper's y, → y_λ), z (→ y*(x); the model's inner tensors) and of the STORM estimators
    (``estimators``, keyed ``"<prefix>:<name>"`` with the prefixes of
    :data:`ESTIMATOR_PARTS`), buffers, the round counter and whether the estimators have been
    initialised (Alg. 1 line 1)."""

    x: Params
    y: Params
    z: Params
    estimators: Params
    buffers: Params
    round: int = 0
    primed: bool = False


@ALGORITHMS.register
class FedSVRBGDConfig(AlgorithmConfig):
    """FedSVRBGD-FO hyperparameters (Alg. 1 of ``papers/fedsbo_first_order.txt``; defaults
    from its Sec. 5 with ε = 0.1). The penalty λ is the ``[estimator] name = "first_order"``
    section's ``lam`` (the paper: λ = 5/ε = 50)."""

    name: Literal["fedsvrbgd_fo"]
    eta: StepSize = Field(
        0.01,
        gt=0,
        allow_inf_nan=False,
        description="eta, the learning rate (<= 1000 without --force)",
    )
    alpha_x: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="alpha_x; the x step is alpha_x * eta (<= 1000 without --force)",
    )
    alpha_y: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="alpha_y; the y step is alpha_y * eta (<= 1000 without --force)",
    )
    alpha_z: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="alpha_z; the z step is alpha_z * eta (<= 1000 without --force)",
    )
    momentum: float = Field(
        0.1,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="a = beta*eta^2 of the STORM recursion (beta_x = beta_y = beta_z); 1: SGD",
    )
    local_steps: Steps = Field(
        4,
        ge=1,
        description="p, local iterations per communication period (fleet 'fixed'; "
        "<= 10,000 without --force)",
    )
    batch_size: BatchSize = Field(10, ge=1, description="inner minibatch per local iteration")
    outer_batch_size: BatchSize = Field(10, ge=1, description="outer minibatch per local iteration")
    init_batch_size: BatchSize | None = Field(
        None,
        ge=1,
        description="B, inner and outer minibatch of the t = 0 estimators; "
        "None: batch_size and outer_batch_size",
    )

    estimator_uses: ClassVar[tuple[str, ...]] = ("penalty",)
    default_estimator: ClassVar[str | None] = "first_order"
    step_sizes: ClassVar[tuple[str, ...]] = ("eta",)  # every local step is alpha * eta
    #: without an ``[estimator]`` section: the paper's λ = 5/ε = 50 (Sec. 5, ε = 0.1)
    default_estimator_settings: ClassVar[dict[str, Any]] = {"lam": 50.0}

    @property
    def local_steps_default(self) -> int:
        return self.local_steps

    def baseline_settings(self) -> dict[str, Any]:
        """A full-model baseline reuses the local rates ``α_z η`` (inner) and ``α_x η``
        (outer) -- per gradient, without λ, which this section does not know -- p as its
        inner steps, and the batch sizes and weighting."""
        return {
            "inner_lr": self.alpha_z * self.eta,
            "outer_lr": self.alpha_x * self.eta,
            "inner_steps": self.local_steps,
            "batch_size": self.batch_size,
            "outer_batch_size": self.outer_batch_size,
            "weighting": self.weighting,
            "max_hypergrad_norm": None,
            **self.divergence_settings(),
        }

    def build(self, wiring: Wiring) -> FedSVRBGD:
        return self.bind(FedSVRBGD, wiring)


class FedSVRBGD(FedSVRBGDConfig, AlgorithmBase):
    """FedSVRBGD-FO (Alg. 1 of ``papers/fedsbo_first_order.txt``) on masked submodels.

    Args (besides the hyperparameters of :class:`FedSVRBGDConfig`):
        outer_names / inner_names / buffer_names: which model tensors are x, y and buffers.
        estimator: the penalty estimator holding λ (:class:`~radbo.hypergrad.FirstOrder`;
            only its ``lam`` is used).
        aggregate_buffers: average BatchNorm running statistics (default) or static BN.
    """

    name: Literal["fedsvrbgd_fo"] = "fedsvrbgd_fo"
    estimator: Estimator = Field(default_factory=lambda: FirstOrder(lam=50.0))

    @property
    def penalty(self) -> float:
        """The penalty λ (the estimator's ``lam``)."""
        # the wiring check made sure the estimator offers a penalty
        assert isinstance(self.estimator, _Penalty), "a penalty estimator holds its lam"
        return float(self.estimator.lam)

    # -- state ---------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> FedSVRBGDState:
        """x, y and buffers cloned, z = y; the estimators zero until the first round."""
        estimators: Params = {}
        for prefix, (_, shaped) in ESTIMATOR_PARTS.items():
            zeros = {k: torch.zeros_like(t) for k, t in (x if shaped == "x" else y).items()}
            estimators.update(self._keyed(prefix, zeros))
        return FedSVRBGDState(
            x=clone(x), y=clone(y), z=clone(y), estimators=estimators, buffers=clone(buffers)
        )

    def model_state(self, state: Any) -> Params:
        """x, z (→ y*(x), the lower-level solution) as the inner tensors, and buffers."""
        return {**state.x, **state.z, **state.buffers}

    def phases(self) -> Sequence[Phase[FedSVRBGDState]]:
        keys = self.reply_keys(
            self.outer_names,
            self.inner_names,
            prefixed(Z, self.inner_names),
            self._estimator_keys(),
            buffers=True,
        )
        work = ClientWork(self.run_client, self.prepare_client, keys)
        return (Phase("train", self.broadcast, work, self.server),)

    @staticmethod
    def _keyed(prefix: str, tensors: Params) -> Params:
        return {f"{prefix}:{k}": t for k, t in tensors.items()}

    def _names(self, prefix: str) -> tuple[str, ...]:
        shaped = ESTIMATOR_PARTS[prefix][1]
        return self.outer_names if shaped == "x" else self.inner_names

    def _wire_index(self, index_set: IndexSet) -> IndexSet:
        wire = {**index_set, **alias(index_set, Z, self.inner_names)}
        for prefix in ESTIMATOR_PARTS:
            wire.update(alias(index_set, prefix, self._names(prefix)))
        return wire

    def _wire(self, state: FedSVRBGDState) -> Params:
        """x, y, z and the estimators, keyed as on the wire (buffers apart)."""
        return {**state.x, **state.y, **self._keyed(Z, state.z), **state.estimators}

    # -- the one phase ---------------------------------------------------------------------
    def broadcast(self, state: FedSVRBGDState, index_set: IndexSet, slot: int = 0) -> Params:
        """Submodel of x, y, z, buffers and (once initialised) the estimators."""
        wire = {**state.x, **state.y, **self._keyed(Z, state.z), **state.buffers}
        if state.primed:
            wire.update(state.estimators)
        return extract(wire, self._wire_index(index_set))

    def prepare_client(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """Before the first round's iterations, the minibatch of the t = 0 estimators; then an
        inner and an outer minibatch per local iteration."""
        gen = task.generator()
        data = {}
        if not self._primed(task.params):
            inner_b = self.init_batch_size or self.batch_size
            outer_b = self.init_batch_size or self.outer_batch_size
            pair = runtime.sampler.pair(task.data, inner_b, outer_b, gen)
            data = {"init_inner": pair[0], "init_outer": pair[1]}
        inner, outer = runtime.sampler.pair_steps(
            task.data, self.batch_size, self.outer_batch_size, task.budget.local_steps, gen
        )
        steps = {"inner": inner, "outer": outer}
        ragged = frozenset({*data, *steps})  # every draw is a minibatch
        return Prepared(data=data, steps=steps, num_steps=task.budget.local_steps, ragged=ragged)

    def _estimator_keys(self) -> list[str]:
        return [f"{prefix}:{n}" for prefix in ESTIMATOR_PARTS for n in self._names(prefix)]

    def _primed(self, received: Params) -> bool:
        """Whether the server sent estimators (false before the first round)."""
        return self._estimator_keys()[0] in received

    def _estimates(self, parts: dict[str, Params]) -> Params:
        """The estimators set to the oracle's gradient parts (Alg. 1 line 1, or a = 1)."""
        out: Params = {}
        for prefix, (part, _) in ESTIMATOR_PARTS.items():
            out.update(self._keyed(prefix, parts[part]))
        return out

    def directions(self, est: Params) -> tuple[Params, Params, Params]:
        """``m_x = u1 + λ (u2 − u3)`` (eq. (6)), ``m_y = v1 + λ v2``, ``m_z = λ w1``."""
        lam = self.penalty
        m_x = {
            n: est[f"u1:{n}"] + lam * (est[f"u2:{n}"] - est[f"u3:{n}"]) for n in self.outer_names
        }
        m_y = {n: est[f"v1:{n}"] + lam * est[f"v2:{n}"] for n in self.inner_names}
        m_z = {n: lam * est[f"w1:{n}"] for n in self.inner_names}
        return m_x, m_y, m_z

    def run_client(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """p_n local iterations of Alg. 1 from the server's averages (after line 1 when no
        estimators came). Sends x, y, z and the estimators; metrics ``outer_loss`` = f(x, y)
        and ``inner_loss`` = g(x, z) at the point sent (on the last iteration's minibatch).
        Work: 3 gradients for line 1, then 6 per iteration (3 with ``momentum = 1``)."""
        module = cohort.module(runtime)
        x = cohort.params(self.outer_names)
        y = cohort.params(self.inner_names)
        z = {n: cohort.param(f"{Z}:{n}").detach() for n in self.inner_names}
        buffers = cohort.params(self.buffer_names, clone=True)
        primed = self._primed(cohort.tasks[0].params)
        n_init = 0 if primed else 3
        # the estimators received, or line 1's minibatches, which set them (through the
        # graphs, another capture: the inputs' structure differs)
        start: Params | tuple[torch.Tensor, ...]
        if primed:
            start = {k: cohort.param(k).detach() for k in self._estimator_keys()}
        else:
            replays = cohort.replays(runtime)
            sizes = {"init_inner": self.batch_size, "init_outer": self.outer_batch_size}
            start = tuple(
                cohort.data(
                    name, (self.init_batch_size or size) if replays and runtime.pads else None
                )
                for name, size in sizes.items()
            )
            if replays:  # the graph's inputs, on the device
                start = tuple(t.to(runtime.features.device) for t in start)

        def run(state: Any, step_data: Any, steps: Any, counts: Any) -> LocalSteps[Any]:
            x, y, z, start, buffers = state
            est = start
            if isinstance(start, tuple):  # not primed: line 1 first
                est = self._initial_estimates(runtime, cohort, module, x, y, z, buffers, start)
            carry = (x, y, z, est, buffers)
            return self._local_steps(runtime, cohort, module, carry, step_data, steps, counts)

        # a frozen algorithm (step sizes, lam, momentum) and the module skeleton: the
        # capture's key
        key = ("fedsvrbgd.step", id(self), id(module))
        draws = [("inner", self.batch_size), ("outer", self.outer_batch_size)]
        done = cohort.run_steps(runtime, key, (x, y, z, start, buffers), draws, run)
        carry, n_grad = done.carry, done.n_grad
        x, y, z, est, buffers, losses = carry
        update = {**x, **y, **self._keyed(Z, z), **est}
        if self.aggregate_buffers:
            update.update(buffers)
        outer_loss, inner_loss = losses if losses is not None else (0.0, 0.0)
        init = [
            p.data["init_inner"].shape[-1] + p.data["init_outer"].shape[-1] if n_init else 0
            for p in cohort.prepared
        ]
        return cohort.replies(
            update,
            {
                "inner_loss": inner_loss,
                "outer_loss": outer_loss,
                "local_steps": torch.tensor(cohort.num_steps, dtype=torch.float64)
                if cohort.stacked
                else float(cohort.num_steps[0]),
            },
            n_grad=[n_init + n for n in n_grad],
            n_hvp=0,
            samples=[
                i + s for i, s in zip(init, cohort.step_samples("inner", "outer"), strict=True)
            ],
        )

    def _initial_estimates(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        x: Params,
        y: Params,
        z: Params,
        buffers: Params,
        indices: tuple[torch.Tensor, ...],
    ) -> Params:
        """Alg. 1 line 1: the estimators set to the minibatch gradient at the received point,
        on the inner and outer example ``indices``."""
        inner_batch, outer_batch = (runtime.batch(i) for i in indices)
        outer, inner = cohort.bind(runtime.problem, module, buffers, inner_batch, outer_batch)
        oracle = penalty_gradients(outer, inner, x, y, z, self.penalty, lead=cohort.lead)
        return self._estimates(oracle.parts)

    def _local_steps(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        start: tuple[Params, Params, Params, Params, Params],
        step_data: Callable[[str, int], torch.Tensor],
        steps: int | list[int],
        counts: torch.Tensor | None = None,
    ) -> LocalSteps[tuple[Any, ...]]:
        """Alg. 1's local iterations ``steps`` times from ``start = (x, y, z, estimators,
        buffers)`` (each client its number; or ``steps`` times, each client masked past its
        entry of ``counts``, a tensor on the device), iteration t on the example indices
        ``step_data("inner", t)`` and ``step_data("outer", t)``; the carry ends as ``(x, y,
        z, estimators, buffers, (f, g))``."""
        lead = cohort.lead
        problem = runtime.problem
        lam, a = self.penalty, self.momentum
        per_step = 3 if a == 1.0 else 6

        def step(t: int, carry: tuple[Any, ...]) -> tuple[tuple[Any, ...], Work]:
            x, y, z, est, buffers, _ = carry
            inner_batch = runtime.batch(step_data("inner", t))
            outer_batch = runtime.batch(step_data("outer", t))
            if buffers:  # BatchNorm running statistics follow the local training batches
                with torch.no_grad():
                    cohort.loss(problem.inner_loss, module, x, z, buffers, inner_batch)
            m_x, m_y, m_z = self.directions(est)
            x_new = axpy(-self.alpha_x * self.eta, m_x, x)
            y_new = axpy(-self.alpha_y * self.eta, m_y, y)
            z_new = axpy(-self.alpha_z * self.eta, m_z, z)
            outer, inner = cohort.bind(problem, module, buffers, inner_batch, outer_batch)
            new = penalty_gradients(outer, inner, x_new, y_new, z_new, lam, lead=lead)
            fresh = self._estimates(new.parts)
            if per_step == 3:  # a = 1: the estimator is the fresh minibatch gradient
                est = fresh
            else:  # the STORM correction: the oracle at the old point on the same minibatch
                prev = self._estimates(
                    penalty_gradients(outer, inner, x, y, z, lam, lead=lead).parts
                )
                est = {k: (1.0 - a) * (est[k] - prev[k]) + fresh[k] for k in est}
            return (x_new, y_new, z_new, est, buffers, (new.f, new.g)), Work(n_grad=per_step)

        # clients past their p_n keep what they had
        x, y, z, est, buffers = start
        carry = (x, y, z, est, buffers, None)
        return local_steps(step, carry, steps, name="fedsvrbgd.step", counts=counts)

    def server(
        self,
        state: FedSVRBGDState,
        results: Sequence[ClientResult],
        index_sets: Sequence[IndexSet],
        weights: Sequence[float],
    ) -> tuple[FedSVRBGDState, dict[str, float]]:
        """Alg. 1 line 9: the coverage-weighted averages of x, y, z and the estimators
        (coordinates nobody holds stay); buffers averaged."""
        metrics = {
            "inner_loss": mean_metric(results, "inner_loss"),
            "outer_loss": mean_metric(results, "outer_loss"),
            "local_steps_mean": mean_metric(results, "local_steps"),
        }
        if not results:
            return replace(state, round=state.round + 1), metrics
        current = self._wire(state)
        shapes = {k: t.shape for k, t in current.items()}
        wire_sets = [self._wire_index(idx) for idx in index_sets]
        updates = [r.update for r in results]
        averaged = apply_mean(current, coverage_weighted_mean(updates, wire_sets, shapes, weights))
        buffers = state.buffers
        if self.aggregate_buffers:
            buffers = average_buffers(buffers, updates, index_sets, weights)
        new = replace(
            state,
            x={n: averaged[n] for n in self.outer_names},
            y={n: averaged[n] for n in self.inner_names},
            z={n: averaged[f"{Z}:{n}"] for n in self.inner_names},
            estimators={k: averaged[k] for k in state.estimators},
            buffers=buffers,
            round=state.round + 1,
            primed=True,
        )
        return new, metrics
