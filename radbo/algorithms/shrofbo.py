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
"""

from __future__ import annotations

from typing import Any, Literal

from radbo.aggregation import CoverageMean, apply_normalized_step
from radbo.algorithms.simfbo import SimFBO, SimFBOState, V, normalize
from radbo.typing import Params

__all__ = ["ShroFBO"]


class ShroFBO(SimFBO):
    """ShroFBO: SimFBO's local steps, normalized messages, rho-scaled coverage-weighted step."""

    name: Literal["simfbo", "shrofbo"] = "shrofbo"

    def local_message(self, q_x: Params, q_y: Params, q_v: Params, a_norm: Any) -> Params:
        """h_i = q_i / ||a_i||_1 for x, y and v (eq. (6))."""
        return normalize({**q_x, **q_y, **{f"{V}:{k}": t for k, t in q_v.items()}}, a_norm)

    def server_step(self, state: SimFBOState, agg: CoverageMean) -> tuple[Params, Params, Params]:
        """``p_s <- p_s - gamma * rho_s * h_s`` per coordinate (eq. (8), coverage-weighted)."""
        v_wire = {f"{V}:{k}": t for k, t in state.v.items()}
        return (
            apply_normalized_step(state.x, agg, self.server_lr_x),
            apply_normalized_step(state.y, agg, self.server_lr_y),
            apply_normalized_step(v_wire, agg, self.server_lr_v),
        )
