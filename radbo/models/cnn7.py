"""The 7-layer CNN (LeNet-5) of FedNest / SimFBO's CIFAR-10 hyper-representation experiments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.models.base import MODELS, BilevelModel, ModelConfig, Width
from radbo.models.functional import apply_layer


class CNN7(BilevelModel):
    """LeNet-5: ``conv5x5 -> ReLU -> maxpool2 -> conv5x5 -> ReLU -> maxpool2 -> fc -> fc -> head``.

    SimFBO (papers/simfbo_shrofbo.txt, Appendix A.1, "CNN") trains "the 7-layer CNN [33]" on
    CIFAR-10, with "the last fully connected layer's parameters" as the lower-level variable y
    and the rest as x, following FedNest's set-up. [33] is LeCun et al. 1998, whose LeNet-5 has
    seven layers (C1, S2, C3, S4, C5, F6, output), and FedNest's code (github.com/ucr-optml/FedNest,
    ``models/Nets.py: CNNCifar``, the code SimFBO says it follows) is that network for 3x32x32:
    ``Conv2d(3, 6, 5)``, max-pool, ``Conv2d(6, 16, 5)``, max-pool, ``Linear(400, 120)``,
    ``Linear(120, 84)``, ``Linear(84, 10)`` (the ``header``), ReLU after every hidden layer, no
    BatchNorm and no padding. This class reproduces it (62,006 parameters at the defaults);
    FedMSA (papers/fedmsa.txt) uses no CNN. The two convolutions and the two hidden linear
    layers are x; ``head`` is y. The flatten between the second pool and the first linear layer
    (``body.0``) couples each conv channel to a block of its columns, which the structured masks
    follow.

    Args:
        classes: outputs of the head; default 10 (CIFAR-10).
        in_channels: input channels; default 3.
        image_size: input height and width; default 32. At least 16 (two valid 5x5 convs and
            two 2x2 pools must leave a positive size); 28 gives FedNest's 1x28x28 MNIST sizes
            for the convs (without its ``padding=2``).
        channels: the two conv widths; default ``(6, 16)``.
        hidden: the two hidden linear widths; default ``(120, 84)``.

    >>> model = CNN7()
    >>> sum(p.numel() for p in model.parameters()), tuple(model(model.example_input(2)).shape)
    (62006, (2, 10))
    """

    inner_modules = ("head",)
    output_layers = ("head",)

    def __init__(
        self,
        classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        channels: Sequence[int] = (6, 16),
        hidden: Sequence[int] = (120, 84),
    ):
        super().__init__()
        if len(channels) != 2 or len(hidden) != 2:
            raise ValueError(
                f"CNN7 has two conv and two hidden linear layers: got channels={list(channels)}, "
                f"hidden={list(hidden)}"
            )
        sizes = [classes, in_channels, *channels, *hidden]
        if any(s < 1 for s in sizes):
            raise ValueError(f"CNN7 sizes must be positive, got {sizes}")
        spatial = ((image_size - 4) // 2 - 4) // 2
        if spatial < 1:
            raise ValueError(
                f"CNN7 needs image_size >= 16 (two valid 5x5 convs and two 2x2 pools), "
                f"got {image_size}"
            )
        self.input_shape = (in_channels, image_size, image_size)
        c1, c2 = channels
        h1, h2 = hidden
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.body = nn.Sequential(
            nn.Linear(c2 * spatial * spatial, h1), nn.ReLU(), nn.Linear(h1, h2), nn.ReLU()
        )
        self.head = nn.Linear(h2, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(torch.flatten(self.features(x), 1)))

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        def body() -> Tensor:
            maps = apply_layer(self.features, "features.", state, inputs)
            return apply_layer(self.body, "body.", state, torch.flatten(maps, 1))

        return apply_layer(self.head, "head.", state, self._body(inputs, body))


@MODELS.register
class CNN7Config(ModelConfig):
    """FedNest's 7-layer LeNet-5 CNN (no BatchNorm; images of at least 16x16: two valid 5x5
    convs and two 2x2 pools): the two convs and two hidden linear layers are x, the head y."""

    name: Literal["cnn7"]
    channels: list[Width] = Field(
        default_factory=lambda: [6, 16],
        min_length=2,
        max_length=2,
        description="the two conv widths",
    )
    hidden: list[Width] = Field(
        default_factory=lambda: [120, 84],
        min_length=2,
        max_length=2,
        description="the two hidden linear widths",
    )

    min_image_size: ClassVar[int] = 16

    def build(self, input_shape: tuple[int, ...], classes: int) -> CNN7:
        channels, size = self.image(input_shape)
        return CNN7(classes, channels, size, self.channels, self.hidden)
