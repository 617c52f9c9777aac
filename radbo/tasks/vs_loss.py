"""Loss-function tuning on long-tailed data: x = the per-class VS-loss hyperparameters (w, l, D),
y = the network.

    min_x  sum_i f_i,  f_i = class-balanced CE of the plain logits on client i's validation split,
    y*(x) = argmin_y sum_i g_i(x, y),
    g_i = VS loss with x on client i's training split + mu/2 ||y||^2,

the bilevel VS-loss tuning of AutoBalance (Li et al., 2021) and of the RABO paper's
loss-function-tuning experiment (``papers/rabo_rafbo.txt``, Sec. V-B). For logits z and label c,
``VS(z, c) = -w_c log softmax(D * z + l)_c`` (Kini et al., 2021), averaged over the batch. The
outer loss weights each example by ``class_weights[c]`` (the inverse training frequency of its
class, normalised to mean 1), so that every class counts equally however rare it is in the
(long-tailed) validation split.

The model (:class:`radbo.models.vs_mlp.VSMLP`) holds x; x does not enter the forward pass, only
g. With a linear network (no hidden layer) g is strongly convex in y (the VS loss is a convex
function of the logits, which are linear in y, plus ``inner_l2``). With hidden layers g is not
convex, and the implicit hypergradient (RABO eq. (7)) is then a heuristic, as in the papers.

**What keeps g's step stable.** The VS loss's Hessian in the logits is at most ``1/2 max_c
w_c D_c^2`` (``w = exp(vs_log_weight)``, ``D = exp(vs_log_scale)``), so g's curvature in y
grows like ``exp(x)`` as ``feature_l2``'s does, and a fixed ``inner_lr`` is stable only while
``inner_lr`` times that curvature (times the features' second moment, plus ``mu``) stays below
2. Nothing bounds x here: all of it starts at 0 (w = D = 1, plain cross-entropy) and the runs
of the examples stay far from the edge; the ``[algorithm] divergence`` guard
(:mod:`radbo.simulation.divergence`) catches a run that gets there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radbo.problem import Batch, forward, l2_penalty, nll_loss
from radbo.tasks.base import TASKS, InnerL2, TaskConfig
from radbo.typing import Params


def vs_cross_entropy(
    logits: Tensor, targets: Tensor, weight: Tensor, shift: Tensor, scale: Tensor
) -> Tensor:
    """Mean over the batch of ``-weight[c] * log softmax(scale * z + shift)[c]``, for logits z
    ``(N, C)``, labels c ``(N,)`` and per-class ``weight``, ``shift``, ``scale`` ``(C,)``.

    >>> z, c = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    >>> ones, zeros = torch.ones(2), torch.zeros(2)
    >>> bool(vs_cross_entropy(z, c, ones, zeros, ones) == F.cross_entropy(z, c))
    True
    """
    log_probs = F.log_softmax(logits * scale + shift, dim=1)
    # each row scaled by its example's weight, then F.cross_entropy's own reduction (nll_loss
    # of log_softmax): at w = 1, l = 0, D = 1 every step is exact and the result is
    # bit-for-bit F.cross_entropy(logits, targets)
    return nll_loss(log_probs * weight[targets].unsqueeze(1), targets)


def balanced_class_weights(labels: Tensor, num_classes: int) -> Tensor:
    """Inverse class frequencies of ``labels``, normalised to mean 1 over the classes present
    (a class absent from ``labels`` gets weight 0). Balanced labels give all ones.

    >>> balanced_class_weights(torch.tensor([0, 0, 0, 1]), 2).tolist()
    [0.5, 1.5]
    """
    counts = torch.bincount(labels.cpu(), minlength=num_classes).to(torch.float64)
    if int(counts.sum()) == 0:
        raise ValueError("balanced_class_weights: labels is empty")
    present = counts > 0
    inverse = torch.where(present, 1.0 / counts.clamp(min=1), torch.zeros_like(counts))
    return (inverse / inverse[present].mean()).to(torch.float32)


@runtime_checkable
class _VSModel(Protocol):
    """A model holding the VS-loss hyperparameters, like :class:`~radbo.models.VSMLP`
    (tasks may not import models)."""

    def vs_parameters(self, x: Params) -> tuple[Tensor, Tensor, Tensor]: ...


@dataclass(frozen=True, eq=False)
class VSLoss:
    """VS inner loss (x read from the model, :meth:`~radbo.models.VSMLP.vs_parameters`) with
    an L2 term ``inner_l2/2 * ||y||^2``; class-balanced cross-entropy outer loss.

    g is strongly convex in y only for a linear network (``VSMLP(hidden=[])``); with hidden
    layers the implicit hypergradient is a heuristic (damped CG keeps it stable in practice).

    Args:
        class_weights: per-class weights of the outer loss, ``(C,)``; the task built from a
            config uses :func:`balanced_class_weights` of the training labels.
        inner_l2: L2 weight on all of y.
    """

    class_weights: Tensor
    inner_l2: float = 1e-3

    def __post_init__(self) -> None:
        if not self.inner_l2 >= 0:
            raise ValueError(f"VSLoss.inner_l2 must be >= 0, got {self.inner_l2}")
        w = self.class_weights
        if not isinstance(w, Tensor) or w.ndim != 1 or not bool(torch.isfinite(w).all()):
            raise ValueError(
                f"VSLoss.class_weights must be a 1-D tensor of finite weights, got {w!r}"
            )
        if bool((w < 0).any()):
            raise ValueError(f"VSLoss.class_weights must be >= 0, got {w.tolist()}")

    @classmethod
    def balanced(
        cls, labels: Tensor | Sequence[int], num_classes: int, inner_l2: float = 1e-3
    ) -> VSLoss:
        """The task whose outer loss weights classes by their inverse frequency in ``labels``
        (the training labels)."""
        labels = torch.as_tensor(labels, dtype=torch.int64)
        return cls(balanced_class_weights(labels, num_classes), inner_l2)

    def inner_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        assert isinstance(module, _VSModel), "the VS loss reads x through VSMLP.vs_parameters"
        logits = forward(module, x, y, buffers, batch.inputs)
        weight, shift, scale = module.vs_parameters(x)
        loss = vs_cross_entropy(logits, batch.targets, weight, shift, scale)
        if self.inner_l2:
            loss = loss + l2_penalty(y, self.inner_l2)
        return loss

    def outer_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        logits = forward(module, x, y, buffers, batch.inputs)
        nll = F.cross_entropy(logits, batch.targets, reduction="none")
        weights = self.class_weights.to(device=logits.device, dtype=logits.dtype)
        return (weights[batch.targets] * nll).mean()


@TASKS.register
class VSLossTask(TaskConfig):
    """Loss-function tuning on long-tailed data (``[task] name = "vs_loss"``, model
    ``vs_mlp`` or ``vs_resnet18``): x = the per-class VS-loss hyperparameters (weight,
    additive shift, logit scale), y = the network; g is the VS loss on the training split, f
    the class-balanced cross-entropy on the validation split, weighted by the inverse class
    frequencies of the training set."""

    name: Literal["vs_loss"]
    inner_l2: float = InnerL2(1e-3)

    models: ClassVar[tuple[str, ...] | None] = ("vs_mlp", "vs_resnet18")

    def build(self, train: Any) -> VSLoss:
        return VSLoss.balanced(train.labels, train.num_classes, inner_l2=self.inner_l2)
