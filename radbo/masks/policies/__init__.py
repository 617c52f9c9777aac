"""Mask policies: which channels of each prunable group a client keeps in a round.

Every policy is a callable with the :class:`MaskPolicy` signature, configured at construction,
so policies are interchangeable in the simulation engine. A policy only *selects* root channels;
:meth:`radbo.masks.StructurePlan.index_sets` turns the selection into per-tensor index sets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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


@runtime_checkable
class RoundPreparedPolicy(MaskPolicy, Protocol):
    """A :class:`MaskPolicy` that must see all of a round's clients before the per-client calls.

    Its masks depend on the other clients of the round (e.g. :class:`CoveragePolicy` shares
    segments among k clients), so the engine calls ``prepare`` once per round, with the sampled
    clients and the ``ratios`` each of them will be asked for, then calls the policy per client.
    """

    def prepare(
        self, clients: Sequence[int], ratios_by_client: Sequence[Mapping[str, float]]
    ) -> None: ...


from radbo.masks.policies.coverage import CoveragePolicy  # noqa: E402
from radbo.masks.policies.fiarse import FiarsePolicy  # noqa: E402
from radbo.masks.policies.importance import ImportancePolicy  # noqa: E402
from radbo.masks.policies.leading import LeadingPolicy  # noqa: E402
from radbo.masks.policies.oap import OAPPolicy  # noqa: E402
from radbo.masks.policies.random import RandomPolicy  # noqa: E402
from radbo.masks.policies.rolling import RollingPolicy  # noqa: E402


def _coverage(settings: Any, clients_per_round: int) -> CoveragePolicy:
    if settings.coverage_k > clients_per_round:
        raise ValueError(
            f"coverage_k = {settings.coverage_k}: needs at least that many clients per round, "
            f"the fleet samples {clients_per_round}"
        )
    return CoveragePolicy(k=settings.coverage_k, num_clients=clients_per_round)


#: ``name -> factory(settings, clients_per_round)`` of every policy a ``[mask]`` section can
#: name; ``settings`` is the section (``coverage_k``, ``rolling_stride``). A new policy is its
#: file plus one entry here.
POLICIES: dict[str, Callable[[Any, int], MaskPolicy]] = {
    "importance": lambda settings, n: ImportancePolicy(),
    "leading": lambda settings, n: LeadingPolicy(),
    "rolling": lambda settings, n: RollingPolicy(stride=settings.rolling_stride),
    "random": lambda settings, n: RandomPolicy(),
    "coverage": _coverage,
    "fiarse": lambda settings, n: FiarsePolicy(),
    "oap": lambda settings, n: OAPPolicy(),
}

__all__ = [
    "POLICIES",
    "CoveragePolicy",
    "FiarsePolicy",
    "ImportancePolicy",
    "LeadingPolicy",
    "MaskPolicy",
    "OAPPolicy",
    "RandomPolicy",
    "RollingPolicy",
    "RoundPreparedPolicy",
]
