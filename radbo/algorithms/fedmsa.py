"""FedMSA: federated multi-sequence stochastic approximation (Alg. 1 of the FedMSA paper).

Paper: Tarzanagh, Li, Sharma and Oymak, "Federated Multi-Sequence Stochastic Approximation with
Local Hypergradient Estimation", arXiv:2306.01648 (``papers/fedmsa.txt``).

Applied to bilevel problems (Sec. 2.2) the sequences are the inner variable w (radbo's y) and
the linear-system variable v, and the two maps are (eq. (10))::

    S(x, w, v) = [ ∇_w g(x, w) ;  ∇²_ww g(x, w) v - ∇_w f(x, w) ]        (fixed point: w*, v*)
    P(x, w, v) = ∇_x f(x, w) - ∇²_xw g(x, w) v                          (= ∇f(x) there)

Each round r has two communication rounds:

1. ``train.momentum`` -- every sampled client m evaluates the maps at the current and the
   previous server points on one shared sample and returns the momentum (STORM-type)
   directions of eq. (5): ``h^m = P(x_r, Z_r) + (1 - ρ)(h_{r-1} - P(x_{r-1}, Z_{r-1}))`` and
   likewise ``q^m`` from S; the server averages them into ``(h_r, q_r)`` (Alg. 1 lines 5-8).
2. ``train.local`` -- the server sends ``(x_r, Z_r, h_r, q_r)`` to one client drawn uniformly
   (line 9), which runs K local steps with SARAH-type directions (eq. (6)),
   ``h_{r,k} = P(x_{r+1,k}, Z_{r+1,k}) + h_{r,k-1} - P(x_{r+1,k-1}, Z_{r+1,k-1})`` (both on
   one sample ξ_{r,k}), ``x <- x - α h_{r,k}``, ``w <- w - β_w q^w_{r,k}``,
   ``v <- v - β_v q^v_{r,k}`` (lines 10-16); its final point is the new server point (line
   17). In round 0, ρ = 1 and K = 1 (line 4).

**Typo in the printed eq. (10a).** Its second row prints ``∇²_w g v - ∇_x f``: the term must be
shaped like w, and with the minus sign of eq. (10b) the fixed point must solve
``∇²_ww g v = ∇_w f`` for P to be the hypergradient (eq. (8)-(9)). radbo uses ``∇_w f``.

Line 9's one chosen client is drawn among the clients sampled for the round (all available
ones by default). If it drops out or sends an unsound update, the round leaves the point
unchanged. FedMSA trains the full model on every client: use it without masks. Sample sharing:
eq. (5) evaluates both points on the same ξ_r^m (that is what makes the difference a variance
reduction), so does radbo; ``f`` and ``g`` use the client's outer and inner minibatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from radbo.algorithms.base import (
    ALGORITHMS,
    AlgorithmBase,
    AlgorithmConfig,
    Wiring,
    clone,
    prefixed,
)
from radbo.autodiff import axpy, bilevel_directions
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
from radbo.loops import Work
from radbo.typing import BilevelLoss, IndexSet, Params

__all__ = ["FedMSA", "FedMSAConfig", "FedMSAState"]

#: wire prefixes: v (shaped like y), the previous point, the directions h (x) and q (y, v)
V, PREV, H, QW, QV = "v", "prev", "h", "qw", "qv"
#: the number of local steps K, sent with the local phase
STEPS = "local_steps"


@dataclass(frozen=True)
class FedMSAState:
    """Server point (x, y = w, v), the previous point, and the directions (h, q_w, q_v)."""

    x: Params
    y: Params
    v: Params
    buffers: Params
    prev_x: Params
    prev_y: Params
    prev_v: Params
    h: Params
    q_w: Params
    q_v: Params
    round: int = 0


@ALGORITHMS.register
class FedMSAConfig(AlgorithmConfig):
    """FedMSA baseline (Alg. 1 with eq. (10) of ``papers/fedmsa.txt``): momentum directions
    from all sampled clients, then K local variance-reduced steps on one of them."""

    name: Literal["fedmsa"]
    outer_lr: StepSize = Field(
        0.05, gt=0, allow_inf_nan=False, description="alpha (<= 1000 without --force)"
    )
    inner_lr: StepSize = Field(
        0.1, gt=0, allow_inf_nan=False, description="beta_w (<= 1000 without --force)"
    )
    v_lr: StepSize = Field(
        0.1, gt=0, allow_inf_nan=False, description="beta_v (<= 1000 without --force)"
    )
    momentum: float = Field(0.5, ge=0, le=1, allow_inf_nan=False, description="rho")
    local_steps: Steps = Field(5, ge=1, description="K (<= 10,000 without --force)")
    batch_size: BatchSize = Field(32, ge=1, description="inner minibatch per evaluation")
    outer_batch_size: BatchSize = Field(32, ge=1, description="outer minibatch per evaluation")

    estimator_uses: ClassVar[tuple[str, ...]] = ("products",)
    default_estimator: ClassVar[str | None] = "autograd"
    full_model: ClassVar[bool] = True
    flower_actions: ClassVar[tuple[str, ...]] = ("momentum", "local")
    step_sizes: ClassVar[tuple[str, ...]] = ("inner_lr", "outer_lr", "v_lr")

    @property
    def local_steps_default(self) -> int:
        return self.local_steps

    def build(self, wiring: Wiring) -> FedMSA:
        return self.bind(FedMSA, wiring)


class FedMSA(FedMSAConfig, AlgorithmBase):
    """FedMSA for bilevel problems (Alg. 1 with eq. (10) of ``papers/fedmsa.txt``).

    Args (besides the hyperparameters of :class:`FedMSAConfig`):
        outer_names / inner_names / buffer_names: which model tensors are x, w (= y), buffers.
        outer_lr: α, the local step on x (line 14).
        inner_lr: β_w, the local step on w (line 15).
        v_lr: β_v, the local step on v (line 15).
        momentum: ρ in [0, 1] of eq. (5) (1: no momentum).
        local_steps: K, the local steps of the chosen client (line 12).
        batch_size / outer_batch_size: minibatches of g and f per evaluation.
        estimator: the second-order products of the maps (default autograd).
        aggregate_buffers: the chosen client returns its BatchNorm running statistics.
    """

    name: Literal["fedmsa"] = "fedmsa"
    estimator: Estimator = Field(default_factory=Autograd)

    # -- state ---------------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> FedMSAState:
        """(x_0, Z_0) with v_0 = 0; the previous point is the initial one (line 2)."""
        zeros = lambda d: {k: torch.zeros_like(t) for k, t in d.items()}  # noqa: E731
        return FedMSAState(
            x=clone(x),
            y=clone(y),
            v=zeros(y),
            buffers=clone(buffers),
            prev_x=clone(x),
            prev_y=clone(y),
            prev_v=zeros(y),
            h=zeros(x),
            q_w=zeros(y),
            q_v=zeros(y),
        )

    def phases(self) -> Sequence[Phase[FedMSAState]]:
        return (
            Phase(
                "train.momentum",
                self.broadcast_momentum,
                ClientWork(
                    self.run_momentum,
                    self.prepare_momentum,
                    self.reply_keys(
                        prefixed(H, self.outer_names),
                        prefixed(QW, self.inner_names),
                        prefixed(QV, self.inner_names),
                    ),
                ),
                self.server_momentum,
            ),
            Phase(
                "train.local",
                self.broadcast_local,
                ClientWork(
                    self.run_local,
                    self.prepare_local,
                    self.reply_keys(
                        self.outer_names,
                        self.inner_names,
                        prefixed(V, self.inner_names),
                        buffers=True,
                    ),
                ),
                self.server_local,
                self.choose_one,
            ),
        )

    # -- the maps of eq. (10) ------------------------------------------------------------------
    def maps(
        self, outer: BilevelLoss, inner: BilevelLoss, x: Params, w: Params, v: Params, lead: int
    ) -> tuple[Params, Params, Params, tuple[int, int], Any, Any]:
        """``(P, S_w, S_v)`` at ``(x, w, v)``, the (gradient, product) counts and the values of
        f and g: :func:`radbo.autodiff.bilevel_directions` with the estimator's products."""
        system = self.estimator.linearize(inner, x, w, lead=lead)
        d = bilevel_directions(system, outer, x, w, v)
        return d.x, d.y, d.v, (d.n_grad, d.n_hvp), d.f, d.g

    def _losses(
        self, runtime: ClientRuntime, cohort: Cohort, module: Any, buffers: Params, step: int | None
    ) -> tuple[BilevelLoss, BilevelLoss, Any]:
        if step is None:
            inner_batch = runtime.batch(cohort.data("inner"))
            outer_batch = runtime.batch(cohort.data("outer"))
        else:
            inner_batch = runtime.batch(cohort.step_data("inner", step))
            outer_batch = runtime.batch(cohort.step_data("outer", step))
        outer, inner = cohort.bind(runtime.problem, module, buffers, inner_batch, outer_batch)
        return outer, inner, inner_batch

    def _cohort_point(self, cohort: Cohort, prefix: str = "") -> tuple[Params, Params, Params]:
        x = {n: cohort.param(f"{prefix}{n}") for n in self.outer_names}
        w = {n: cohort.param(f"{prefix}{n}") for n in self.inner_names}
        v = {n: cohort.param(f"{prefix}{V}:{n}") for n in self.inner_names}
        return x, w, v

    # -- phase 1: momentum directions (eq. (5)) ---------------------------------------------
    def broadcast_momentum(self, state: FedMSAState, index_set: IndexSet, slot: int = 0) -> Params:
        """Current and previous points and the previous directions."""
        out: Params = {**self.model_state(state), **{f"{V}:{k}": t for k, t in state.v.items()}}
        if state.round > 0:
            out.update({f"{PREV}:{k}": t for k, t in {**state.prev_x, **state.prev_y}.items()})
            out.update({f"{PREV}:{V}:{k}": t for k, t in state.prev_v.items()})
            out.update({f"{H}:{k}": t for k, t in state.h.items()})
            out.update({f"{QW}:{k}": t for k, t in state.q_w.items()})
            out.update({f"{QV}:{k}": t for k, t in state.q_v.items()})
        return out

    def _draw_pair(
        self, runtime: ClientRuntime, task: ClientTask, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return runtime.sampler.pair(task.data, self.batch_size, self.outer_batch_size, gen)

    def prepare_momentum(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """One sample ξ_r^m (an inner and an outer minibatch), shared by both points."""
        inner, outer = self._draw_pair(runtime, task, task.generator())
        return Prepared(data={"inner": inner, "outer": outer}, ragged=frozenset({"inner", "outer"}))

    def run_momentum(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """h^m, q^m of eq. (5) on one sample shared by both points (ρ = 1 in round 0)."""
        lead = cohort.lead
        module = cohort.module(runtime)
        buffers = cohort.params(self.buffer_names)
        outer, inner, _ = self._losses(runtime, cohort, module, buffers, None)
        p, s_w, s_v, (n_grad, n_hvp), f_value, g_value = self.maps(
            outer, inner, *self._cohort_point(cohort), lead
        )
        first = not cohort.has(f"{H}:{self.outer_names[0]}")  # round 0: nothing before
        rho = 1.0 if first else self.momentum
        if rho < 1.0:
            prev = self._cohort_point(cohort, f"{PREV}:")
            p0, s_w0, s_v0, counts, _, _ = self.maps(outer, inner, *prev, lead)
            n_grad, n_hvp = n_grad + counts[0], n_hvp + counts[1]
            h_prev = {n: cohort.param(f"{H}:{n}") for n in self.outer_names}
            qw_prev = {n: cohort.param(f"{QW}:{n}") for n in self.inner_names}
            qv_prev = {n: cohort.param(f"{QV}:{n}") for n in self.inner_names}
            p = axpy(1.0 - rho, axpy(-1.0, p0, h_prev), p)
            s_w = axpy(1.0 - rho, axpy(-1.0, s_w0, qw_prev), s_w)
            s_v = axpy(1.0 - rho, axpy(-1.0, s_v0, qv_prev), s_v)
        update = {
            **{f"{H}:{k}": t for k, t in p.items()},
            **{f"{QW}:{k}": t for k, t in s_w.items()},
            **{f"{QV}:{k}": t for k, t in s_v.items()},
        }
        samples = cohort.sizes("inner", "outer")
        return cohort.replies(
            update,
            {"outer_loss": f_value, "inner_loss": g_value},
            n_grad=n_grad,
            n_hvp=n_hvp,
            samples=samples,
        )

    def server_momentum(self, state, results, index_sets, weights):
        """(h_r, q_r) = the weighted mean of the clients' directions (line 8)."""
        metrics = {
            "outer_loss": mean_metric(results, "outer_loss"),
            "inner_loss": mean_metric(results, "inner_loss"),
        }
        total = float(sum(weights))
        if not results or total <= 0:
            return state, metrics

        def mean(prefix: str, names: Sequence[str]) -> Params:
            return {
                n: sum(w * r.update[f"{prefix}:{n}"] for r, w in zip(results, weights, strict=True))
                / total
                for n in names
            }

        return (
            replace(
                state,
                h=mean(H, self.outer_names),
                q_w=mean(QW, self.inner_names),
                q_v=mean(QV, self.inner_names),
            ),
            metrics,
        )

    # -- phase 2: K local steps on one client (eq. (6)) ------------------------------------
    def choose_one(self, state, candidates, generator) -> list[int]:
        """Line 9: one client drawn uniformly."""
        if not candidates:
            return []
        return [candidates[int(torch.randint(len(candidates), (1,), generator=generator))]]

    def broadcast_local(self, state: FedMSAState, index_set: IndexSet, slot: int = 0) -> Params:
        """The point, the directions and K (1 in round 0, line 4)."""
        steps = 1 if state.round == 0 else self.local_steps
        return {
            STEPS: torch.tensor(steps, dtype=torch.int64),
            **self.model_state(state),
            **{f"{V}:{k}": t for k, t in state.v.items()},
            **{f"{H}:{k}": t for k, t in state.h.items()},
            **{f"{QW}:{k}": t for k, t in state.q_w.items()},
            **{f"{QV}:{k}": t for k, t in state.q_v.items()},
        }

    def prepare_local(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """A fresh sample ξ_{r,k} for each local step k = 1..K-1 (step 0 moves along the
        server's directions)."""
        gen = task.generator()
        steps = int(task.params[STEPS])
        pairs = [self._draw_pair(runtime, task, gen) for _ in range(steps - 1)]
        if not pairs:
            return Prepared(num_steps=0)
        data = {
            "inner": torch.stack([i for i, _ in pairs]),
            "outer": torch.stack([o for _, o in pairs]),
        }
        return Prepared(steps=data, num_steps=len(pairs), ragged=frozenset(data))

    def run_local(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """Lines 10-16: SARAH-type directions and K steps from the server point."""
        lead = cohort.lead
        module = cohort.module(runtime)
        buffers = cohort.params(self.buffer_names, clone=True)
        x, w, v = self._cohort_point(cohort)
        h = {n: cohort.param(f"{H}:{n}") for n in self.outer_names}
        q_w = {n: cohort.param(f"{QW}:{n}") for n in self.inner_names}
        q_v = {n: cohort.param(f"{QV}:{n}") for n in self.inner_names}

        def move(
            x: Params, w: Params, v: Params, h: Params, q_w: Params, q_v: Params
        ) -> tuple[Params, Params, Params]:
            return (
                axpy(-self.outer_lr, h, x),
                axpy(-self.inner_lr, q_w, w),
                axpy(-self.v_lr, q_v, v),
            )

        def step(t: int, carry: tuple[Any, ...]) -> tuple[tuple[Any, ...], Work]:
            x, w, v, h, q_w, q_v, buffers, previous = carry
            outer, inner, inner_batch = self._losses(runtime, cohort, module, buffers, t)
            if buffers:  # BatchNorm running statistics follow the local training batches
                with torch.no_grad():
                    cohort.loss(runtime.problem.inner_loss, module, x, w, buffers, inner_batch)
            p1, sw1, sv1, c1, _, _ = self.maps(outer, inner, x, w, v, lead)
            px, pw, pv = previous
            p0, sw0, sv0, c0, _, _ = self.maps(outer, inner, px, pw, pv, lead)
            h = axpy(1.0, axpy(-1.0, p0, p1), h)
            q_w = axpy(1.0, axpy(-1.0, sw0, sw1), q_w)
            q_v = axpy(1.0, axpy(-1.0, sv0, sv1), q_v)
            work = Work(c1[0] + c0[0], c1[1] + c0[1])
            return (*move(x, w, v, h, q_w, q_v), h, q_w, q_v, buffers, (x, w, v)), work

        # step 0 moves along the server's directions; then K - 1 steps on fresh samples, a
        # client past its K keeping what it had ((x, w, v) before the move: ``previous``)
        start = (*move(x, w, v, h, q_w, q_v), h, q_w, q_v, buffers, (x, w, v))
        steps = cohort.local_steps(step, start, name="fedmsa.step")
        x, w, v, h, q_w, q_v, buffers, _ = steps.carry
        update = {**x, **w, **{f"{V}:{k}": t for k, t in v.items()}}
        if self.aggregate_buffers:
            update.update(buffers)
        return cohort.replies(
            update,
            {"local_steps": [float(n + 1) for n in cohort.num_steps]},
            n_grad=steps.n_grad,
            n_hvp=steps.n_hvp,
            samples=cohort.step_samples("inner", "outer"),
        )

    def server_local(self, state, results, index_sets, weights):
        """Line 17: the chosen client's final point is the new server point."""
        moved = replace(
            state, prev_x=state.x, prev_y=state.y, prev_v=state.v, round=state.round + 1
        )
        if not results:
            return moved, {}
        u = results[0].update
        return (
            replace(
                moved,
                x={n: u[n] for n in self.outer_names},
                y={n: u[n] for n in self.inner_names},
                v={n: u[f"{V}:{n}"] for n in self.inner_names},
                buffers={**state.buffers, **{n: u[n] for n in self.buffer_names if n in u}},
            ),
            {},
        )
