"""Small CNN with BatchNorm for 8x8 (digits) or larger images: conv backbone is x, head is y."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.models.base import MODELS, BatchNormConfig, BilevelModel, Width
from radbo.models.functional import apply_layer


class SmallCNN(BilevelModel):
    """``[conv3x3 -> BN -> ReLU] * len(channels) -> AdaptiveAvgPool(pool) -> flatten -> head``.

    The convolutional backbone (with its BatchNorm layers) is the outer variable x; the linear
    ``head`` is the inner variable y. The flatten between the pooled feature map and the head
    couples each conv channel to ``pool * pool`` head columns, which the structured masks
    handle through Torch-Pruning's dependency graph.
    """

    inner_modules = ("head",)
    output_layers = ("head",)

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 8,
        channels: Sequence[int] = (16, 32),
        classes: int = 10,
        pool: int = 2,
    ):
        super().__init__()
        if in_channels < 1 or image_size < 1 or classes < 1 or pool < 1 or not channels:
            raise ValueError("SmallCNN sizes must be positive and channels non-empty")
        self.input_shape = (in_channels, image_size, image_size)
        layers: list[nn.Module] = []
        width = in_channels
        for c in channels:
            layers += [nn.Conv2d(width, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()]
            width = c
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(pool))
        self.head = nn.Linear(width * pool * pool, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.flatten(self.body(x), 1))

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        features = self._body(
            inputs, lambda: torch.flatten(apply_layer(self.body, "body.", state, inputs), 1)
        )
        return apply_layer(self.head, "head.", state, features)


@MODELS.register
class CNNConfig(BatchNormConfig):
    """Small CNN with BatchNorm (any image size and channel count): conv backbone is x, head
    is y."""

    name: Literal["cnn"] = "cnn"
    channels: list[Width] = Field(
        default_factory=lambda: [16, 32],
        min_length=1,
        description="one conv-BN-ReLU layer per width",
    )

    def build(self, input_shape: tuple[int, ...], classes: int) -> SmallCNN:
        channels, size = self.image(input_shape)
        return SmallCNN(channels, size, self.channels, classes)
