"""FedNest and LFedNest: federated bilevel optimization by alternating federated SVRG on y, a
federated inverse-Hessian-gradient product (IHGP) and federated SVRG on x.

Paper: Tarzanagh, Li, Thrampoulidis and Oymak, "FedNest: Federated Bilevel, Minimax, and
Compositional Optimization", ICML 2022 (PMLR 162:21146-21179), arXiv:2205.02215. It is not in
``papers/``: radbo follows its public description -- Alg. 1 (FedNest), Alg. 2 (FedOut), Alg. 3
(FedIHGP), Alg. 4 (FedInn), Algs. 5 and 6 (the light LFedOut / LFedInn) and Table 2 (which
combination is which method, and its communication rounds), the IHGP estimator as quoted in
``papers/fedmbo.txt`` Sec. 3.2, and the authors' public code (github.com/ucr-optml/FedNest),
read, not copied. Algorithm steps are cited by content, not by line number.

**FedNest** (``name = "fednest"``). Outer iteration k (Alg. 1) at ``(x, y) = (x^k, y^k)``:

1. FedInn (Alg. 4), called T times (``inner_steps``), two communication rounds each:
   ``inner.<t>.anchor`` -- each sampled client i returns ``q_i = ∇_y g_i(x, y^{k,t}; ζ_i)``; the
   server forms the global gradient ``q = mean_i q_i``. ``inner.<t>.local`` -- each sampled
   client runs τ_i SVRG-corrected local steps from ``y_{i,0} = y^{k,t}``::

       y_{i,ν+1} = y_{i,ν} − β (∇_y g_i(x, y_{i,ν}; ζ_ν) − ∇_y g_i(x, y^{k,t}; ζ_ν) + q)

   (both gradients on the step's minibatch ζ_ν) and the server averages the local models:
   ``y^{k,t+1} = mean_i y_{i,τ_i}``.
2. FedIHGP (Alg. 3) at ``(x, y^{k+1})``, ``1 + N'`` rounds: ``ihgp.0`` -- clients return
   ``∇_y f_i(x, y; θ_i)``; the server sets ``p_0 = (N/ℓ) mean_i ∇_y f_i`` and draws the
   truncation ``N' ~ U{0, ..., N−1}``. ``ihgp.<n>`` for n = 1..N' -- freshly sampled clients
   return ``(I − ∇²_yy g_i(x, y; ζ_{i,n}) / ℓ) p_{n−1}``; ``p_n`` is their mean. So
   ``p = (N/ℓ) Π_{n=1}^{N'} (I − mean_{i∈S_n} ∇²_yy g_i / ℓ) mean_{i∈S_0} ∇_y f_i``, whose
   expectation over N' is the N-term Neumann series ``(1/ℓ) Σ_{j<N} (I − H/ℓ)^j ∇_y f`` of
   ``H^{-1} ∇_y f`` (``papers/fedmbo.txt`` eqs. (4)-(5)). Rounds past N' are skipped.
3. FedOut (Alg. 2), two rounds: ``outer.hypergrad`` -- clients return
   ``h_i = ∇_x f_i(x, y; φ_i) − ∇²_xy g_i(x, y; ζ_i) p``; the server forms ``h = mean_i h_i``.
   ``outer.local`` -- each sampled client runs ``outer_local_steps`` SVRG-corrected steps
   from ``x_{i,0} = x``::

       x_{i,ν+1} = x_{i,ν} − α (∇_x f_i(x_{i,ν}, y; ξ_ν) − ∇_x f_i(x, y; ξ_ν) + h)

   and ``x^{k+1} = mean_i x_{i,τ}``. As in the paper's FedOut and its code, the local
   correction differences the direct gradient only: the indirect part ``−∇²_xy g p`` enters
   through ``h``, computed once at ``x`` (a local step needs no Hessian product).

An iteration costs ``2T + N' + 3`` communication rounds (N' ≤ N − 1 drawn per iteration);
Table 2 of the paper bounds it by ``2T + N + 3``.

**LFedNest** (``name = "lfednest"``, Table 2: Alg. 5 on x, Alg. 6 on y; no global gradient, no
global IHGP). ``inner.<t>`` for t < T -- LFedInn: plain local SGD
``y_{i,ν+1} = y_{i,ν} − β ∇_y g_i(x, y_{i,ν}; ζ_ν)``, server average. ``outer`` -- LFedOut:
each client runs ``outer_local_steps`` steps ``x_{i,ν+1} = x_{i,ν} − α h_{i,ν}`` on its *local*
hypergradient ``h_{i,ν} = ∇_x f_i(x_{i,ν}, y) − ∇²_xy g_i(x_{i,ν}, y) p_{i,ν}`` with its local
IHGP ``p_{i,ν} = (N/ℓ) (I − ∇²_yy g_i(x_{i,ν}, y)/ℓ)^{N'_{i,ν}} ∇_y f_i(x_{i,ν}, y)``
(``N'_{i,ν} ~ U{0..N−1}`` drawn by the client); the server averages the local models. No
intermediate product is communicated: ``T + 1`` rounds per iteration, as in Table 2.

``eta`` is ``1/ℓ`` (``ℓ = ℓ_{g,1}`` bounds the curvature of g in y); ``N`` is
``neumann_terms``.

**Where radbo deviates, and why.**

* Sampling. Each communication round samples its own ``clients_per_phase`` clients without
  replacement among those still in the round, as FedMBO does (all of them when ``None``); the
  paper keeps one sample S through a FedInn call and through FedOut. The local SVRG phases need
  nothing from the previous round but the server's aggregate (each client evaluates both
  gradients of its correction itself), so a fresh sample is still an SVRG step.
* Minibatches. The paper draws an independent sample per stochastic term. Here the two
  gradients of an SVRG correction share the step's minibatch (as SVRG requires); in LFedOut
  one outer minibatch per local step serves ``∇_x f`` and ``∇_y f``, and one inner minibatch
  serves the step's N' Hessian products and its mixed product (one linearization instead of
  N' + 1; the public code uses the client's full data for all of them).
* Failures, as FedMBO. A client that drops out or sends an unsound update (NaN, Inf, wrong
  shape) is left out of its round's mean. A round whose predecessor got no sound reply is
  skipped: no q, no local y steps in that FedInn call; no p, no hypergradient and x stays.
  A Neumann round with no sound reply ends the chain at its current length (the later
  ``ihgp.<n>`` rounds are skipped, as if N' had been drawn smaller).
* ``max_hypergrad_norm`` (off by default; the paper has none) clips h (FedNest) or each local
  hypergradient (LFedNest) to that norm.

FedNest and LFedNest train the full model on every client: use them without masks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from radbo.aggregation import apply_step, coverage_weighted_mean, step_inner
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
    TensorTuple,
    axpy,
    loss_grads,
    params_norm,
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
from radbo.randomness import Stream, generator
from radbo.typing import BilevelLoss, IndexSet, Params

__all__ = ["FedNest", "FedNestConfig", "FedNestState", "LFedNest", "LFedNestConfig"]

#: wire prefixes: the global inner gradient q and the IHGP vector p (shaped like y), the
#: global hypergradient h (shaped like x)
Q, P, H = "q", "p", "h"
#: the carry key of the IHGP truncation N' (an int64 scalar, kept on the server)
TERMS = "terms"

Selector = Callable[["FedNestState", Sequence[int], torch.Generator], list[int]]
Broadcast = Callable[["FedNestState", IndexSet, int], Params]


@dataclass(frozen=True)
class FedNestState:
    """Global state: x, y and buffers, plus what one round of an iteration hands to the next.

    ``carry`` holds ``"q:<y name>"`` (FedInn's global gradient), ``"p:<y name>"`` and
    ``"terms"`` (the IHGP vector and its truncation N') or ``"h:<x name>"`` (FedOut's global
    hypergradient); it is empty between iterations.
    """

    x: Params
    y: Params
    buffers: Params
    round: int = 0
    carry: Params = field(default_factory=dict)


@ALGORITHMS.register
class FedNestConfig(AlgorithmConfig):
    """FedNest hyperparameters (Algs. 1-4 of Tarzanagh et al., ICML 2022, arXiv:2205.02215;
    see :mod:`radbo.algorithms.fednest`), which LFedNest (:class:`LFedNestConfig`) shares. The
    defaults are the settings ``tests/algorithms/test_fednest.py`` runs on the digits
    hyper-representation task (the public code's MNIST settings -- steps 0.01, 5 local epochs
    of batch 64 -- make many more local steps)."""

    name: Literal["fednest"]
    inner_lr: StepSize = Field(
        0.5,
        gt=0,
        allow_inf_nan=False,
        description="beta, the clients' local step on y (<= 1000 without --force)",
    )
    outer_lr: StepSize = Field(
        0.3,
        gt=0,
        allow_inf_nan=False,
        description="alpha, the clients' local step on x (<= 1000 without --force)",
    )
    inner_steps: Steps = Field(
        1, ge=1, description="T, FedInn calls per outer iteration (<= 10,000 without --force)"
    )
    local_steps: Steps = Field(
        5,
        ge=1,
        description="tau, local steps on y per FedInn call (fleet.local_steps = 'fixed'; "
        "<= 10,000 without --force)",
    )
    outer_local_steps: Steps = Field(
        5, ge=1, description="local steps on x in FedOut (<= 10,000 without --force)"
    )
    batch_size: BatchSize = Field(
        32, ge=1, description="inner minibatch of each g gradient / product"
    )
    outer_batch_size: BatchSize = Field(32, ge=1, description="outer minibatch of each f gradient")
    neumann_terms: Steps = Field(
        5,
        ge=1,
        description="N: the IHGP truncation N' is uniform on {0, ..., N-1} "
        "(<= 10,000 without --force)",
    )
    eta: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="1 / l_g,1, the Neumann step of the IHGP (<= 1000 without --force)",
    )
    clients_per_phase: int | None = Field(
        None, ge=1, description="clients sampled per communication round; default all available"
    )
    max_hypergrad_norm: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="clip the (global or local) hypergradient to this norm; off by default",
    )

    estimator_uses: ClassVar[tuple[str, ...]] = ("products",)
    default_estimator: ClassVar[str | None] = "autograd"
    full_model: ClassVar[bool] = True

    @property
    def local_steps_default(self) -> int:
        return self.local_steps

    def build(self, wiring: Wiring) -> FedNest:
        return self.bind(FedNest, wiring, seed=wiring.seed)


class FedNest(FedNestConfig, AlgorithmBase):
    """FedNest (Alg. 1 with FedInn Alg. 4, FedIHGP Alg. 3 and FedOut Alg. 2).

    Args (besides the hyperparameters of :class:`FedNestConfig`):
        outer_names / inner_names / buffer_names: which model tensors are x, y and buffers.
        inner_lr: β, the local step on y (FedInn).
        outer_lr: α, the local step on x (FedOut).
        inner_steps: T, FedInn calls (two communication rounds each) per iteration.
        local_steps: τ, local steps on y of each client per FedInn call (the client's budget
            when the fleet sets local steps).
        outer_local_steps: local steps on x of each client in FedOut.
        batch_size / outer_batch_size: the minibatches of g and of f.
        neumann_terms: N; the IHGP runs N' ~ U{0..N-1} Neumann rounds.
        eta: ``1/ℓ_{g,1}``, the Neumann step.
        clients_per_phase: clients sampled per communication round (``None``: all available).
        max_hypergrad_norm: optional clipping of the global hypergradient h.
        estimator: the Hessian- and Jacobian-vector products (default autograd).
        seed: seeds the server's draws of N' (one stream per iteration).
        aggregate_buffers: clients return BatchNorm running statistics with their local y
            steps and the server averages them.
    """

    name: Literal["fednest"] = "fednest"
    estimator: Estimator = Field(default_factory=Autograd)
    seed: int = 0

    # -- state -------------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> FedNestState:
        return FedNestState(x=clone(x), y=clone(y), buffers=clone(buffers))

    def phases(self) -> Sequence[Phase[FedNestState]]:
        y_keys, x_keys = self.reply_keys(self.inner_names), self.reply_keys(self.outer_names)
        p_keys = self.reply_keys(prefixed(P, self.inner_names))
        anchor = ClientWork(self.run_inner_gradient, self.prepare_inner, y_keys)
        local_y = ClientWork(
            self.run_local_y, self.prepare_local_y, self.reply_keys(self.inner_names, buffers=True)
        )
        grad_f_y = ClientWork(self.run_outer_gradient_y, self.prepare_outer, p_keys)
        neumann_step = ClientWork(self.run_neumann_step, self.prepare_inner, p_keys)
        hypergrad = ClientWork(self.run_hypergradient, self.prepare_pair, x_keys)
        local_x = ClientWork(self.run_local_x, self.prepare_local_x, x_keys)
        inner: list[Phase[FedNestState]] = []
        for t in range(self.inner_steps):
            inner += [
                Phase(f"inner.{t}.anchor", self.broadcast, anchor, self.server_anchor, self.sample),
                Phase(
                    f"inner.{t}.local",
                    self.carry_broadcast(Q),
                    local_y,
                    self.server_local_y,
                    self.sample_if(Q),
                ),
            ]
        neumann = [
            Phase(
                f"ihgp.{n}",
                self.carry_broadcast(P),
                neumann_step,
                self.neumann_server(n),
                self.neumann_select(n),
            )
            for n in range(1, self.neumann_terms)
        ]
        return (
            *inner,
            Phase("ihgp.0", self.broadcast, grad_f_y, self.server_ihgp_init, self.sample),
            *neumann,
            Phase(
                "outer.hypergrad",
                self.carry_broadcast(P),
                hypergrad,
                self.server_hypergrad,
                self.sample_if(P),
            ),
            Phase(
                "outer.local",
                self.carry_broadcast(H),
                local_x,
                self.server_local_x,
                self.sample_if(H),
            ),
        )

    # -- who takes part ------------------------------------------------------------------------
    def sample(
        self, state: FedNestState, candidates: Sequence[int], generator: torch.Generator
    ) -> list[int]:
        """``clients_per_phase`` of the round's remaining clients, drawn uniformly without
        replacement (all of them, in random order, when ``None`` or fewer remain)."""
        return draw_clients(candidates, self.clients_per_phase, generator)

    def sample_if(self, prefix: str) -> Selector:
        """A fresh sample when the previous round left its aggregate ``prefix`` in the carry,
        nobody otherwise (the round is skipped)."""

        def select(
            state: FedNestState, candidates: Sequence[int], generator: torch.Generator
        ) -> list[int]:
            if not any(k.startswith(f"{prefix}:") for k in state.carry):
                return []
            return self.sample(state, candidates, generator)

        return select

    def neumann_select(self, level: int) -> Selector:
        """Neumann round ``level`` runs while ``level <= N'`` (and the chain is alive)."""

        def select(
            state: FedNestState, candidates: Sequence[int], generator: torch.Generator
        ) -> list[int]:
            terms = state.carry.get(TERMS)
            if terms is None or level > int(terms):
                return []
            return self.sample(state, candidates, generator)

        return select

    # -- broadcasts ------------------------------------------------------------------------------
    def broadcast(self, state: FedNestState, index_set: IndexSet, slot: int = 0) -> Params:
        """The full model (x, y) and buffers."""
        return dict(self.model_state(state))

    def carry_broadcast(self, prefix: str) -> Broadcast:
        """The full model and the carried aggregate ``prefix`` (q, p or h)."""

        def broadcast(state: FedNestState, index_set: IndexSet, slot: int = 0) -> Params:
            carried = {k: t for k, t in state.carry.items() if k.startswith(f"{prefix}:")}
            return {**self.model_state(state), **carried}

        return broadcast

    # -- client helpers --------------------------------------------------------------------------
    def _grads(
        self,
        loss: BilevelLoss,
        name: str,
        x: Params,
        y: Params,
        *,
        wrt_x: bool,
        wrt_y: bool,
        lead: int,
        value: list[torch.Tensor] | None = None,
    ) -> tuple[Params, Params]:
        """Named first-order gradients of ``loss`` at ``(x, y)`` (one gradient evaluation)."""
        gx, gy = loss_grads(
            loss,
            name,
            tuple(x),
            tuple(x.values()),
            tuple(y),
            tuple(y.values()),
            wrt_x=wrt_x,
            wrt_y=wrt_y,
            lead=lead,
            value=value,
        )
        return dict(zip(x, gx, strict=False)), dict(zip(y, gy, strict=False))

    def _clip(self, h: Params, lead: int) -> Params:
        if self.max_hypergrad_norm is None:
            return h
        return project_ball(h, self.max_hypergrad_norm, lead)  # clipping = projection

    # -- FedInn (Alg. 4) and LFedInn (Alg. 6) ----------------------------------------------------
    def prepare_inner(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """One inner minibatch ζ."""
        gen = task.generator()
        idx = runtime.sampler.inner(task.data, self.batch_size, gen)
        return Prepared(data={"inner": idx}, ragged=frozenset({"inner"}))

    def run_inner_gradient(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """q_i = ∇_y g_i(x, y; ζ_i), the client's share of FedInn's global gradient."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        idx = cohort.data("inner")
        batch = runtime.batch(idx)
        _, inner = cohort.bind(runtime.problem, module, buffers, batch, batch)
        value: list[torch.Tensor] = []
        _, grad_y = self._grads(
            inner, "inner_loss", x, y, wrt_x=False, wrt_y=True, lead=cohort.lead, value=value
        )
        return cohort.replies(
            grad_y, {"inner_loss": value[0]}, n_grad=1, samples=cohort.sizes("inner")
        )

    def server_anchor(self, state, results, index_sets, weights):
        """q = mean_i q_i, carried to the local round (none: the local round is skipped)."""
        metrics = {"inner_loss": mean_metric(results, "inner_loss")}
        if not results:
            return replace(state, carry={}), metrics
        shapes = {n: t.shape for n, t in state.y.items()}
        q = coverage_weighted_mean([r.update for r in results], index_sets, shapes, weights).mean
        return replace(state, carry={f"{Q}:{n}": t for n, t in q.items()}), metrics

    def prepare_local_y(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """An inner minibatch for each of the client's τ_i local steps."""
        gen = task.generator()
        steps = task.budget.local_steps
        draws = runtime.sampler.inner_steps(task.data, self.batch_size, steps, gen)
        return Prepared(steps={"inner": draws}, num_steps=steps, ragged=frozenset({"inner"}))

    def run_local_y(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """τ_i local steps on y: SVRG-corrected by the server's q when it sent one (FedInn),
        plain SGD otherwise (LFedInn). Returns the summed directions ``D_i`` (so that
        ``y_{i,τ} = y − β D_i``) and, with ``aggregate_buffers``, the BatchNorm statistics. A
        stacked cohort replays its steps from a CUDA graph where the runtime has them
        (:meth:`~radbo.client.Cohort.run_steps`)."""
        module, x, y0, buffers = self.client_tensors(runtime, cohort)
        svrg = cohort.has(f"{Q}:{self.inner_names[0]}")
        q = {n: cohort.param(f"{Q}:{n}") for n in self.inner_names} if svrg else {}
        # a frozen algorithm (inner_lr) and the module skeleton: the capture's key (q's
        # presence is the inputs' structure)
        key = ("fednest.local_y", id(self), id(module))
        run = partial(self._local_y_steps, runtime, cohort, module)
        draws = [("inner", self.batch_size)]
        done = cohort.run_steps(runtime, key, (x, y0, q, buffers), draws, run)
        carry, first = done.carry
        n_grad = done.n_grad
        _, total, buffers = carry
        update = dict(total)
        if self.aggregate_buffers:
            update.update(buffers)
        return cohort.replies(
            update,
            {"inner_loss": first},
            n_grad=n_grad,
            samples=cohort.step_samples("inner"),
        )

    def _local_y_steps(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        state: tuple[Params, Params, Params, Params],
        step_data: Callable[[str, int], torch.Tensor],
        steps: int | list[int],
        counts: torch.Tensor | None = None,
    ) -> LocalSteps[tuple[tuple[Params, Params, Params], Any]]:
        """:meth:`run_local_y`'s steps from ``state = (x, y0, q, buffers)``'s y0
        (SVRG-corrected where ``q`` is not empty; each client its number of steps, or
        ``steps`` times, each client masked past its entry of ``counts``, a tensor on the
        device), step t on the example indices ``step_data("inner", t)``; the steps' carry is
        the final ``(y, D, buffers)`` and g at the first step (0 without steps)."""
        x, y0, q, buffers = state
        lead = cohort.lead
        svrg = bool(q)
        first: list[Any] = []  # g at the first step
        per_step = 2 if svrg else 1

        def step(t: int, carry: tuple[Params, Params, Params]) -> tuple[Any, Work]:
            y, total, buffers = carry
            batch = runtime.batch(step_data("inner", t))
            if buffers:  # BatchNorm running statistics follow the local training batches
                with torch.no_grad():
                    cohort.loss(runtime.problem.inner_loss, module, x, y, buffers, batch)
            _, inner = cohort.bind(runtime.problem, module, buffers, batch, batch)
            value: list[torch.Tensor] = []
            _, d = self._grads(
                inner, "inner_loss", x, y, wrt_x=False, wrt_y=True, lead=lead, value=value
            )
            if not first:
                first.append(value[0])
            if svrg:  # ∇g_i(y_ν; ζ_ν) − ∇g_i(y_0; ζ_ν) + q
                _, anchor = self._grads(
                    inner, "inner_loss", x, y0, wrt_x=False, wrt_y=True, lead=lead
                )
                d = axpy(1.0, q, axpy(-1.0, anchor, d))
            return (axpy(-self.inner_lr, d, y), axpy(1.0, d, total), buffers), Work(per_step)

        # clients past their τ_i keep what they had
        total = {n: torch.zeros_like(t) for n, t in y0.items()}
        start = (y0, total, buffers)
        done = local_steps(step, start, steps, name="fednest.local_y", counts=counts)
        return LocalSteps((done.carry, first[0] if first else 0.0), done.n_grad, done.n_hvp)

    def server_local_y(self, state, results, index_sets, weights):
        """y <- y − β mean_i D_i = mean_i y_{i,τ_i}; buffers averaged; the carry is spent."""
        metrics = {"inner_loss": mean_metric(results, "inner_loss")}
        if not results:
            return replace(state, carry={}), metrics
        y, buffers = step_inner(
            state.y,
            state.buffers,
            [r.update for r in results],
            index_sets,
            weights,
            self.inner_lr,
            with_buffers=self.aggregate_buffers,
        )
        return replace(state, y=y, buffers=buffers, carry={}), metrics

    # -- FedIHGP (Alg. 3) ------------------------------------------------------------------------
    def prepare_outer(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """One outer minibatch θ."""
        gen = task.generator()
        idx = runtime.sampler.outer(task.data, self.outer_batch_size, gen)
        return Prepared(data={"outer": idx}, ragged=frozenset({"outer"}))

    def run_outer_gradient_y(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """∇_y f_i(x, y; θ_i), the client's share of p_0."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        idx = cohort.data("outer")
        batch = runtime.batch(idx)
        outer, _ = cohort.bind(runtime.problem, module, buffers, batch, batch)
        value: list[torch.Tensor] = []
        _, grad_y = self._grads(
            outer, "outer_loss", x, y, wrt_x=False, wrt_y=True, lead=cohort.lead, value=value
        )
        update = {f"{P}:{n}": t for n, t in grad_y.items()}
        return cohort.replies(
            update, {"outer_loss": value[0]}, n_grad=1, samples=cohort.sizes("outer")
        )

    def _carried_mean(self, prefix: str, like: Params, results, index_sets, weights) -> Params:
        shapes = {f"{prefix}:{n}": t.shape for n, t in like.items()}
        updates = [r.update for r in results]
        return coverage_weighted_mean(updates, index_sets, shapes, weights).mean

    def server_ihgp_init(self, state, results, index_sets, weights):
        """p_0 = (N/ℓ) mean_i ∇_y f_i and the truncation N' ~ U{0..N−1} (drawn from the
        algorithm's stream of this iteration whether or not anyone answered)."""
        gen = generator(self.seed, state.round, Stream.NEUMANN_TERMS)
        terms = torch.randint(0, self.neumann_terms, (), generator=gen, dtype=torch.int64)
        metrics = {"outer_loss": mean_metric(results, "outer_loss"), "neumann_terms": float(terms)}
        # the iteration counter moves here, so that it moves even when the IHGP is lost
        state = replace(state, round=state.round + 1, carry={})
        if not results:
            return state, metrics
        mean = self._carried_mean(P, state.y, results, index_sets, weights)
        scale = self.neumann_terms * self.eta
        carry: Params = {k: scale * t for k, t in mean.items()}
        carry[TERMS] = terms
        return replace(state, carry=carry), metrics

    def run_neumann_step(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """(I − ∇²_yy g_i(x, y; ζ)/ℓ) p, one product with the server's p."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        idx = cohort.data("inner")
        batch = runtime.batch(idx)
        _, inner = cohort.bind(runtime.problem, module, buffers, batch, batch)
        system = self.estimator.linearize(inner, x, y, lead=cohort.lead, with_x=False)
        p = tuple(cohort.param(f"{P}:{n}") for n in self.inner_names)
        hp = system.hvp(p)
        update = {
            f"{P}:{n}": pi - self.eta * hi
            for n, pi, hi in zip(self.inner_names, p, hp, strict=True)
        }
        return cohort.replies(
            update, n_grad=system.n_grad, n_hvp=system.n_hvp, samples=cohort.sizes("inner")
        )

    def neumann_server(self, level: int):
        def server(state, results, index_sets, weights):
            """p_level = mean of the answers; none: the chain ends at ``level − 1`` terms."""
            carry = dict(state.carry)
            if not results:
                carry[TERMS] = torch.tensor(level - 1, dtype=torch.int64)
                return replace(state, carry=carry), {"ihgp_chain_cut": float(level)}
            carry.update(self._carried_mean(P, state.y, results, index_sets, weights))
            return replace(state, carry=carry), {}

        return server

    # -- FedOut (Alg. 2) -------------------------------------------------------------------------
    def prepare_pair(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """An inner minibatch ζ (for the mixed product) and an outer one φ (for ∇_x f)."""
        inner, outer = runtime.sampler.pair(
            task.data, self.batch_size, self.outer_batch_size, task.generator()
        )
        return Prepared(data={"inner": inner, "outer": outer}, ragged=frozenset({"inner", "outer"}))

    def run_hypergradient(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """h_i = ∇_x f_i(x, y; φ) − ∇²_xy g_i(x, y; ζ) p with the server's IHGP vector p."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        inner_idx, outer_idx = cohort.data("inner"), cohort.data("outer")
        outer, inner = cohort.bind(
            runtime.problem, module, buffers, runtime.batch(inner_idx), runtime.batch(outer_idx)
        )
        value: list[torch.Tensor] = []
        grad_x, _ = self._grads(
            outer, "outer_loss", x, y, wrt_x=True, wrt_y=False, lead=cohort.lead, value=value
        )
        system = self.estimator.linearize(inner, x, y, lead=cohort.lead, with_x=True)
        jp = system.mixed(tuple(cohort.param(f"{P}:{n}") for n in self.inner_names))
        update = {n: grad_x[n] - j for n, j in zip(self.outer_names, jp, strict=True)}
        return cohort.replies(
            update,
            {"outer_loss": value[0]},
            n_grad=system.n_grad + 1,
            n_hvp=system.n_hvp,
            samples=cohort.sizes("inner", "outer"),
        )

    def server_hypergrad(self, state, results, index_sets, weights):
        """h = mean_i h_i (clipped when asked), carried to the local round."""
        metrics = {"outer_loss": mean_metric(results, "outer_loss")}
        if not results:
            return replace(state, carry={}), metrics
        shapes = {n: t.shape for n, t in state.x.items()}
        h = coverage_weighted_mean([r.update for r in results], index_sets, shapes, weights).mean
        metrics["hypergrad_norm"] = float(params_norm(h))
        h = self._clip(h, 0)
        return replace(state, carry={f"{H}:{n}": t for n, t in h.items()}), metrics

    def prepare_local_x(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """An outer minibatch ξ for each of the ``outer_local_steps`` local steps."""
        gen = task.generator()
        steps = self.outer_local_steps
        draws = runtime.sampler.outer_steps(task.data, self.outer_batch_size, steps, gen)
        return Prepared(steps={"outer": draws}, num_steps=steps, ragged=frozenset({"outer"}))

    def run_local_x(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """SVRG-corrected local steps on x with the server's h; returns the summed directions
        ``D_i`` (``x_{i,τ} = x − α D_i``). A stacked cohort replays its steps from a CUDA
        graph where the runtime has them (:meth:`~radbo.client.Cohort.run_steps`)."""
        module, x0, y, buffers = self.client_tensors(runtime, cohort)
        h = {n: cohort.param(f"{H}:{n}") for n in self.outer_names}
        # a frozen algorithm (outer_lr) and the module skeleton: the capture's key
        key = ("fednest.local_x", id(self), id(module))
        run = partial(self._local_x_steps, runtime, cohort, module)
        draws = [("outer", self.outer_batch_size)]
        done = cohort.run_steps(runtime, key, (x0, y, h, buffers), draws, run)
        carry, n_grad = done.carry, done.n_grad
        _, total = carry
        return cohort.replies(
            total,
            n_grad=n_grad,
            samples=cohort.step_samples("outer"),
        )

    def _local_x_steps(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: torch.nn.Module,
        state: tuple[Params, Params, Params, Params],
        step_data: Callable[[str, int], torch.Tensor],
        steps: int | list[int],
        counts: torch.Tensor | None = None,
    ) -> LocalSteps[tuple[Params, Params]]:
        """:meth:`run_local_x`'s steps from ``state = (x0, y, h, buffers)``'s x0 (each client
        its number of steps, or ``steps`` times, each client masked past its entry of
        ``counts``, a tensor on the device), step t on the example indices
        ``step_data("outer", t)``; the carry ends as ``(x, D)``."""
        x0, y, h, buffers = state
        lead = cohort.lead

        def step(t: int, carry: tuple[Params, Params]) -> tuple[tuple[Params, Params], Work]:
            x, total = carry
            batch = runtime.batch(step_data("outer", t))
            outer, _ = cohort.bind(runtime.problem, module, buffers, batch, batch)
            g, _ = self._grads(outer, "outer_loss", x, y, wrt_x=True, wrt_y=False, lead=lead)
            g0, _ = self._grads(outer, "outer_loss", x0, y, wrt_x=True, wrt_y=False, lead=lead)
            d = axpy(1.0, h, axpy(-1.0, g0, g))  # ∇f_i(x_ν; ξ_ν) − ∇f_i(x_0; ξ_ν) + h
            return (axpy(-self.outer_lr, d, x), axpy(1.0, d, total)), Work(n_grad=2)

        total = {n: torch.zeros_like(t) for n, t in x0.items()}
        return local_steps(step, (x0, total), steps, name="fednest.local_x", counts=counts)

    def server_local_x(self, state, results, index_sets, weights):
        """x <- x − α mean_i D_i = mean_i x_{i,τ}; the carry is spent."""
        if not results:
            return replace(state, carry={}), {}
        shapes = {n: t.shape for n, t in state.x.items()}
        agg = coverage_weighted_mean([r.update for r in results], index_sets, shapes, weights)
        return replace(state, x=apply_step(state.x, agg, self.outer_lr), carry={}), {}


@ALGORITHMS.register
class LFedNestConfig(FedNestConfig):
    """LFedNest hyperparameters (Table 2 of Tarzanagh et al.): FedNest's."""

    # its own tag: FedNest's narrowed to a kind of its own, which the type checker calls unsafe
    name: Literal["lfednest"]  # type: ignore[assignment]

    def build(self, wiring: Wiring) -> LFedNest:
        return self.bind(LFedNest, wiring, seed=wiring.seed)


class LFedNest(LFedNestConfig, FedNest):
    """LFedNest (Table 2: LFedInn Alg. 6 on y, LFedOut Alg. 5 on x): local SGD on y, local
    hypergradients with local IHGPs on x; ``T + 1`` communication rounds per iteration."""

    name: Literal["lfednest"] = "lfednest"  # type: ignore[assignment]

    def phases(self) -> Sequence[Phase[FedNestState]]:
        local_y = ClientWork(
            self.run_local_y, self.prepare_local_y, self.reply_keys(self.inner_names, buffers=True)
        )
        local_hyper = ClientWork(
            self.run_local_hypergradient,
            self.prepare_local_hypergradient,
            self.reply_keys(self.outer_names),
        )
        inner = [
            Phase(f"inner.{t}", self.broadcast, local_y, self.server_local_y, self.sample)
            for t in range(self.inner_steps)
        ]
        return (
            *inner,
            Phase("outer", self.broadcast, local_hyper, self.server_local_outer, self.sample),
        )

    def prepare_local_hypergradient(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """The truncations N'_{i,ν} ~ U{0..N−1} of the ``outer_local_steps`` local IHGPs (drawn
        first), then per step an inner minibatch ζ (products) and an outer one ξ (f)."""
        gen = task.generator()
        steps = self.outer_local_steps
        terms = torch.randint(0, self.neumann_terms, (steps,), generator=gen, dtype=torch.int64)
        inner, outer = runtime.sampler.pair_steps(
            task.data, self.batch_size, self.outer_batch_size, steps, gen
        )
        return Prepared(
            steps={"terms": terms, "inner": inner, "outer": outer},
            num_steps=steps,
            ragged=frozenset({"inner", "outer"}),
        )

    def run_local_hypergradient(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """Local steps ``x <- x − α h_i(x)`` with the client's own hypergradient and IHGP
        (Alg. 5); returns the summed hypergradients ``D_i`` (``x_{i,τ} = x − α D_i``)."""
        lead = cohort.lead
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        first: list[Any] = []  # f at the first step
        scale = self.neumann_terms * self.eta

        def step(t: int, carry: tuple[Params, Params]) -> tuple[tuple[Params, Params], Work]:
            x, total = carry
            outer, inner = cohort.bind(
                runtime.problem,
                module,
                buffers,
                runtime.batch(cohort.step_data("inner", t)),
                runtime.batch(cohort.step_data("outer", t)),
            )
            value: list[torch.Tensor] = []
            grad_x, grad_y = self._grads(
                outer, "outer_loss", x, y, wrt_x=True, wrt_y=True, lead=lead, value=value
            )
            if not first:
                first.append(value[0])
            system = self.estimator.linearize(inner, x, y, lead=lead, with_x=True)
            base = (system.n_grad, system.n_hvp)
            terms = [int(n) for n in cohort.numbers(cohort.step_data("terms", t))]  # N' each

            def level(k: int, p: TensorTuple) -> tuple[TensorTuple, Work]:
                hp = system.hvp(p)
                return tuple(pi - self.eta * hi for pi, hi in zip(p, hp, strict=True)), Work()

            # N' products per client: a client past its own N' keeps its p
            p = tuple(scale * grad_y[n] for n in self.inner_names)
            p = local_steps(level, p, terms, name="fednest.neumann").carry
            before = (system.n_grad, system.n_hvp)
            jp = system.mixed(p)
            per_product = (system.n_grad - before[0], system.n_hvp - before[1])
            h = self._clip(
                {n: grad_x[n] - j for n, j in zip(self.outer_names, jp, strict=True)}, lead
            )
            # what each client would have done alone: f's gradient, the linearization, its own
            # N' products and the mixed one
            work = Work(
                [1 + base[0] + (n + 1) * per_product[0] for n in terms],
                [base[1] + (n + 1) * per_product[1] for n in terms],
            )
            return (axpy(-self.outer_lr, h, x), axpy(1.0, h, total)), work

        # the number of products differs from step to step (a random N'): no repeated block
        total = {n: torch.zeros_like(t) for n, t in x.items()}
        steps = cohort.local_steps(step, (x, total), name="lfednest.outer", uniform=False)
        _, total = steps.carry
        return cohort.replies(
            total,
            {"outer_loss": first[0] if first else 0.0},
            n_grad=steps.n_grad,
            n_hvp=steps.n_hvp,
            samples=cohort.step_samples("inner", "outer"),
        )

    def server_local_outer(self, state, results, index_sets, weights):
        """x <- x − α mean_i D_i = mean_i x_{i,τ}; the iteration counter moves."""
        metrics = {"outer_loss": mean_metric(results, "outer_loss")}
        state = replace(state, round=state.round + 1)
        if not results:
            return state, metrics
        shapes = {n: t.shape for n, t in state.x.items()}
        agg = coverage_weighted_mean([r.update for r in results], index_sets, shapes, weights)
        return replace(state, x=apply_step(state.x, agg, self.outer_lr)), metrics
