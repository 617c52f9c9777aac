"""ResNet-12, the few-shot backbone of MetaOptNet and RFS: the backbone is x, the head is y."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.models.base import MODELS, BatchNormConfig, BilevelModel, Width
from radbo.models.functional import apply_layer, layer_rule

#: Stage widths of ResNet-12 in MetaOptNet (Lee et al., CVPR 2019) and RFS (Tian et al., 2020).
RESNET12_WIDTHS: tuple[int, int, int, int] = (64, 160, 320, 640)


class ResNet12Block(nn.Module):
    """Three 3x3 conv-BN layers with LeakyReLU(0.1), a 1x1 conv-BN shortcut, then 2x2 max-pool.

    ``out = maxpool(lrelu(bn3(conv3(h2)) + bn_s(conv_s(x))))`` with
    ``h1 = lrelu(bn1(conv1(x)))`` and ``h2 = lrelu(bn2(conv2(h1)))``; convolutions have no bias.
    This is the ``BasicBlock`` of RFS (``models/resnet.py`` of WangYueFt/rfs) and of MetaOptNet
    (``models/ResNet12_embedding.py`` of kjunelee/MetaOptNet) without DropBlock: every block
    halves the resolution, so it always has the projection shortcut.
    """

    def __init__(self, in_planes: int, planes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential(
            nn.Conv2d(in_planes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        )
        self.relu = nn.LeakyReLU(0.1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.pool(self.relu(out + self.shortcut(x)))


@layer_rule(ResNet12Block)
def _resnet12_block(
    block: nn.Module, prefix: str, state: Mapping[str, Tensor], x: Tensor
) -> Tensor:
    # ResNet12Block.forward on the tensors of ``state``
    assert isinstance(block, ResNet12Block)

    def conv_bn(i: str, h: Tensor) -> Tensor:
        h = apply_layer(getattr(block, "conv" + i), f"{prefix}conv{i}.", state, h)
        return apply_layer(getattr(block, "bn" + i), f"{prefix}bn{i}.", state, h)

    relu = block.relu
    out = apply_layer(relu, "", state, conv_bn("1", x))
    out = apply_layer(relu, "", state, conv_bn("2", out))
    out = conv_bn("3", out)
    out = out + apply_layer(block.shortcut, prefix + "shortcut.", state, x)
    return apply_layer(block.pool, "", state, apply_layer(relu, "", state, out))


class ResNet12(BilevelModel):
    """ResNet-12 for few-shot learning: four :class:`ResNet12Block` s, global average pool, head.

    The architecture of MetaOptNet (Lee et al., "Meta-Learning with Differentiable Convex
    Optimization", CVPR 2019) and RFS (Tian et al., "Rethinking Few-Shot Image Classification: a
    Good Embedding Is All You Need?", ECCV 2020), the backbone RABO uses as x for few-shot
    hyper-representation (papers/rabo_rafbo.txt, Sec. V-A: "We use the Resnet12 backbone as x
    ... and a MLP as y"); here y is a linear ``head`` (a one-layer classifier, as in
    MetaOptNet's linear base learners). Weights are initialised as in RFS: Kaiming-normal
    (fan-out, leaky ReLU) convs, BatchNorm weight 1 and bias 0.

    DropBlock (RFS, MetaOptNet) is left out: it is a stochastic regulariser with no parameters,
    and a deterministic network is what submodel extraction, the masked-full-model
    equivalence and FLOP counting need. Add dropout outside the model if wanted.

    Args:
        classes: outputs of the head (the N of N-way tasks); default 5.
        in_channels: input channels; default 3 (miniImageNet). Omniglot: 1.
        image_size: input height and width; default 84 (miniImageNet), e.g. 28 for Omniglot or
            32 for CIFAR-FS. At least 16 (four 2x2 max-pools).
        widths: the four stage widths; default ``(64, 160, 320, 640)``.
        width_scale: multiplies every width (rounded, at least 1); default 1.

    >>> model = ResNet12(classes=5, in_channels=1, image_size=28, width_scale=0.25)
    >>> [b.conv1.out_channels for b in model.layers], tuple(model(model.example_input(2)).shape)
    ([16, 40, 80, 160], (2, 5))
    """

    inner_modules = ("head",)
    output_layers = ("head",)

    def __init__(
        self,
        classes: int = 5,
        in_channels: int = 3,
        image_size: int = 84,
        widths: Sequence[int] = RESNET12_WIDTHS,
        width_scale: float = 1.0,
    ):
        super().__init__()
        if len(widths) != 4 or any(w < 1 for w in widths):
            raise ValueError(f"ResNet12 needs 4 positive stage widths, got {list(widths)}")
        if not width_scale > 0:
            raise ValueError(f"ResNet12 width_scale must be positive, got {width_scale}")
        if classes < 1 or in_channels < 1:
            raise ValueError(
                f"ResNet12 classes and in_channels must be positive, got classes={classes}, "
                f"in_channels={in_channels}"
            )
        if image_size < 16:
            raise ValueError(
                f"ResNet12 halves the resolution four times, so image_size must be at least 16, "
                f"got {image_size}"
            )
        self.input_shape = (in_channels, image_size, image_size)
        scaled = [max(1, round(w * width_scale)) for w in widths]
        blocks: list[nn.Module] = []
        in_planes = in_channels
        for planes in scaled:
            blocks.append(ResNet12Block(in_planes, planes))
            in_planes = planes
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_planes, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="leaky_relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    @property
    def feature_dim(self) -> int:
        """Width of the pooled representation that the head reads (640 by default)."""
        return self.head.in_features

    def forward(self, x: Tensor) -> Tensor:
        out = self.pool(self.layers(x))
        return self.head(torch.flatten(out, 1))

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        def body() -> Tensor:
            out = apply_layer(self.layers, "layers.", state, inputs)
            return torch.flatten(apply_layer(self.pool, "pool.", state, out), 1)

        return apply_layer(self.head, "head.", state, self._body(inputs, body))


@MODELS.register
class ResNet12Config(BatchNormConfig):
    """ResNet-12 (MetaOptNet / RFS; images of at least 16x16: four 2x2 pools): backbone is x,
    head is y."""

    name: Literal["resnet12"]
    widths: list[Width] = Field(
        default_factory=lambda: [64, 160, 320, 640],
        min_length=4,
        max_length=4,
        description="the four stage widths",
    )

    min_image_size: ClassVar[int] = 16

    def build(self, input_shape: tuple[int, ...], classes: int) -> ResNet12:
        channels, size = self.image(input_shape)
        return ResNet12(classes, channels, size, self.widths)
