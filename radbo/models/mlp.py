"""Multi-layer perceptron for hyper-representation: hidden layers are x, the output layer is y."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.models.base import MODELS, BilevelModel, ModelConfig, Width
from radbo.models.functional import apply_layer


class MLP(BilevelModel):
    """``in -> hidden[0] -> ... -> hidden[-1] -> classes`` with ReLU, flattening its input.

    The hidden layers (the representation) are the outer variables x; the output layer
    ``head`` is the inner variable y. ``MLP(784, [200], 10)`` is the FedNest/FedMSA
    hyper-representation network on MNIST; ``MLP(64, [128], 10)`` fits scikit-learn's digits.
    """

    inner_modules: tuple[str, ...] = ("head",)
    output_layers: tuple[str, ...] = ("head",)

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (128,), classes: int = 10):
        super().__init__()
        if in_features < 1 or classes < 1 or any(h < 1 for h in hidden):
            raise ValueError(
                f"{type(self).__name__} sizes must be positive, got in_features={in_features}, "
                f"hidden={list(hidden)}, classes={classes}"
            )
        self.input_shape = (in_features,)
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(torch.flatten(x, 1)))

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        hidden = self._body(
            inputs, lambda: apply_layer(self.body, "body.", state, torch.flatten(inputs, 1))
        )
        return apply_layer(self.head, "head.", state, hidden)


@MODELS.register
class MLPConfig(ModelConfig):
    """MLP on flattened inputs (any shape): hidden layers are x, the head is y."""

    name: Literal["mlp"] = "mlp"
    hidden: list[Width] = Field(
        default_factory=lambda: [128], min_length=1, description="hidden layer widths (x)"
    )

    flat: ClassVar[bool] = True

    def build(self, input_shape: tuple[int, ...], classes: int) -> MLP:
        return MLP(math.prod(input_shape), self.hidden, classes)
