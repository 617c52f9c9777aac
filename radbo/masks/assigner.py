"""Per-round submodel assignment: capacities -> group ratios -> policy -> index sets.

x and y are masked independently: a prunable group whose root layer belongs to x follows the
client's capacity when ``mask_x`` is on (else it is kept whole), and a group rooted in y
follows it when ``mask_y`` is on. Layers coupled to a group (the next layer's input channels,
BatchNorm, the flattened head) follow that group's choice, whichever side they belong to, so
that the submodel stays structurally consistent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from radbo.client import ClientBudget
from radbo.masks.policies import MaskPolicy, RoundPreparedPolicy
from radbo.masks.structure import StructurePlan
from radbo.typing import IndexSet, Params


@dataclass
class SubmodelAssigner:
    """Turns client budgets into index sets with a :class:`MaskPolicy` on a structure plan.

    Args:
        plan: the model's structure (Torch-Pruning dependency graph).
        policy: chooses the kept channels of each group.
        outer_names: names of the outer parameters x (groups rooted there follow ``mask_x``).
        mask_x: prune groups rooted in x.
        mask_y: prune groups rooted in y.
    """

    plan: StructurePlan
    policy: MaskPolicy
    outer_names: Iterable[str]
    mask_x: bool = True
    mask_y: bool = True

    def __post_init__(self) -> None:
        # index sets of this round by kept-channel choice: clients sharing a choice share them
        self._cache: dict[tuple, IndexSet] = {}
        self._cache_round: int | None = None
        outer = set(self.outer_names)
        self._root_in_x = {
            group: any(name.startswith(group + ".") for name in outer) for group in self.plan.groups
        }

    def group_ratios(self, capacity: float) -> dict[str, float]:
        """Keep ratio of every prunable group for a client of the given capacity."""
        return {
            group: capacity if (self.mask_x if in_x else self.mask_y) else 1.0
            for group, in_x in self._root_in_x.items()
        }

    def prepare(
        self,
        model_state: Params,
        round: int,
        clients: Sequence[int],
        budgets: Sequence[ClientBudget],
    ) -> None:
        """Load the round's global model (importance scores see it) and show round-level
        policies (:class:`~radbo.masks.policies.RoundPreparedPolicy`, e.g. coverage) all of the
        round's clients and the ratios they will ask for."""
        self.plan.load_state(model_state)
        if isinstance(self.policy, RoundPreparedPolicy):
            self.policy.prepare(clients, [self.group_ratios(b.capacity) for b in budgets])

    def assign(
        self, budget: ClientBudget, client: int, round: int, generator: torch.Generator
    ) -> IndexSet:
        """Index sets of one client for this round (call :meth:`prepare` first). Clients whose
        policy picks the same channels share one (read-only) index set."""
        kept = self.policy(
            self.plan,
            self.group_ratios(budget.capacity),
            round=round,
            client=client,
            generator=generator,
        )
        if round != self._cache_round:
            self._cache, self._cache_round = {}, round
        key = tuple((g, tuple(torch.as_tensor(k).tolist())) for g, k in sorted(kept.items()))
        if key not in self._cache:
            self._cache[key] = self.plan.index_sets(kept)
        return self._cache[key]
