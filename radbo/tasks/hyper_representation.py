"""Hyper-representation learning: the backbone is x, the classification head is y.

    min_x  sum_i f_i(x, y*(x)),  f_i = CE on client i's validation split,
    y*(x) = argmin_y sum_i g_i(x, y),  g_i = CE on client i's training split + (mu/2)||y||^2.

This is the hyper-representation problem of FedNest/FedMSA (``papers/fedmsa.txt``) and of the
RABO paper's experiments (``papers/rabo_rafbo.txt``, Sec. V-A). The L2 term makes g strongly
convex in y for a linear head (CE is convex in the head's weights), which the implicit
hypergradient (RABO eq. (7)) needs.

**What keeps g's step stable.** g's Hessian in the head is at most ``1/2 lambda_max(E[phi
phi^T]) + mu`` over the backbone's features phi(x) (with the bias's 1; a softmax's Hessian in
its logits is at most 1/2), so an inner step of size ``inner_lr`` is stable while ``inner_lr
(1/2 lambda_max(E[phi phi^T]) + mu) < 2``. x moves that curvature only through the scale of
the features; no box bounds it (the scale is no single coordinate of x). The ``[algorithm]
divergence`` guard (:mod:`radbo.simulation.divergence`) catches a run that blows up anyway.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from torch import Tensor, nn

from radbo.problem import Batch, cross_entropy, forward, l2_penalty
from radbo.tasks.base import TASKS, InnerL2, TaskConfig
from radbo.typing import Params


@TASKS.register
class HyperRepresentation(TaskConfig):
    """Cross-entropy losses with an L2 penalty ``inner_l2/2 * ||y||^2`` on the inner loss
    (``[task] name = "hyper_representation"``: backbone = x, head = y; RABO Sec. V-A,
    FedNest, FedMSA)."""

    name: Literal["hyper_representation"] = "hyper_representation"
    inner_l2: float = InnerL2(1e-2)

    #: both losses are a mean cross-entropy over the batch plus batch-free terms, so a
    #: padded example (target ``PAD_TARGET``) counts for nothing (radbo.client.pads_minibatches)
    pads_minibatches: ClassVar[bool] = True

    def build(self, train: Any) -> HyperRepresentation:
        return self

    def regularizer(self, module: nn.Module, x: Params, y: Params) -> Tensor | float:
        """A further term of the inner loss after the cross-entropy (none here)."""
        return 0.0

    def inner_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        logits = forward(module, x, y, buffers, batch.inputs)
        loss = cross_entropy(logits, batch.targets) + self.regularizer(module, x, y)
        if self.inner_l2:
            loss = loss + l2_penalty(y, self.inner_l2)
        return loss

    def outer_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        return cross_entropy(forward(module, x, y, buffers, batch.inputs), batch.targets)
