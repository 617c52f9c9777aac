"""HeteroFL's static prefix policy: every client keeps the leading channels of each group."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from radbo.masks.structure import StructurePlan, kept_count


class LeadingPolicy:
    """Keep channels ``0 .. kept_count(C, r) - 1`` of every group (HeteroFL, Diao et al. 2021).

    The selection ignores the round, the client and the generator, so clients of equal capacity
    share one submodel and a smaller submodel is nested in every larger one. On an MLP the kept
    hidden-layer weight is exactly ``W[:k_out, :k_in]``.

    >>> from radbo.models import MLP
    >>> model = MLP(8, [4], 3)
    >>> plan = StructurePlan(model, model.example_input(), model.output_layers)
    >>> LeadingPolicy()(plan, {"body.0": 0.5}, round=0, client=0,
    ...                 generator=torch.Generator())["body.0"].tolist()
    [0, 1]
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
        return {
            group: torch.arange(kept_count(plan.channels(group), ratio))
            for group, ratio in ratios.items()
        }
