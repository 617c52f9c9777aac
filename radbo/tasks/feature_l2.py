"""Hyperparameter optimization: one L2 regularization weight per input feature.

    min_x  sum_i f_i,  f_i = CE on client i's validation split,
    y*(x) = argmin_y sum_i g_i(x, y),
    g_i = CE on client i's training split + 1/2 sum_j exp(x_j) ||W_{:, j}||^2 + mu/2 ||y||^2.

The model (:class:`radbo.models.logistic.FeatureL2Logistic`) supplies the regularizer; x does
not enter the forward pass, only g. The small ``inner_l2`` term ``mu`` keeps g strongly convex
in the bias too (the per-feature term covers the weights), as the implicit hypergradient needs.

**What keeps g's step stable: a box on x** (``max_log_l2``, default ``"auto"``). g's Hessian
in y is ``H = H_CE + diag(exp(x_j) on the weights of feature j) + mu I``, so its curvature
grows like ``exp(max_j x_j)``: a gradient step of size ``beta`` (the algorithm's ``inner_lr``)
on g is stable while ``beta * lambda_max(H) < 2``, and ``lambda_max(H) <= max_j exp(x_j) +
lambda_CE + mu`` with ``lambda_CE <= 1/2 lambda_max(E[a a^T])`` over the inputs a (with the
bias's 1; a softmax's Hessian in the logits is at most 1/2). Alone, the regularizer's part of
the step multiplies column j of the weights by ``1 - beta exp(x_j)``: it oscillates once
``beta exp(x_j) > 1`` and blows up past 2. Nothing else bounds x -- a feature the validation
loss wants silenced drives its x_j up without end (its hypergradient decays only like
``exp(-x_j)``) -- so a run with a fixed ``inner_lr`` reaches that edge sooner or later.
Measured without the box, RABO with ``inner_lr = 0.1``, T = 10 on the synthetic 20-feature
problem of ``tests/simulation/test_divergence.py``: y blows up in round 579 (minibatches of 32,
``outer_lr = 20``; test loss 5e4 after 1,000 rounds, max x 1e6) or 297 (full batches,
``outer_lr = 50``); issue 15 reports round ~1,750 at ``outer_lr = 5`` (max x 2.9 -> 781). The
``[algorithm] divergence`` guard catches it (:mod:`radbo.simulation.divergence`). ``"auto"``
bounds every
``x_j <= log(1 / beta)``, i.e. ``beta exp(x_j) <= 1``: the regularizer's part of the step
never overshoots (factor in [0, 1)), and the whole step is stable as long as ``beta
(lambda_CE + mu) < 1`` -- half the range a step on the data term alone has, so any
``inner_lr`` that would be stable on the unregularized loss at twice its value. The engine
projects x onto the box after every round (:meth:`FeatureL2.outer_bounds`); after a
divergence rollback halves ``inner_lr`` the box widens by ``log 2``. A number sets the bound
itself; ``"off"`` removes it (an algorithm without ``inner_lr``, e.g. ``fedsvrbgd_fo``, gets no
``"auto"`` box).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import Field, field_validator
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
    max_log_l2: float | Literal["auto", "off"] = Field(
        "auto",
        description="upper bound on every log L2 weight x_j: 'auto' = log(1 / inner_lr) "
        "(keeps g's inner step stable), a number, or 'off'",
    )

    models: ClassVar[tuple[str, ...] | None] = ("logistic",)
    maskable: ClassVar[bool] = False
    dump_omits_defaults: ClassVar[tuple[str, ...]] = ("max_log_l2",)

    @field_validator("max_log_l2", mode="before")
    @classmethod
    def _one_bound(cls, value: Any) -> Any:
        if value in ("auto", "off"):
            return value
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError('expected "auto", "off" or a finite number')
        return float(value)

    def regularizer(self, module: nn.Module, x: Params, y: Params) -> Tensor:
        assert isinstance(module, _RegularizedModel), "feature_l2 needs the logistic model"
        return module.regularizer(x, y)

    def outer_bounds(self, inner_lr: float | None) -> dict[str, tuple[float | None, float | None]]:
        """The box on x (``log_l2 <= max_log_l2``; see the module): ``"auto"`` is
        ``log(1 / inner_lr)``, so that ``inner_lr * exp(x_j) <= 1``; no box when it is
        ``"off"``, or ``"auto"`` without an ``inner_lr``.

        >>> FeatureL2().outer_bounds(0.5)
        {'log_l2': (None, 0.6931471805599453)}
        >>> FeatureL2(max_log_l2="off").outer_bounds(0.5)
        {}
        """
        bound = self.max_log_l2
        if bound == "off":
            return {}
        if bound == "auto":
            return {} if inner_lr is None else {"log_l2": (None, math.log(1.0 / inner_lr))}
        return {"log_l2": (None, float(bound))}
