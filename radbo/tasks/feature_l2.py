"""Hyperparameter optimization: one L2 regularization weight per input feature.

    min_x  sum_i f_i,  f_i = CE on client i's validation split,
    y*(x) = argmin_y sum_i g_i(x, y),
    g_i = CE on client i's training split + 1/2 sum_j exp(x_j) ||W_{:, j}||^2 + mu/2 ||y||^2.

The model (:class:`radbo.models.logistic.FeatureL2Logistic`) supplies the regularizer; x does
not enter the forward pass, only g. The small ``inner_l2`` term ``mu`` keeps g strongly convex
in the bias too (the per-feature term covers the weights), as the implicit hypergradient needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from radbo.problem import Batch, forward, l2_penalty
from radbo.typing import Params


@dataclass(frozen=True)
class FeatureL2:
    """Cross-entropy losses; the inner one adds the model's per-feature L2 regularizer."""

    inner_l2: float = 1e-3

    def __post_init__(self) -> None:
        if not self.inner_l2 >= 0:
            raise ValueError(f"FeatureL2.inner_l2 must be >= 0, got {self.inner_l2}")

    def inner_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        logits = forward(module, x, y, buffers, batch.inputs)
        loss = F.cross_entropy(logits, batch.targets) + module.regularizer(x, y)
        if self.inner_l2:
            loss = loss + l2_penalty(y, self.inner_l2)
        return loss

    def outer_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        return F.cross_entropy(forward(module, x, y, buffers, batch.inputs), batch.targets)
