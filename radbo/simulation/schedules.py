"""Per-round local-step schedules: how many local steps tau_i^(t) each client runs.

A schedule is ``(round, client, generator) -> int`` with a ``per_round`` attribute; the engine
calls it once per sampled client and round with a generator derived from the run seed and
(when ``per_round``) the round, so draws are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radbo.randomness import Stream, generator

#: ``(round, client, generator) -> local steps``, with an optional ``per_round`` attribute.
Schedule = Callable[[int, int, torch.Generator], int]


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


def draw_local_steps(schedule: Schedule, seed: int, round: int, client: int) -> int:
    """``schedule``'s local steps for ``client`` in ``round`` of the run with ``seed``: the one
    place that seeds a schedule (a schedule that is not ``per_round`` draws once per client, the
    same in every round)."""
    when = round if getattr(schedule, "per_round", True) else Stream.ONCE
    return schedule(round, client, generator(seed, when, Stream.LOCAL_STEPS, client))


def expected_local_steps(schedule: Schedule, seed: int, client: int) -> float:
    """``client``'s local steps in a typical round: its drawn-once steps, or the mean of a
    per-round uniform schedule."""
    if getattr(schedule, "per_round", False) and isinstance(schedule, UniformLocalSteps):
        return (schedule.low + schedule.high) / 2
    return float(draw_local_steps(schedule, seed, 0, client))
