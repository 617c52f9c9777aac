"""FedMBO: minibatch federated bilevel optimization (Alg. 1 + PHE Alg. 2 of the FedMBO paper).

Paper: Huang, Zhang and Ji, "Achieving Linear Speedup in Non-IID Federated Bilevel
Learning", ICML 2023, arXiv:2302.05412 (``papers/fedmbo.txt``).

One outer iteration k is a sequence of communication rounds, each with its own sample of n
clients (Alg. 1 line 5, Alg. 2 lines 1, 9, 19):

1. ``inner.t`` for t = 0..T-1 -- minibatch SGD on y (Alg. 1 lines 3-13, Sec. 3.1): every
   sampled client returns one minibatch gradient ``G_i = ∇_y g_i(x^k, y^{k,t}; S_i)``; the
   server steps ``y^{k,t+1} = y^{k,t} - β mean_i G_i``. No local steps, hence no client drift.
2. ``phe.init`` -- Alg. 2 lines 1-7: client slot i returns ``d_i = ∇_x f_i(x^k, y^{k+1}; φ^i)``
   and ``p_{i,0} = (N/ℓ) ∇_y f_i(x^k, y^{k+1}; θ^i)``; the server keeps both per chain i and
   draws ``N_i`` uniformly from {0, ..., N-1}.
3. ``phe.l`` for l = 1..N-1 -- Alg. 2 lines 8-18: the chains with ``l <= N_i`` go to freshly
   sampled clients, each returning ``p_{i,l} = (I - ∇²_yy g_c(x^k, y^{k+1}; ζ)/ℓ) p_{i,l-1}``.
   A round in which no chain is still running is skipped (not counted as communication).
4. ``phe.final`` -- Alg. 2 lines 19-23: each chain goes to one more fresh client, which returns
   ``∇²_xy g_c(x^k, y^{k+1}; ω) p_{i,N_i}``; the server forms
   ``H_i = d_i - ∇²_xy g p_{i,N_i}`` (eq. (6)), ``h = mean_i H_i`` and steps
   ``x^{k+1} = x^k - α h`` (Alg. 1 lines 14-16).

So an iteration costs ``T + max_i N_i + 2`` communication rounds. ``E[N/ℓ Π (I - H/ℓ)]``
over ``N_i`` is the N-term Neumann series of ``H^{-1}`` (eq. (4)-(5)), with bias
``(1 - μ/ℓ)^N / μ``; ``eta`` below is ``1/ℓ``.

**Typo in the printed Alg. 2.** Line 4 prints ``d_i = ∇_y f``; eq. (6), which the line
implements, has ``∇_x f_{c_i^0}(x^k, y^{k+1}; φ^i)``, which is also what ``H_i - d_i`` must be
added to for a hypergradient of x. radbo uses eq. (6).

**Partial participation and failures.** Clients are sampled without replacement from those
available this round, ``clients_per_phase`` per communication round (all available when
``None``). A chain whose client drops out or sends an unsound update ends; the final mean is
over the chains that finished (the iteration leaves x unchanged if none did). FedMBO trains the
full model on every client: use it without masks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from radbo.aggregation import step_inner
from radbo.algorithms.base import (
    ALGORITHMS,
    AlgorithmBase,
    AlgorithmConfig,
    Wiring,
    clone,
    draw_clients,
    prefixed,
)
from radbo.autodiff import axpy, loss_grads, params_norm, project_ball, scalar
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
from radbo.randomness import Stream, generator
from radbo.typing import IndexSet, Params

__all__ = ["FedMBO", "FedMBOConfig", "FedMBOState"]

#: prefix of a Neumann chain's vector p (shaped like y) on the wire
P = "p"


@dataclass(frozen=True)
class FedMBOState:
    """Global state: x, y and buffers, plus the PHE chains of the current iteration.

    ``chains`` holds, stacked over the ``n`` chains of Alg. 2, ``"d:<x name>"`` (the direct
    terms d_i), ``"p:<y name>"`` (the vectors p_i), ``"terms"`` (N_i, int64) and ``"alive"``
    (bool: the chain has not lost a client); it is empty between iterations.
    """

    x: Params
    y: Params
    buffers: Params
    round: int = 0
    chains: Params = field(default_factory=dict)


@ALGORITHMS.register
class FedMBOConfig(AlgorithmConfig):
    """FedMBO baseline (Alg. 1 + PHE Alg. 2 of ``papers/fedmbo.txt``): full model, minibatch
    SGD on y and a randomized Neumann hypergradient built across freshly sampled clients."""

    name: Literal["fedmbo"]
    inner_lr: StepSize = Field(
        0.1, gt=0, allow_inf_nan=False, description="beta (<= 1000 without --force)"
    )
    outer_lr: StepSize = Field(
        0.1, gt=0, allow_inf_nan=False, description="alpha (<= 1000 without --force)"
    )
    inner_steps: Steps = Field(
        5, ge=1, description="T, minibatch-SGD rounds on y (<= 10,000 without --force)"
    )
    batch_size: BatchSize = Field(32, ge=1, description="S")
    outer_batch_size: BatchSize = Field(32, ge=1, description="minibatch of d_i and p_i,0")
    neumann_terms: Steps = Field(10, ge=1, description="N (<= 10,000 without --force)")
    eta: StepSize = Field(
        0.1, gt=0, allow_inf_nan=False, description="1 / l_g,1 (<= 1000 without --force)"
    )
    clients_per_phase: int | None = Field(None, ge=1, description="n; default all available")
    max_hypergrad_norm: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="clip h to this norm before the x step (off)"
    )

    estimator_uses: ClassVar[tuple[str, ...]] = ("products",)
    default_estimator: ClassVar[str | None] = "autograd"
    full_model: ClassVar[bool] = True

    @property
    def local_steps_default(self) -> int:
        return self.inner_steps

    def build(self, wiring: Wiring) -> FedMBO:
        return self.bind(FedMBO, wiring, seed=wiring.seed)


class FedMBO(FedMBOConfig, AlgorithmBase):
    """FedMBO (Alg. 1 with the PHE estimator, Alg. 2, of ``papers/fedmbo.txt``).

    Args (besides the hyperparameters of :class:`FedMBOConfig`):
        outer_names / inner_names / buffer_names: which model tensors are x, y and buffers.
        inner_lr: β, the server's SGD step on y (Alg. 1 line 11).
        outer_lr: α, the step on x (line 16).
        inner_steps: T, minibatch-SGD communication rounds on y per iteration.
        batch_size: S, the minibatch of each inner gradient and of each Hessian-vector
            product.
        outer_batch_size: the minibatch of ∇_x f and ∇_y f in ``phe.init``.
        neumann_terms: N, the truncation of the randomized Neumann series (N_i < N).
        eta: ``1/ℓ_{g,1}``, the Neumann step (``ℓ_{g,1}`` bounds the curvature of g in y).
        clients_per_phase: n, clients sampled per communication round (and number of PHE
            chains); ``None``: every client available in the round.
        max_hypergrad_norm: optional clipping of h before the x step (off by default; the
            paper has none).
        estimator: each chain step's Hessian- or Jacobian-vector product (default autograd).
        seed: seeds the draws of N_i (one stream per iteration).
        aggregate_buffers: clients return BatchNorm running statistics with their inner
            gradients and the server averages them.
    """

    name: Literal["fedmbo"] = "fedmbo"
    estimator: Estimator = Field(default_factory=Autograd)
    seed: int = 0

    # -- state -------------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> FedMBOState:
        return FedMBOState(x=clone(x), y=clone(y), buffers=clone(buffers))

    def phases(self) -> Sequence[Phase[FedMBOState]]:
        p_keys = prefixed(P, self.inner_names)
        gradient = ClientWork(
            self.run_gradient, self.prepare_inner, self.reply_keys(self.inner_names, buffers=True)
        )
        neumann_step = ClientWork(
            self.run_neumann_step, self.prepare_inner, self.reply_keys(p_keys)
        )
        mixed = ClientWork(self.run_mixed, self.prepare_inner, self.reply_keys(self.outer_names))
        phe_init = ClientWork(
            self.run_phe_init, self.prepare_phe_init, self.reply_keys(self.outer_names, p_keys)
        )
        inner = [
            Phase(f"inner.{t}", self.broadcast, gradient, self.server_inner, self.sample)
            for t in range(self.inner_steps)
        ]
        steps = [
            Phase(
                f"phe.{level}",
                self.chain_broadcast(level),
                neumann_step,
                self.chain_server(level),
                self.chain_select(level),
            )
            for level in range(1, self.neumann_terms)
        ]
        return (
            *inner,
            Phase("phe.init", self.broadcast, phe_init, self.server_phe_init, self.sample),
            *steps,
            Phase(
                "phe.final",
                self.chain_broadcast(None),
                mixed,
                self.server_final,
                self.chain_select(None),
            ),
        )

    # -- who takes part ------------------------------------------------------------------------
    def sample(
        self, state: FedMBOState, candidates: Sequence[int], generator: torch.Generator
    ) -> list[int]:
        """A fresh sample of n clients for one communication round (Alg. 1 line 5)."""
        return draw_clients(candidates, self.clients_per_phase, generator)

    def running(self, state: FedMBOState, level: int | None) -> list[int]:
        """The chains that take part in round ``level`` (``None``: the final round)."""
        if not state.chains:
            return []
        alive = state.chains["alive"]
        if level is None:
            return [i for i in range(alive.numel()) if bool(alive[i])]
        terms = state.chains["terms"]
        return [i for i in range(alive.numel()) if bool(alive[i]) and int(terms[i]) >= level]

    def chain_select(
        self, level: int | None
    ) -> Callable[[FedMBOState, Sequence[int], torch.Generator], list[int]]:
        def select(
            state: FedMBOState, candidates: Sequence[int], generator: torch.Generator
        ) -> list[int]:
            return draw_clients(candidates, len(self.running(state, level)), generator)

        return select

    # -- broadcasts ------------------------------------------------------------------------------
    def broadcast(self, state: FedMBOState, index_set: IndexSet, slot: int = 0) -> Params:
        """The full model (x^k, y^{k,t}) and buffers."""
        return {k: t for k, t in self.model_state(state).items()}

    def chain_broadcast(self, level: int | None) -> Callable[[FedMBOState, IndexSet, int], Params]:
        def broadcast(state: FedMBOState, index_set: IndexSet, slot: int = 0) -> Params:
            chain = self.running(state, level)[slot]
            p = {f"{P}:{n}": state.chains[f"{P}:{n}"][chain] for n in self.inner_names}
            return {**self.model_state(state), **p}

        return broadcast

    # -- clients -------------------------------------------------------------------------------
    def prepare_inner(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """One inner minibatch of S examples."""
        gen = task.generator()
        idx = runtime.sampler.inner(task.data, self.batch_size, gen)
        return Prepared(data={"inner": idx}, ragged=frozenset({"inner"}))

    def run_gradient(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """One minibatch gradient of g_i in y (Alg. 1 line 8)."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        idx = cohort.data("inner")
        y_var = {n: t.clone().requires_grad_(True) for n, t in y.items()}
        loss = cohort.loss(
            runtime.problem.inner_loss, module, x, y_var, buffers, runtime.batch(idx)
        )
        grads = torch.autograd.grad(scalar("inner_loss", loss, cohort.lead), list(y_var.values()))
        update = dict(zip(y_var, (g.detach() for g in grads), strict=True))
        if self.aggregate_buffers:
            update.update(buffers)
        return cohort.replies(
            update, {"inner_loss": loss.detach()}, n_grad=1, samples=cohort.sizes("inner")
        )

    def prepare_phe_init(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """The outer minibatches φ (for d_i) and θ (for p_i,0)."""
        gen = task.generator()
        phi = runtime.sampler.outer(task.data, self.outer_batch_size, gen)
        theta = runtime.sampler.outer(task.data, self.outer_batch_size, gen)
        return Prepared(data={"phi": phi, "theta": theta}, ragged=frozenset({"phi", "theta"}))

    def run_phe_init(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """d_i = ∇_x f_i (batch φ) and p_{i,0} = (N/ℓ) ∇_y f_i (batch θ) (Alg. 2 lines 3-5)."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        phi, theta = cohort.data("phi"), cohort.data("theta")
        batch_phi, batch_theta = runtime.batch(phi), runtime.batch(theta)
        outer_phi, _ = cohort.bind(runtime.problem, module, buffers, batch_phi, batch_phi)
        outer_theta, _ = cohort.bind(runtime.problem, module, buffers, batch_phi, batch_theta)
        xn, yn = tuple(x), tuple(y)
        value: list[torch.Tensor] = []
        d, _ = loss_grads(
            outer_phi,
            "outer_loss",
            xn,
            tuple(x.values()),
            yn,
            tuple(y.values()),
            wrt_x=True,
            wrt_y=False,
            lead=cohort.lead,
            value=value,
        )
        _, grad_y = loss_grads(
            outer_theta,
            "outer_loss",
            xn,
            tuple(x.values()),
            yn,
            tuple(y.values()),
            wrt_x=False,
            wrt_y=True,
            lead=cohort.lead,
        )
        scale = self.neumann_terms * self.eta
        update = {
            **dict(zip(xn, d, strict=True)),
            **{f"{P}:{n}": scale * g for n, g in zip(yn, grad_y, strict=True)},
        }
        samples = cohort.sizes("phi", "theta")
        return cohort.replies(update, {"outer_loss": value[0]}, n_grad=2, samples=samples)

    def _chain_product(
        self, runtime: ClientRuntime, cohort: Cohort, mixed: bool
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], dict[str, Any]]:
        """One second-order product of g_c with the chain's p on an inner minibatch: the
        Hessian ``∇²_yy g p`` or the mixed ``∇²_xy g p``; returns it with the work counts."""
        module, x, y, buffers = self.client_tensors(runtime, cohort)
        idx = cohort.data("inner")
        batch = runtime.batch(idx)
        _, inner = cohort.bind(runtime.problem, module, buffers, batch, batch)
        system = self.estimator.linearize(inner, x, y, lead=cohort.lead, with_x=mixed)
        p = tuple(cohort.param(f"{P}:{n}") for n in self.inner_names)
        product = system.mixed(p) if mixed else system.hvp(p)
        counts = {"n_grad": system.n_grad, "n_hvp": system.n_hvp, "samples": cohort.sizes("inner")}
        return p, product, counts

    def run_neumann_step(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """p <- (I - ∇²_yy g_c(ζ)/ℓ) p, one product of the chain (Alg. 2 line 13)."""
        p, hp, counts = self._chain_product(runtime, cohort, mixed=False)
        update = {
            f"{P}:{n}": pi - self.eta * hi
            for n, pi, hi in zip(self.inner_names, p, hp, strict=True)
        }
        return cohort.replies(update, **counts)

    def run_mixed(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """∇²_xy g_c(ω) p_{i,N_i} (Alg. 2 line 22; the server subtracts it from d_i)."""
        _, jp, counts = self._chain_product(runtime, cohort, mixed=True)
        return cohort.replies(dict(zip(self.outer_names, jp, strict=True)), **counts)

    # -- servers -------------------------------------------------------------------------------
    def server_inner(self, state, results, index_sets, weights):
        """y <- y - β mean_i G_i (Alg. 1 lines 10-11); buffers averaged."""
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

    def server_phe_init(self, state, results, index_sets, weights):
        """Start one chain per result: d_i, p_{i,0}, N_i ~ U{0..N-1} (Alg. 2 lines 1-7)."""
        n = len(results)
        gen = generator(self.seed, state.round, Stream.NEUMANN_TERMS)
        terms = torch.randint(0, self.neumann_terms, (n,), generator=gen, dtype=torch.int64)
        metrics = {"outer_loss": mean_metric(results, "outer_loss")}
        # the iteration counter moves here, so that it moves even when no chain finishes
        state = replace(state, round=state.round + 1, chains={})
        if n == 0:
            return state, metrics
        chains: Params = {"terms": terms, "alive": torch.ones(n, dtype=torch.bool)}
        for name in self.outer_names:
            chains[f"d:{name}"] = torch.stack([r.update[name] for r in results])
        for name in self.inner_names:
            key = f"{P}:{name}"
            chains[key] = torch.stack([r.update[key] for r in results])
        metrics["neumann_max_terms"] = float(terms.max())
        return replace(state, chains=chains), metrics

    def chain_server(self, level: int):
        def server(state, results, index_sets, weights):
            """p_{i,l} for the chains that got an answer; the others end."""
            running = self.running(state, level)
            chains = dict(state.chains)
            alive = chains["alive"].clone()
            answered = {r.slot: r for r in results}
            for slot, chain in enumerate(running):
                r = answered.get(slot)
                if r is None:
                    alive[chain] = False
                    continue
                for name in self.inner_names:
                    key = f"{P}:{name}"
                    stacked = chains[key].clone()
                    stacked[chain] = r.update[key]
                    chains[key] = stacked
            chains["alive"] = alive
            # chains live within one iteration: none left means nothing for phe.final to do
            return replace(state, chains=chains if bool(alive.any()) else {}), {}

        return server

    def server_final(self, state, results, index_sets, weights):
        """H_i = d_i - ∇²_xy g p_i (eq. (6)); x <- x - α mean_i H_i (Alg. 1 lines 15-16)."""
        running = self.running(state, None)
        answered = {r.slot: r for r in results}
        finished = [
            (chain, answered[slot]) for slot, chain in enumerate(running) if slot in answered
        ]
        x = state.x
        metrics: dict[str, float] = {"phe_chains_finished": float(len(finished))}
        if finished:
            h = {
                name: torch.stack(
                    [state.chains[f"d:{name}"][chain] - r.update[name] for chain, r in finished]
                ).mean(0)
                for name in self.outer_names
            }
            metrics["hypergrad_norm"] = float(params_norm(h))
            if self.max_hypergrad_norm is not None:
                h = project_ball(h, self.max_hypergrad_norm)  # clipping = projection
            x = axpy(-self.outer_lr, h, state.x)
        return replace(state, x=x, chains={}), metrics
