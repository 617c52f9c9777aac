"""Hyperparameter optimization: one L2 regularization weight per input feature.

    min_x  sum_i f_i,  f_i = CE on client i's validation split,
    y*(x) = argmin_y sum_i g_i(x, y),
    g_i = CE on client i's training split + 1/2 sum_j exp(x_j) ||W_{:, j}||^2 + mu/2 ||y||^2.

The model (:class:`radbo.models.logistic.FeatureL2Logistic`) supplies the regularizer; x does
not enter the forward pass, only g. The small ``inner_l2`` term ``mu`` keeps g strongly convex
in the bias too (the per-feature term covers the weights), as the implicit hypergradient needs.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Protocol, runtime_checkable

from torch import Tensor, nn

from radbo.tasks.base import TASKS, InnerL2
from radbo.tasks.hyper_representation import HyperRepresentation
from radbo.typing import Params


@runtime_checkable
class _RegularizedModel(Protocol):
    """A model supplying the inner loss's regularizer, like
    :class:`~radbo.models.logistic.FeatureL2Logistic` (tasks may not import models)."""

    def regularizer(self, x: Params, y: Params) -> Tensor: ...


@TASKS.register
class FeatureL2(HyperRepresentation):
    """Cross-entropy losses (:class:`HyperRepresentation`'s); the inner one adds the model's
    per-feature L2 regularizer before the ``inner_l2`` term (``[task] name = "feature_l2"``,
    model ``logistic``: x is outside the forward pass, so there is nothing to prune)."""

    # a subclass narrowing its parent's Literal tag: pydantic's tagged unions need it, mypy
    # sees an incompatible override
    name: Literal["feature_l2"] = "feature_l2"  # type: ignore[assignment]
    inner_l2: float = InnerL2(1e-3)

    model: ClassVar[str | None] = "logistic"
    maskable: ClassVar[bool] = False

    def regularizer(self, module: nn.Module, x: Params, y: Params) -> Tensor:
        assert isinstance(module, _RegularizedModel), "feature_l2 needs the logistic model"
        return module.regularizer(x, y)
