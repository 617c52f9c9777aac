"""Logistic regression with one L2 weight per input feature: the hyperparameter-optimization
model (x = the log regularization weights, y = the classifier)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.models.base import MODELS, BilevelModel, ModelConfig
from radbo.models.functional import apply_layer
from radbo.typing import Params


class FeatureL2Logistic(BilevelModel):
    """``in -> classes`` linear classifier ``linear`` (y) and ``log_l2`` (x), one log weight
    per input feature, which only the inner loss reads (:meth:`regularizer`).

    The hyperparameter problem of SPEC "Tasks" (per-feature regularization, logistic
    regression), as in Pedregosa (2016) and the bilevel HPO experiments of FedNest / SimFBO::

        min_x  sum_i CE_val_i(y*(x)),
        y*(x) = argmin_y sum_i CE_train_i(y) + 1/2 sum_j exp(x_j) ||W_{:, j}||^2.

    Every class's weight on feature j shares the weight exp(x_j). x is not an input of the
    forward pass, so there is nothing to prune: the model trains whole on every client.
    """

    inner_modules = ("linear",)
    output_layers = ("linear",)
    loss_only_parameters = ("log_l2",)

    def __init__(self, in_features: int = 64, classes: int = 10, init_log_l2: float = -3.0):
        super().__init__()
        if in_features < 1 or classes < 1:
            raise ValueError(
                f"FeatureL2Logistic sizes must be positive, got in_features={in_features}, "
                f"classes={classes}"
            )
        self.input_shape = (in_features,)
        self.linear = nn.Linear(in_features, classes)
        self.log_l2 = nn.Parameter(torch.full((in_features,), float(init_log_l2)))

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x.flatten(1))

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        return apply_layer(self.linear, "linear.", state, inputs.flatten(1))

    @staticmethod
    def regularizer(x: Params, y: Params) -> Tensor:
        """``1/2 sum_j exp(x_j) ||W_{:, j}||^2`` over the columns of the classifier's weight."""
        return 0.5 * (torch.exp(x["log_l2"]) * y["linear.weight"].pow(2).sum(0)).sum()


@MODELS.register
class LogisticConfig(ModelConfig):
    """Logistic regression on flattened inputs with one L2 weight per input feature: the
    classifier is y, the log weights ``log_l2`` are x (task ``feature_l2``)."""

    name: Literal["logistic"]
    init_log_l2: float = Field(
        -3.0, allow_inf_nan=False, description="initial log L2 weight of every feature"
    )

    flat: ClassVar[bool] = True
    task: ClassVar[str | None] = "feature_l2"

    def build(self, input_shape: tuple[int, ...], classes: int) -> FeatureL2Logistic:
        return FeatureL2Logistic(math.prod(input_shape), classes, self.init_log_l2)
