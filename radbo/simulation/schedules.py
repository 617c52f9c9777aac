"""Per-round local-step schedules: how many local steps tau_i^(t) each client runs.

A schedule is ``(round, client, generator) -> int`` with a ``per_round`` attribute; the engine
calls it once per sampled client and round with a generator derived from the run seed and
(when ``per_round``) the round, so draws are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class UniformLocalSteps:
    """tau uniform on {low, ..., high}: drawn once per client (``per_round=False``, the
    default: a client's speed is a property of its device) or afresh every round.

    SimFBO/ShroFBO's heterogeneous-computation experiment draws client i's tau_i from
    {1, ..., 10} (``papers/simfbo_shrofbo.txt``, Sec. 5).
    """

    low: int = 1
    high: int = 10
    per_round: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(
                f"UniformLocalSteps needs 1 <= low <= high, got low={self.low}, high={self.high}"
            )

    def __call__(self, round: int, client: int, generator: torch.Generator) -> int:
        return int(torch.randint(self.low, self.high + 1, (1,), generator=generator))
