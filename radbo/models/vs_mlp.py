"""MLP classifier with VS-loss hyperparameters: the loss-function-tuning model (x = the per-class
VS-loss parameters, y = the whole network)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.models.base import MODELS, ModelConfig, Width
from radbo.models.mlp import MLP
from radbo.typing import Params


class VSParameters(nn.Module):
    """The VS-loss hyperparameters as x: three per-class vectors that only the inner loss reads
    (:meth:`vs_parameters`); a model of the ``vs_loss`` task mixes this in and calls
    :meth:`add_vs_parameters` after building its network."""

    loss_only_parameters: tuple[str, ...] = ("vs_log_weight", "vs_shift", "vs_log_scale")

    def add_vs_parameters(self, classes: int) -> None:
        """The three vectors, at zero: the VS loss starts as plain cross-entropy."""
        self.vs_log_weight = nn.Parameter(torch.zeros(classes))
        self.vs_shift = nn.Parameter(torch.zeros(classes))
        self.vs_log_scale = nn.Parameter(torch.zeros(classes))

    @staticmethod
    def vs_parameters(x: Params) -> tuple[Tensor, Tensor, Tensor]:
        """``(w, l, D)``: the per-class weight, additive shift and multiplicative logit scale of
        the VS loss, read from x."""
        return torch.exp(x["vs_log_weight"]), x["vs_shift"], torch.exp(x["vs_log_scale"])


class VSMLP(VSParameters, MLP):
    """``in -> hidden[0] -> ... -> hidden[-1] -> classes`` with ReLU, flattening its input; the
    whole network (``body`` and ``head``) is y. x is three per-class vectors that only the
    inner loss reads (:meth:`vs_parameters`), the hyperparameters of the VS loss of Kini et al.
    (2021) for logits z and label c::

        VS(z, c) = -w_c log( exp(D_c z_c + l_c) / sum_k exp(D_k z_k + l_k) ),

    with ``w = exp(vs_log_weight)`` and ``D = exp(vs_log_scale)`` (positive) and
    ``l = vs_shift``. All start at zero, so that the VS loss starts as plain cross-entropy
    (w = 1, l = 0, D = 1).

    The hidden layers are prunable (RABO's masks prune y: the "mask y only" case of the RABO
    paper); the head keeps all its outputs and x, not in the forward pass, is never pruned.
    ``hidden = []`` is a linear classifier, on which the VS inner loss plus an L2 term is
    strongly convex in y.
    """

    inner_modules = ("body", "head")
    output_layers = ("head",)

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (128,), classes: int = 10):
        MLP.__init__(self, in_features, hidden, classes)
        self.add_vs_parameters(classes)


@MODELS.register
class VSMLPConfig(ModelConfig):
    """MLP classifier on flattened inputs with per-class VS-loss hyperparameters (task
    ``vs_loss``): the whole network is y (its hidden layers are prunable), the VS-loss weights,
    shifts and logit scales are x. ``hidden = []`` is a linear classifier."""

    name: Literal["vs_mlp"]
    hidden: list[Width] = Field(
        default_factory=lambda: [128], description="hidden layer widths; [] for a linear classifier"
    )

    flat: ClassVar[bool] = True
    task: ClassVar[str | None] = "vs_loss"

    def build(self, input_shape: tuple[int, ...], classes: int) -> VSMLP:
        return VSMLP(math.prod(input_shape), self.hidden, classes)
