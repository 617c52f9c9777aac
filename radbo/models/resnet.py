"""ResNet-18 (CIFAR-style stem): the residual backbone is x, the linear classifier is y."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.models.base import MODELS, BatchNormConfig, BilevelModel, Width
from radbo.models.functional import apply_layer, layer_rule


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity or 1x1 projection shortcut (He et al., 2016)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


@layer_rule(BasicBlock)
def _basic_block(block: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
    # BasicBlock.forward on the tensors of ``state``
    assert isinstance(block, BasicBlock)

    def conv_bn(i: str, h: Tensor) -> Tensor:
        h = apply_layer(getattr(block, "conv" + i), f"{prefix}conv{i}.", state, h)
        return apply_layer(getattr(block, "bn" + i), f"{prefix}bn{i}.", state, h)

    out = apply_layer(block.relu, "", state, conv_bn("1", x))
    out = conv_bn("2", out)
    out = out + apply_layer(block.shortcut, prefix + "shortcut.", state, x)
    return apply_layer(block.relu, "", state, out)


class ResNet18(BilevelModel):
    """ResNet-18 for 32x32 inputs (3x3 stem, no max-pool), as in HeteroFL / FedRolex.

    ``widths`` scales the four stages (default 64, 128, 256, 512). The backbone is x; ``head``
    (the classifier) is y.
    """

    inner_modules: tuple[str, ...] = ("head",)
    output_layers = ("head",)

    def __init__(
        self,
        classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        widths: Sequence[int] = (64, 128, 256, 512),
    ):
        super().__init__()
        if len(widths) != 4 or any(w < 1 for w in widths) or classes < 1:
            raise ValueError(f"ResNet18 needs 4 positive stage widths, got {list(widths)}")
        self.input_shape = (in_channels, image_size, image_size)
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        in_planes = widths[0]
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(
                nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1))
            )
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_planes, classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.pool(self.layers(self.stem(x)))
        return self.head(torch.flatten(out, 1))

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        def body() -> Tensor:
            out = apply_layer(self.stem, "stem.", state, inputs)
            out = apply_layer(self.layers, "layers.", state, out)
            return torch.flatten(apply_layer(self.pool, "pool.", state, out), 1)

        return apply_layer(self.head, "head.", state, self._body(inputs, body))


@MODELS.register
class ResNet18Config(BatchNormConfig):
    """ResNet-18, CIFAR-style stem (HeteroFL / FedRolex; images of at least 9x9, so that the
    last stage stays at least 2x2 and its BatchNorm takes a batch of one): backbone is x, head
    is y."""

    name: Literal["resnet18"]
    widths: list[Width] = Field(
        default_factory=lambda: [64, 128, 256, 512],
        min_length=4,
        max_length=4,
        description="the four stage widths",
    )

    min_image_size: ClassVar[int] = 9

    def build(self, input_shape: tuple[int, ...], classes: int) -> ResNet18:
        channels, size = self.image(input_shape)
        return ResNet18(classes, channels, size, self.widths)
