"""Mask policies: which channels of each prunable group a client keeps in a round.

Every policy is a callable with the :class:`MaskPolicy` signature, configured at construction,
so policies are interchangeable in the simulation engine. A policy only *selects* root channels;
:meth:`radbo.masks.StructurePlan.index_sets` turns the selection into per-tensor index sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from radbo.masks.structure import StructurePlan


@runtime_checkable
class MaskPolicy(Protocol):
    """Select, per group named in ``ratios``, the root channels a client keeps.

    Args:
        plan: the model's :class:`~radbo.masks.StructurePlan`.
        ratios: per group name, the capacity ratio in (0, 1]; the group keeps
            ``kept_count(channels, ratio)`` channels. Groups not named keep everything.
        round: the global round index q (policies that move with the round use it).
        client: the client index i.
        generator: the source of randomness (random policies draw from it only).

    Returns:
        Per group named in ``ratios``, a sorted ``LongTensor`` of kept root channels.
    """

    def __call__(
        self,
        plan: StructurePlan,
        ratios: Mapping[str, float],
        *,
        round: int,
        client: int,
        generator: torch.Generator,
    ) -> dict[str, Tensor]: ...


from radbo.masks.policies.importance import ImportancePolicy  # noqa: E402
from radbo.masks.policies.leading import LeadingPolicy  # noqa: E402

__all__ = ["ImportancePolicy", "LeadingPolicy", "MaskPolicy"]
