"""Coverage of a variable block across rounds: C* (RABO Definition 3), untrained fractions.

Per round, the server's coverage-weighted mean
(:func:`radbo.aggregation.coverage_weighted_mean`) gives, for every coordinate, the number of
clients that held it (``CoverageMean.count``); a client of aggregation weight 0 holds nothing
(:func:`radbo.masks.index.coverage_counts`): the server never moves a coordinate only such
clients hold, so it counts as untrained in C*, ``untrained_fraction`` and
``never_trained_fraction``. :class:`CoverageTracker` summarises those counts
over a chosen set of tensors (e.g. the outer variables x) and remembers which coordinates have
ever been trained, so a run can report honestly how much of the model its masks never touch.

>>> import torch
>>> tracker = CoverageTracker(["w"])
>>> tracker.update({"w": torch.tensor([2, 0, 1, 0])}).never_trained_fraction
0.5
>>> tracker.update({"w": torch.tensor([0, 3, 0, 0])}).never_trained_fraction
0.25
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from torch import Tensor
from typing_extensions import TypedDict

from radbo.schema import Count, Fraction

__all__ = [
    "CoverageRow",
    "CoverageState",
    "CoverageStats",
    "CoverageTracker",
    "RoundCoverage",
    "coverage_stats",
]


@dataclass(frozen=True)
class CoverageStats:
    """Coverage of one variable block in one round (RABO Definition 3, Table I).

    Attributes:
        min_coverage: ``C* = min_k C^k`` over the coordinates trained this round (0 if none).
        untrained_fraction: fraction of the block's coordinates no sampled client held.
        histogram: ``histogram[c]`` = number of coordinates held by exactly c clients.
    """

    min_coverage: int
    untrained_fraction: float
    histogram: list[int]


def coverage_stats(count: Mapping[str, Tensor], names: Sequence[str]) -> CoverageStats:
    """Summarise per-coordinate client counts over the tensors ``names``."""
    if not names:
        return CoverageStats(min_coverage=0, untrained_fraction=0.0, histogram=[])
    flat = torch.cat([count[n].reshape(-1) for n in names])
    # the histogram holds every figure: one pass over the counts instead of three
    histogram = torch.bincount(flat).tolist()
    min_cov = next((c for c, k in enumerate(histogram) if c > 0 and k > 0), 0)
    return CoverageStats(
        min_coverage=min_cov,
        untrained_fraction=histogram[0] / flat.numel() if histogram else 0.0,
        histogram=histogram,
    )


@dataclass(frozen=True)
class RoundCoverage:
    """Coverage of the tracked tensors in one round.

    Attributes:
        round: index of the update (0 for the first one given to the tracker).
        min_coverage: ``C*_q = min_s C_q^s`` over the coordinates trained this round (0 if none).
        min_coverage_so_far: Definition 3's ``C* = min_{q,s} C_q^s`` over all rounds so far
            (rounds that trained nothing are skipped; 0 while nothing was trained).
        histogram: ``histogram[c]`` = number of coordinates held by exactly c clients.
        untrained_fraction: fraction of the coordinates no client held this round.
        never_trained_fraction: fraction of the coordinates no client held in any round so far.
        numel: number of coordinates tracked.
    """

    round: int
    min_coverage: int
    min_coverage_so_far: int
    histogram: list[int]
    untrained_fraction: float
    never_trained_fraction: float
    numel: int

    def as_dict(self) -> dict[str, object]:
        """Plain JSON-serialisable dict of the fields."""
        return asdict(self)


class CoverageRow(TypedDict):
    """The schema of one :class:`RoundCoverage` as a checkpoint stores it (its fields, with
    their types; ``tests/checkpoint/test_checkpoint_integrity.py`` keeps the two equal)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    round: Count
    min_coverage: Count
    min_coverage_so_far: Count
    histogram: list[Count]
    untrained_fraction: Fraction
    never_trained_fraction: Fraction
    numel: Count


