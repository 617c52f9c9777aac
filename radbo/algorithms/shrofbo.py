"""ShroFBO: system-level heterogeneity robust FBO (Alg. 1, eqs. (6)-(8) of the SimFBO / ShroFBO
paper), with radbo's coverage-weighted and normalized aggregation.

Paper: Yang, Xiao and Ji, "SimFBO: Towards Simple, Flexible and Communication-efficient
Federated Bilevel Learning", NeurIPS 2023, arXiv:2305.19442 (``papers/simfbo_shrofbo.txt``).

Clients run the same simultaneous local steps as SimFBO (eq. (3)) but send the *normalized*
aggregates h_i = q_i / ||a_i||_1 (eq. (6)), so a client with many local steps no longer weighs
more. The server steps with ``rho * gamma * h`` where h averages the h_i with the true client
weights and rho = sum_j p_j ||a_j||_1 restores the step length (eqs. (7), (8)); SimFBO instead
converges to the stationary point of the objective re-weighted by w_i ~ p_i ||a_i||_1
(Theorem 1 vs Theorem 2).

On masked submodels radbo applies this per coordinate (SPEC "Aggregation"; no paper has it):
for coordinate s with holders N_s,

    h_s = sum_{N_s} p_i h_{i,s} / sum_{N_s} p_i,  rho_s = sum_{N_s} p_i ||a_i||_1 / sum_{N_s} p_i,
    x_s <- x_s - gamma_x rho_s h_s     (same for y and v; s untouched if N_s is empty).

With full masks this is eq. (8) with p~ normalized over the sample; with a_i = 1 and equal
tau_i = T it is RABO's coverage average of the summed local gradients (gamma = beta).

**rho as printed** (``rho = "printed"``). Eq. (8) prints ``rho = sum_{j=1}^n p_j ||a_j||_1``
over all n clients of the population, sampled or not, with ``p`` normalised over all of them:
one scalar per round, ``coefficient * sum_j p_j tau_j`` (``tau_j``: each client's local steps;
its mean under a per-round schedule). radbo's default (``"holders"``) takes the same mean over
the clients that actually produced each coordinate's ``h_s``. The two agree with full masks and
full participation. Under partial participation or masks they differ whenever the clients that
hold a coordinate run more or fewer steps than the population on average -- e.g. slow devices
that also train small submodels -- and then only the holders' form restores the step length of
the updates being averaged (with a_i = 1 and equal tau it is exactly RABO's step). The printed
form is kept to reproduce the paper.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from radbo.aggregation import CoverageMean, apply_normalized_step, apply_step
from radbo.algorithms.base import ALGORITHMS, Wiring
from radbo.algorithms.simfbo import SimFBO, SimFBOConfig, SimFBOState, V, normalize
from radbo.typing import Params

__all__ = ["ShroFBO", "ShroFBOConfig"]


@ALGORITHMS.register
class ShroFBOConfig(SimFBOConfig):
    """ShroFBO hyperparameters (Alg. 1, eqs. (6)-(8) of ``papers/simfbo_shrofbo.txt``):
    SimFBO's, and rho."""

    # its own tag: SimFBO's narrowed to a kind of its own, which the type checker calls unsafe
    name: Literal["shrofbo"] = "shrofbo"  # type: ignore[assignment]
    rho: Literal["holders", "printed"] = Field(
        "holders",
        description="ShroFBO's rho: per coordinate over its holders (radbo), or eq. (8) as "
        "printed (sum_j p_j ||a_j||_1 over all n clients)",
    )

    def build(self, wiring: Wiring) -> ShroFBO:
        return self.bind(ShroFBO, wiring, population_steps=wiring.population_steps)


class ShroFBO(ShroFBOConfig, SimFBO):
    """ShroFBO: SimFBO's local steps, normalized messages, rho-scaled coverage-weighted step.

    ``population_steps`` (``sum_j p_j tau_j`` over the whole population, wired by the run) is
    what ``rho = "printed"`` needs."""

    population_steps: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _population_for_printed_rho(self) -> ShroFBO:
        if self.rho == "printed" and self.population_steps is None:
            raise ValueError(
                'ShroFBO with rho = "printed" needs population_steps (sum_j p_j tau_j over all '
                "clients)"
            )
        return self

    def local_message(self, q_x: Params, q_y: Params, q_v: Params, a_norm: Any) -> Params:
        """h_i = q_i / ||a_i||_1 for x, y and v (eq. (6))."""
        return normalize({**q_x, **q_y, **{f"{V}:{k}": t for k, t in q_v.items()}}, a_norm)

    def server_step(self, state: SimFBOState, agg: CoverageMean) -> tuple[Params, Params, Params]:
        """``p_s <- p_s - gamma * rho_s * h_s`` per coordinate (eq. (8), coverage-weighted), or
        with the printed scalar ``rho = coefficient * population_steps``."""
        v_wire = {f"{V}:{k}": t for k, t in state.v.items()}
        blocks = (
            (state.x, self.server_lr_x),
            (state.y, self.server_lr_y),
            (v_wire, self.server_lr_v),
        )
        if self.rho == "printed":
            assert self.population_steps is not None  # the model validator saw to it
            rho = self.coefficient * self.population_steps
            x, y, v = (apply_step(p, agg, lr * rho) for p, lr in blocks)
        else:
            x, y, v = (apply_normalized_step(p, agg, lr) for p, lr in blocks)
        return x, y, v
