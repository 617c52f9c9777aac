"""ResNet-18 with VS-loss hyperparameters: the RABO paper's loss-function-tuning model (Sec.
V-B, ``papers/rabo_rafbo.txt``: "80% training data to train the inner model Resnet18").

x = the per-class VS-loss parameters (:class:`~radbo.models.vs_mlp.VSParameters`), y = the
whole network, whose channels RABO's masks prune (the paper sets every client's capacity to
1/2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from radbo.models.base import MODELS
from radbo.models.resnet import ResNet18, ResNet18Config
from radbo.models.vs_mlp import VSParameters


class VSResNet18(VSParameters, ResNet18):
    """:class:`~radbo.models.resnet.ResNet18` (CIFAR stem) whose every layer is y, with the
    three per-class VS-loss vectors as x (they start at zero: plain cross-entropy).

    >>> model = VSResNet18(classes=3, image_size=16, widths=(4, 8, 8, 8))
    >>> model.outer_param_names()
    ['vs_log_weight', 'vs_shift', 'vs_log_scale']
    >>> tuple(model(model.example_input(2)).shape)
    (2, 3)
    """

    inner_modules: tuple[str, ...] = ("stem", "layers", "head")

    def __init__(
        self,
        classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        widths: Sequence[int] = (64, 128, 256, 512),
    ):
        ResNet18.__init__(self, classes, in_channels, image_size, widths)
        self.add_vs_parameters(classes)


@MODELS.register
class VSResNet18Config(ResNet18Config):
    """ResNet-18 (CIFAR stem) with per-class VS-loss hyperparameters (task ``vs_loss``): the
    whole network is y, the VS-loss weights, shifts and logit scales are x."""

    name: Literal["vs_resnet18"]  # type: ignore[assignment]

    task: ClassVar[str | None] = "vs_loss"

    def build(self, input_shape: tuple[int, ...], classes: int) -> VSResNet18:
        channels, size = self.image(input_shape)
        return VSResNet18(classes, channels, size, self.widths)