class CoverageState(BaseModel):
    """The schema of :meth:`CoverageTracker.state_dict`'s JSON part in a checkpoint."""

    model_config = ConfigDict(extra="forbid")
    names: list[StrictStr] = Field(min_length=1)
    history: list[CoverageRow]


class CoverageTracker:
    """Accumulates per-coordinate client counts of a set of tensors round after round.

    Args:
        names: the tensors to track (e.g. the names of x, leaving the head y out). Counts given
            to :meth:`update` may hold more tensors; only these are read.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(dict.fromkeys(names))
        if not self.names:
            raise ValueError("CoverageTracker needs at least one tensor name to track")
        self.history: list[RoundCoverage] = []
        self._ever: dict[str, Tensor] = {}

    def update(self, count: Mapping[str, Tensor]) -> RoundCoverage:
        """Add one round of counts (``CoverageMean.count``) and summarise it.

        Raises:
            ValueError: a tracked tensor is missing, is not an integer tensor, has negative
                entries or changed shape since the previous round.
        """
        missing = [n for n in self.names if n not in count]
        if missing:
            raise ValueError(f"coverage counts have no entry for tracked tensors {missing}")
        for name in self.names:
            c = count[name]
            if c.is_floating_point() or c.is_complex() or c.dtype == torch.bool:
                raise ValueError(
                    f"coverage count of {name!r} must be an integer tensor of client counts, "
                    f"got dtype {c.dtype}"
                )
            if c.numel() and int(c.min()) < 0:
                raise ValueError(f"coverage count of {name!r} has negative entries")
            if name in self._ever and self._ever[name].shape != c.shape:
                raise ValueError(
                    f"coverage count of {name!r} has shape {tuple(c.shape)}, but earlier rounds "
                    f"had {tuple(self._ever[name].shape)}"
                )
        counts = {n: count[n].detach().to(device="cpu", dtype=torch.int64) for n in self.names}
        for name, c in counts.items():
            held = c > 0
            self._ever[name] = self._ever[name] | held if name in self._ever else held
        stats = coverage_stats(counts, self.names)
        numel = sum(c.numel() for c in counts.values())
        never = sum(int((~e).sum()) for e in self._ever.values())
        previous = [r.min_coverage_so_far for r in self.history if r.min_coverage_so_far > 0]
        trained_mins = previous + ([stats.min_coverage] if stats.min_coverage > 0 else [])
        result = RoundCoverage(
            round=len(self.history),
            min_coverage=stats.min_coverage,
            min_coverage_so_far=min(trained_mins) if trained_mins else 0,
            histogram=stats.histogram,
            untrained_fraction=stats.untrained_fraction,
            never_trained_fraction=never / numel if numel else 0.0,
            numel=numel,
        )
        self.history.append(result)
        return result

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """``(tensors, meta)`` to checkpoint: the ever-trained masks and the round history."""
        tensors = {n: e.clone() for n, e in self._ever.items()}
        return tensors, {"names": list(self.names), "history": [r.as_dict() for r in self.history]}

    def load_state_dict(self, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (for the same tracked names)."""
        if list(meta["names"]) != self.names:
            raise ValueError(
                f"coverage state tracks {list(meta['names'])}, this tracker {self.names}"
            )
        self.history = [RoundCoverage(**r) for r in meta["history"]]
        self._ever = {n: tensors[n].to(torch.bool) for n in self.names if n in tensors}

    def as_dict(self) -> dict[str, object]:
        """JSON-serialisable summary: tracked names, overall C*, never-trained, every round."""
        last = self.history[-1] if self.history else None
        return {
            "names": list(self.names),
            "min_coverage": last.min_coverage_so_far if last else 0,
            "never_trained_fraction": last.never_trained_fraction if last else 1.0,
            "rounds": [r.as_dict() for r in self.history],
        }
