"""Conv-4, the standard few-shot backbone: four [3x3 conv, BN, ReLU, 2x2 max-pool] blocks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field
from torch import Tensor, nn

from radbo.models.base import MODELS, BatchNormConfig, BilevelModel, Width
from radbo.models.functional import apply_layer

__all__ = ["Conv4", "Conv4Config"]


class Conv4(BilevelModel):
    """Conv-4 (Vinyals et al., "Matching Networks for One Shot Learning", NIPS 2016; Snell et
    al., ProtoNets; Finn et al., MAML): four blocks of a 3x3 convolution (``width`` channels,
    padding 1), BatchNorm, ReLU and a 2x2 max-pool, then the flattened map feeds a linear
    ``head``. The backbone is the outer variable x, the head the inner variable y (few-shot
    hyper-representation, RABO Sec. V-A).

    On 28x28 Omniglot the map ends at 1x1 (64 features), on 84x84 miniImageNet at 5x5 (1600).
    A block whose input is already 1x1 skips its pool, so small images (8x8 digits) work too.

    >>> model = Conv4(in_channels=1, image_size=28, classes=5)
    >>> model.feature_dim, tuple(model(model.example_input(2)).shape)
    (64, (2, 5))
    >>> Conv4(in_channels=1, image_size=8, classes=5).feature_dim  # 8 -> 4 -> 2 -> 1 -> 1
    64
    """

    inner_modules = ("head",)
    output_layers = ("head",)

    def __init__(
        self, in_channels: int = 1, image_size: int = 28, width: int = 64, classes: int = 5
    ) -> None:
        super().__init__()
        if min(in_channels, image_size, width, classes) < 1:
            raise ValueError(
                "Conv4 sizes must be positive, got "
                f"in_channels={in_channels}, image_size={image_size}, width={width}, "
                f"classes={classes}"
            )
        self.input_shape = (in_channels, image_size, image_size)
        layers: list[nn.Module] = []
        channels, size = in_channels, image_size
        for _ in range(4):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            if size >= 2:
                layers.append(nn.MaxPool2d(2))
                size //= 2
            channels = width
        self.body = nn.Sequential(*layers, nn.Flatten())
        self.head = nn.Linear(width * size * size, classes)

    @property
    def feature_dim(self) -> int:
        """Width of the flattened representation the head reads."""
        return self.head.in_features

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        features = self._body(inputs, lambda: apply_layer(self.body, "body.", state, inputs))
        return apply_layer(self.head, "head.", state, features)


@MODELS.register
class Conv4Config(BatchNormConfig):
    """Conv-4 (few-shot backbone, any square image): four conv-BN-ReLU-pool blocks of
    ``width`` channels are x, the linear head is y."""

    name: Literal["conv4"]
    width: Width = Field(64, description="channels of every block")

    def build(self, input_shape: tuple[int, ...], classes: int) -> Conv4:
        channels, size = self.image(input_shape)
        return Conv4(channels, size, self.width, classes)
