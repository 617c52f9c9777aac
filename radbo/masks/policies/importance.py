"""RABO's "weight importance" policy: keep the channels of largest L2 group magnitude."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from radbo.masks.structure import StructurePlan, kept_count


def importance_order(score: Tensor) -> Tensor:
    """Channel indices by decreasing ``score`` (NaN last), equal scores in index order: a
    stable descending sort, so ties go to the lower index.

    >>> importance_order(torch.tensor([1.0, 3.0, float("nan"), 3.0])).tolist()
    [1, 3, 0, 2]
    """
    score = torch.nan_to_num(score, nan=float("-inf"))
    return torch.sort(score, descending=True, stable=True).indices


def top_channels(score: Tensor, k: int) -> Tensor:
    """The ``k`` channels of largest ``score`` (ties to the lower index), sorted."""
    return torch.sort(importance_order(score)[:k]).values


class ImportancePolicy:
    """Keep the ``kept_count(C, r)`` channels of each group with the largest importance.

    RABO (papers/rabo_rafbo.txt, eq. (3)) builds client masks m_{q,x}^i = M(x_q, R_i) and
    m_{q,y}^i = M(y_q, R_i) from the current global model (x_q, y_q) and the client's resources
    R_i; its experiments "split the model according to the weight importance". Here the
    importance of a root channel is Torch-Pruning's group L2 magnitude
    (:meth:`StructurePlan.group_scores`) of the plan's *current* model weights, so the caller
    must call ``plan.load_state(global_state)`` at the start of each round. Ties are broken by
    the lower channel index; kept channels are returned sorted.

    Scores are computed once per round and cached (all clients of a round share them), and so
    is each group's selection for each kept count: the clients of a round that keep equally
    many channels of a group get the same (read-only) tensor, and a client's selection costs no
    tensor operation once another client of its capacity has been served. The cache is keyed by
    (plan, round): loading a new state into the plan within the same round is not seen.

    Args:
        importance: ``"l2"`` (default, RABO) or ``"l1"``.
    """

    def __init__(self, importance: str = "l2") -> None:
        if importance not in ("l1", "l2"):
            raise ValueError(f"importance must be 'l1' or 'l2', got {importance!r}")
        self.importance = importance
        self._cache: tuple[StructurePlan, int, dict[str, Tensor]] | None = None
        self._kept: dict[tuple[str, int], Tensor] = {}  # (group, count) -> channels, this round

    def scores(self, plan: StructurePlan, round: int) -> dict[str, Tensor]:
        """Per-group channel scores of ``round`` (computed on first use in the round)."""
        if self._cache is not None and self._cache[0] is plan and self._cache[1] == round:
            return self._cache[2]
        scores = plan.group_scores(self.importance)
        self._cache = (plan, round, scores)
        self._kept = {}
        return scores

    def __call__(
        self,
        plan: StructurePlan,
        ratios: Mapping[str, float],
        *,
        round: int,
        client: int,
        generator: torch.Generator,
    ) -> dict[str, Tensor]:
        """Kept root channels per group named in ``ratios`` (see :class:`MaskPolicy`)."""
        counts = {group: kept_count(plan.channels(group), r) for group, r in ratios.items()}
        scores = self.scores(plan, round)
        kept: dict[str, Tensor] = {}
        for group, k in counts.items():
            if (group, k) not in self._kept:
                self._kept[group, k] = top_channels(scores[group], k)
            kept[group] = self._kept[group, k]
        return kept
