"""FedMSA: federated multi-sequence stochastic approximation (Alg. 1 of ``papers/fedmsa.txt``).

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

import torch

from radbo.aggregation import axpy
from radbo.hypergrad import ImplicitSystem
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


@dataclass(frozen=True)
class FedMSA:
    """FedMSA for bilevel problems (Alg. 1 with eq. (10) of ``papers/fedmsa.txt``).

    Args:
        outer_names / inner_names / buffer_names: which model tensors are x, w (= y), buffers.
        outer_lr: α, the local step on x (line 14).
        inner_lr: β_w, the local step on w (line 15).
        v_lr: β_v, the local step on v (line 15).
        momentum: ρ in [0, 1] of eq. (5) (1: no momentum).
        local_steps: K, the local steps of the chosen client (line 12).
        batch_size / outer_batch_size: minibatches of g and f per evaluation.
        aggregate_buffers: the chosen client returns its BatchNorm running statistics.
    """

    outer_names: tuple[str, ...]
    inner_names: tuple[str, ...]
    buffer_names: tuple[str, ...] = ()
    outer_lr: float = 0.05
    inner_lr: float = 0.1
    v_lr: float = 0.1
    momentum: float = 0.5
    local_steps: int = 5
    batch_size: int = 32
    outer_batch_size: int = 32
    aggregate_buffers: bool = True
    name: str = "fedmsa"

    def __post_init__(self) -> None:
        for name in ("outer_lr", "inner_lr", "v_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FedMSA.{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"FedMSA.momentum must be in [0, 1], got {self.momentum}")
        for name in ("local_steps", "batch_size", "outer_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"FedMSA.{name} must be >= 1, got {getattr(self, name)}")
        if set(self.outer_names) & set(self.inner_names):
            raise ValueError("outer and inner parameter names must be disjoint")

    # -- state ---------------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> FedMSAState:
        """(x_0, Z_0) with v_0 = 0; the previous point is the initial one (line 2)."""
        clone = lambda d: {k: t.detach().clone() for k, t in d.items()}  # noqa: E731
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

    def model_state(self, state: FedMSAState) -> Params:
        return {**state.x, **state.y, **state.buffers}

    def phases(self) -> Sequence[Phase[FedMSAState]]:
        return (
            Phase(
                "train.momentum",
                self.broadcast_momentum,
                self.client_momentum,
                self.server_momentum,
            ),
            Phase(
                "train.local",
                self.broadcast_local,
                self.client_local,
                self.server_local,
                self.choose_one,
            ),
        )

    # -- the maps of eq. (10) ------------------------------------------------------------------
    def maps(self, outer, inner, x: Params, w: Params, v: Params):
        """``(P, S_w, S_v)`` at ``(x, w, v)`` and the (gradient, product) counts."""
        system = ImplicitSystem(outer, inner, x, w)
        v_t = tuple(v[n] for n in self.inner_names)
        hv = system.hvp(v_t)
        jv = system.mixed(v_t)
        p = {n: gf - j for n, gf, j in zip(self.outer_names, system.grad_x_f, jv, strict=True)}
        s_w = dict(zip(self.inner_names, system.grad_y_g, strict=True))
        s_v = {n: h - gf for n, h, gf in zip(self.inner_names, hv, system.grad_y_f, strict=True)}
        return p, s_w, s_v, (system.n_grad, system.n_hvp)

    def _losses(self, runtime: ClientRuntime, task: ClientTask, module, buffers, gen):
        inner_batch = sample_batch(
            runtime.features, runtime.labels, task.data.inner, self.batch_size, gen
        )
        outer_batch = sample_batch(
            runtime.features, runtime.labels, task.data.outer, self.outer_batch_size, gen
        )
        outer, inner = bind_losses(runtime.problem, module, buffers, inner_batch, outer_batch)
        samples = inner_batch.targets.numel() + outer_batch.targets.numel()
        return outer, inner, samples, (inner_batch, outer_batch)

    def _point(self, params: Params, prefix: str = "") -> tuple[Params, Params, Params]:
        x = {n: params[f"{prefix}{n}"] for n in self.outer_names}
        w = {n: params[f"{prefix}{n}"] for n in self.inner_names}
        v = {n: params[f"{prefix}{V}:{n}"] for n in self.inner_names}
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

    def client_momentum(self, runtime: ClientRuntime, task: ClientTask) -> ClientResult:
        """h^m, q^m of eq. (5) on one sample shared by both points (ρ = 1 in round 0)."""
        gen = task.generator()
        module = runtime.module_for(task.index_set)
        buffers = {n: task.params[n] for n in self.buffer_names}
        outer, inner, samples, _ = self._losses(runtime, task, module, buffers, gen)
        p, s_w, s_v, (n_grad, n_hvp) = self.maps(outer, inner, *self._point(task.params))
        first = f"{H}:{self.outer_names[0]}" not in task.params  # round 0: nothing before
        rho = 1.0 if first else self.momentum
        if rho < 1.0:
            prev = self._point(task.params, f"{PREV}:")
            p0, s_w0, s_v0, counts = self.maps(outer, inner, *prev)
            n_grad, n_hvp = n_grad + counts[0], n_hvp + counts[1]
            h_prev = {n: task.params[f"{H}:{n}"] for n in self.outer_names}
            qw_prev = {n: task.params[f"{QW}:{n}"] for n in self.inner_names}
            qv_prev = {n: task.params[f"{QV}:{n}"] for n in self.inner_names}
            p = axpy(1.0 - rho, axpy(-1.0, p0, h_prev), p)
            s_w = axpy(1.0 - rho, axpy(-1.0, s_w0, qw_prev), s_w)
            s_v = axpy(1.0 - rho, axpy(-1.0, s_v0, qv_prev), s_v)
        update = {
            **{f"{H}:{k}": t for k, t in p.items()},
            **{f"{QW}:{k}": t for k, t in s_w.items()},
            **{f"{QV}:{k}": t for k, t in s_v.items()},
        }
        with torch.no_grad():
            x, w, _ = self._point(task.params)
            losses = {"outer_loss": float(outer(x, w)), "inner_loss": float(inner(x, w))}
        return reply(task, update, losses, n_grad=n_grad, n_hvp=n_hvp, samples=samples)

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

    def client_local(self, runtime: ClientRuntime, task: ClientTask) -> ClientResult:
        """Lines 10-16: SARAH-type directions and K steps from the server point."""
        gen = task.generator()
        module = runtime.module_for(task.index_set)
        buffers = {n: task.params[n].clone() for n in self.buffer_names}
        x, w, v = self._point(task.params)
        h = {n: task.params[f"{H}:{n}"] for n in self.outer_names}
        q_w = {n: task.params[f"{QW}:{n}"] for n in self.inner_names}
        q_v = {n: task.params[f"{QV}:{n}"] for n in self.inner_names}
        steps = int(task.params[STEPS])
        previous = None  # the point of step k - 1; at k = 1 it equals the current one
        n_grad = n_hvp = samples = 0
        for _ in range(steps):
            if previous is not None:
                outer, inner, used, batches = self._losses(runtime, task, module, buffers, gen)
                if buffers:  # BatchNorm running statistics follow the local training batches
                    with torch.no_grad():
                        runtime.problem.inner_loss(module, x, w, buffers, batches[0])
                p1, sw1, sv1, c1 = self.maps(outer, inner, x, w, v)
                p0, sw0, sv0, c0 = self.maps(outer, inner, *previous)
                h = axpy(1.0, axpy(-1.0, p0, p1), h)
                q_w = axpy(1.0, axpy(-1.0, sw0, sw1), q_w)
                q_v = axpy(1.0, axpy(-1.0, sv0, sv1), q_v)
                n_grad, n_hvp = n_grad + c1[0] + c0[0], n_hvp + c1[1] + c0[1]
                samples += used
            previous = (x, w, v)
            x = axpy(-self.outer_lr, h, x)
            w = axpy(-self.inner_lr, q_w, w)
            v = axpy(-self.v_lr, q_v, v)
        update = {**x, **w, **{f"{V}:{k}": t for k, t in v.items()}}
        if self.aggregate_buffers:
            update.update(buffers)
        return reply(
            task,
            update,
            {"local_steps": float(steps)},
            n_grad=n_grad,
            n_hvp=n_hvp,
            samples=samples,
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
