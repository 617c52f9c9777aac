"""FedRolex's rolling window: the kept channels of each group move with the round."""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch
from torch import Tensor

from radbo.masks.structure import StructurePlan, kept_count


class RollingPolicy:
    """Keep a window of ``k = kept_count(C, r)`` channels that rolls ``stride`` channels a round.

    FedRolex (Alam et al., "FedRolex: Model-Heterogeneous Federated Learning with Rolling
    Sub-Model Extraction", NeurIPS 2022) extracts, in round q, the channels
    ``{(q + j) mod C : 0 <= j < k}`` of every layer, so that over C rounds every channel of the
    global model is trained. Here the window of a group with C channels starts at
    ``s = (round * stride) % C`` and wraps around:

        kept = sorted({(s + j) % C for j < k}).

    Clients of the same round share the window start, so a smaller submodel is nested in every
    larger one (as in FedRolex); the client index and the generator are ignored. With
    ``k >= stride`` every channel is kept at least once within ``ceil(C / stride)`` consecutive
    rounds.

    Args:
        stride: channels the window moves per round (default 1, FedRolex's choice).

    >>> from radbo.models import MLP
    >>> model = MLP(8, [8], 3)
    >>> plan = StructurePlan(model, model.example_input(), model.output_layers)
    >>> RollingPolicy()(plan, {"body.0": 3 / 8}, round=7, client=0,
    ...                 generator=torch.Generator())["body.0"].tolist()
    [0, 1, 7]
    """

    def __init__(self, stride: int = 1) -> None:
        if isinstance(stride, bool) or not isinstance(stride, numbers.Integral) or stride < 1:
            raise ValueError(
                f"stride must be a positive integer number of channels per round, got {stride!r}"
            )
        self.stride: int = int(stride)

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
        kept: dict[str, Tensor] = {}
        for group, ratio in ratios.items():
            channels = plan.channels(group)
            k = kept_count(channels, ratio)
            start = (round * self.stride) % channels
            window = (start + torch.arange(k)) % channels
            kept[group] = torch.sort(window).values
        return kept
