"""Uniformly random channels: the kept set of each group is drawn from the client's generator."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from radbo.masks.structure import StructurePlan, kept_count


class RandomPolicy:
    """Keep ``kept_count(C, r)`` channels of each group, uniformly without replacement.

    The channels are the first k entries of ``torch.randperm(C, generator=generator)`` (the
    random submodel baseline of FedRolex / Federated Dropout, Caldas et al. 2018), returned
    sorted. All randomness comes from ``generator``, which the engine seeds per client and round;
    the round and the client index are otherwise ignored. Groups are drawn in the plan's group
    order, whatever the order of ``ratios``, so the result depends only on the generator's state
    and the set of ratios.

    >>> from radbo.models import MLP
    >>> model = MLP(8, [8], 3)
    >>> plan = StructurePlan(model, model.example_input(), model.output_layers)
    >>> a = RandomPolicy()(plan, {"body.0": 0.5}, round=0, client=0,
    ...                    generator=torch.Generator().manual_seed(1))["body.0"]
    >>> a.numel(), bool(torch.equal(a, torch.unique(a)))
    (4, True)
    """

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
        drawn: dict[str, Tensor] = {}
        for group in plan.groups:
            if group not in counts:
                continue
            perm = torch.randperm(plan.groups[group], generator=generator)
            drawn[group] = torch.sort(perm[: counts[group]]).values
        return {group: drawn[group] for group in ratios}
