"""SimFBO: simple federated bilevel optimization (Alg. 1 of ``papers/simfbo_shrofbo.txt``).

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
coverage weighting); coordinates nobody holds stay unchanged. The Hessian- and Jacobian-vector
products come from a pluggable :class:`~radbo.hypergrad.SecondOrderProducts` (autograd, or
finite differences of gradients: second-order free). With ``penalty = lam`` the method is fully
first order (``papers/fedsbo_first_order.txt``): the v slot carries y_lam (the minimizer of
f + lam g), its local step follows grad_y (f / lam + g), and x follows
``grad_x f(x, y_lam) + lam (grad_x g(x, y_lam) - grad_x g(x, y))``.

Each local step draws one inner and one outer minibatch shared by the three updates (the paper
draws independent samples zeta, psi, xi; sharing halves the data passes and keeps the updates
consistent). The client coefficients a_i^(t,k) are constant (``coefficient``), so
||a_i||_1 = coefficient * tau_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from radbo.aggregation import (
    CoverageMean,
    apply_step,
    average_buffers,
    axpy,
    coverage_weighted_mean,
    project_ball,
)
from radbo.hypergrad import AutogradProducts, SecondOrderProducts
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

#: prefix of the v tensors (shaped like y) on the wire and in aggregation
V = "v"


@dataclass(frozen=True)
class SimFBOState:
    """Global state: x, y, v (keyed like y) and buffers, in full-model coordinates."""

    x: Params
    y: Params
    v: Params
    buffers: Params
    round: int = 0


def _grad(loss: torch.Tensor, blocks: Sequence[Params]) -> list[Params]:
    """Gradients of ``loss`` w.r.t. every tensor of ``blocks`` (zeros where unused)."""
    flat = [t for block in blocks for t in block.values()]
    grads = torch.autograd.grad(loss, flat, allow_unused=True)
    out: list[Params] = []
    i = 0
    for block in blocks:
        part = {}
        for name, t in block.items():
            g = grads[i]
            part[name] = torch.zeros_like(t) if g is None else g.detach()
            i += 1
        out.append(part)
    return out


def _leaf(params: Params) -> Params:
    return {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}


@dataclass(frozen=True)
class SimFBO:
    """SimFBO (Alg. 1, eqs. (3)-(5) of ``papers/simfbo_shrofbo.txt``) on masked submodels.

    Args:
        outer_names / inner_names / buffer_names: which model tensors are x, y and buffers.
        inner_lr, v_lr, outer_lr: client step sizes eta_y, eta_v, eta_x.
        server_lr_y, server_lr_v, server_lr_x: server step sizes gamma_y, gamma_v, gamma_x.
        radius: r of the projection P_r on v (eq. (5)); ``None`` disables it.
        coefficient: the client coefficient a_i^(t,k) (constant; 1 = plain SGD).
        batch_size / outer_batch_size: minibatches of the inner / outer loss per local step.
        products: Hessian- and Jacobian-vector products (default autograd).
        penalty: lam > 0 switches to the fully first-order penalty method (v carries y_lam).
        aggregate_buffers: average BatchNorm running statistics (default) or static BN (see
            :class:`~radbo.algorithms.RABO`).
    """

    outer_names: tuple[str, ...]
    inner_names: tuple[str, ...]
    buffer_names: tuple[str, ...] = ()
    inner_lr: float = 0.05
    v_lr: float = 0.05
    outer_lr: float = 0.05
    server_lr_y: float = 0.2
    server_lr_v: float = 0.05
    server_lr_x: float = 0.05
    radius: float | None = 10.0
    coefficient: float = 1.0
    batch_size: int = 32
    outer_batch_size: int = 32
    products: SecondOrderProducts = AutogradProducts()
    penalty: float | None = None
    aggregate_buffers: bool = True
    name: str = "simfbo"

    def __post_init__(self) -> None:
        for f in ("inner_lr", "v_lr", "outer_lr", "coefficient"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{type(self).__name__}.{f} must be > 0, got {getattr(self, f)}")
        for f in ("server_lr_y", "server_lr_v", "server_lr_x"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{type(self).__name__}.{f} must be > 0, got {getattr(self, f)}")
        for f in ("batch_size", "outer_batch_size"):
            if getattr(self, f) < 1:
                raise ValueError(f"{type(self).__name__}.{f} must be >= 1, got {getattr(self, f)}")
        if self.radius is not None and not self.radius > 0:
            raise ValueError(f"{type(self).__name__}.radius must be > 0 or None, got {self.radius}")
        if self.penalty is not None and not self.penalty > 0:
            raise ValueError(
                f"{type(self).__name__}.penalty must be > 0 or None, got {self.penalty}"
            )

    # -- state ---------------------------------------------------------------------------
    def init(self, x: Params, y: Params, buffers: Params) -> SimFBOState:
        """x, y and buffers cloned; v = 0 (or y_lam = y in first-order mode)."""
        clone = lambda d: {k: t.detach().clone() for k, t in d.items()}  # noqa: E731
        v = clone(y) if self.penalty is not None else {k: torch.zeros_like(t) for k, t in y.items()}
        return SimFBOState(x=clone(x), y=clone(y), v=v, buffers=clone(buffers))

    def model_state(self, state: SimFBOState) -> Params:
        return {**state.x, **state.y, **state.buffers}

    def phases(self) -> Sequence[Phase[SimFBOState]]:
        return (Phase("train", self.broadcast, self.client, self.server),)

    def _wire_index(self, index_set: IndexSet) -> IndexSet:
        return {**index_set, **alias(index_set, V, self.inner_names)}

    # -- the one phase ---------------------------------------------------------------------
    def broadcast(self, state: SimFBOState, index_set: IndexSet, slot: int = 0) -> Params:
        """Submodel of x, y, v and buffers for one client."""
        wire = {**self.model_state(state), **{f"{V}:{k}": t for k, t in state.v.items()}}
        return extract(wire, self._wire_index(index_set))

    def client(self, runtime: ClientRuntime, task: ClientTask) -> ClientResult:
        """tau_i simultaneous local steps (eq. (3)) and the local aggregates (eq. (4))."""
        gen = task.generator()
        module = runtime.module_for(task.index_set)
        p = task.params
        x = {n: p[n] for n in self.outer_names}
        y = {n: p[n] for n in self.inner_names}
        v = {n: p[f"{V}:{n}"] for n in self.inner_names}
        buffers = {n: p[n].clone() for n in self.buffer_names}
        q_x = {k: torch.zeros_like(t) for k, t in x.items()}
        q_y = {k: torch.zeros_like(t) for k, t in y.items()}
        q_v = {k: torch.zeros_like(t) for k, t in v.items()}
        tau = task.budget.local_steps
        a = self.coefficient
        n_grad = n_hvp = samples = 0
        first_losses: tuple[float, float] | None = None
        for _ in range(tau):
            inner_batch = sample_batch(
                runtime.features, runtime.labels, task.data.inner, self.batch_size, gen
            )
            outer_batch = sample_batch(
                runtime.features, runtime.labels, task.data.outer, self.outer_batch_size, gen
            )
            samples += inner_batch.targets.numel() + outer_batch.targets.numel()
            if buffers:  # BatchNorm running statistics follow the local training batches
                with torch.no_grad():
                    runtime.problem.inner_loss(module, x, y, buffers, inner_batch)
            outer, inner = bind_losses(runtime.problem, module, buffers, inner_batch, outer_batch)
            if self.penalty is None:
                d_x, d_y, d_v, losses, counts = self._implicit_directions(outer, inner, x, y, v)
            else:
                d_x, d_y, d_v, losses, counts = self._penalty_directions(outer, inner, x, y, v)
            n_grad += counts[0]
            n_hvp += counts[1]
            if first_losses is None:
                first_losses = losses
            x = axpy(-a * self.outer_lr, d_x, x)
            y = axpy(-a * self.inner_lr, d_y, y)
            v = axpy(-a * self.v_lr, d_v, v)
            q_x, q_y, q_v = axpy(a, d_x, q_x), axpy(a, d_y, q_y), axpy(a, d_v, q_v)
        a_norm = a * tau
        update = self.local_message(q_x, q_y, q_v, a_norm)
        if self.aggregate_buffers:
            update.update(buffers)
        inner_loss, outer_loss = first_losses if first_losses is not None else (0.0, 0.0)
        return reply(
            task,
            update,
            {
                "inner_loss": inner_loss,
                "outer_loss": outer_loss,
                "a_norm": a_norm,
                "local_steps": float(tau),
            },
            n_grad=n_grad,
            n_hvp=n_hvp,
            samples=samples,
        )

    def local_message(self, q_x: Params, q_y: Params, q_v: Params, a_norm: float) -> Params:
        """What a client sends: SimFBO sends the local aggregates q_i themselves (eq. (4))."""
        return {**q_x, **q_y, **{f"{V}:{k}": t for k, t in q_v.items()}}

    def _implicit_directions(self, outer, inner, x, y, v):
        """(d_x, d_y, d_v) of eq. (3) with the configured second-order products."""
        xl, yl = _leaf(x), _leaf(y)
        f = outer(xl, yl)
        gf_x, gf_y = _grad(f, [xl, yl])
        pr = self.products(inner, x, y, v)
        d_x = {k: gf_x[k] - pr.jvp_xy[k] for k in x}
        d_v = {k: pr.hvp_yy[k] - gf_y[k] for k in v}
        with torch.no_grad():
            g_value = float(inner(x, y))
        return d_x, pr.grad_y, d_v, (g_value, float(f.detach())), (pr.n_grad + 1, pr.n_hvp)

    def _penalty_directions(self, outer, inner, x, y, v):
        """First-order penalty directions (``papers/fedsbo_first_order.txt``); v is y_lam."""
        lam = float(self.penalty)  # type: ignore[arg-type]
        xl, yl_lam = _leaf(x), _leaf(v)
        f_lam = outer(xl, yl_lam)
        gf_x, gf_y = _grad(f_lam, [xl, yl_lam])
        xl, yl_lam = _leaf(x), _leaf(v)
        gl_x, gl_y = _grad(inner(xl, yl_lam), [xl, yl_lam])
        xl, yl = _leaf(x), _leaf(y)
        g = inner(xl, yl)
        g_x, g_y = _grad(g, [xl, yl])
        d_x = {k: gf_x[k] + lam * (gl_x[k] - g_x[k]) for k in x}
        d_v = {k: gf_y[k] / lam + gl_y[k] for k in v}
        return d_x, g_y, d_v, (float(g.detach()), float(f_lam.detach())), (3, 0)

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
