"""Evaluating the global model: accuracy, balanced accuracy and loss on the test set, with the
server's BatchNorm recalibration for static BN."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radbo.data import Dataset, calibration_set
from radbo.models import BatchNormConfig, BilevelModel
from radbo.problem import calibrate_batchnorm, forward, split_state
from radbo.typing import Params

if TYPE_CHECKING:
    from radbo.config import RunConfig

__all__ = ["calibrate_batchnorm", "calibration_inputs", "make_evaluator"]

# Test examples per forward pass of the evaluator (bounds its memory on large test sets).
_EVAL_BATCH = 1024


def make_evaluator(
    model: BilevelModel,
    test: Dataset,
    outer_names: list[str],
    inner_names: list[str],
    calibration: torch.Tensor | None = None,
) -> Callable[[Params], dict[str, float]]:
    """Accuracy, balanced accuracy (mean per-class recall) and cross-entropy of the global
    model on the held-out test set.

    With ``calibration`` inputs (static BatchNorm), the BatchNorm running statistics are first
    recomputed from scratch over them (cumulative average, in training mode) for the model
    being evaluated, and the state's own statistics are ignored.
    """
    module = model
    outer, inner = set(outer_names), set(inner_names)

    def evaluate(state: Params) -> dict[str, float]:
        was_training = module.training
        try:
            with torch.no_grad():
                x, y, b = split_state(state, outer, inner)
                if calibration is not None:
                    b = calibrate_batchnorm(module, x, y, b, calibration)
                module.eval()
                logits = torch.cat(
                    [forward(module, x, y, b, part) for part in test.features.split(_EVAL_BATCH)]
                )
                loss = F.cross_entropy(logits, test.labels)
                hit = (logits.argmax(1) == test.labels).float()
                acc = hit.mean()
                # mean per-class recall over the classes present: the figure of merit on
                # long-tailed training data (task vs_loss), equal to acc on balanced test sets
                counts = torch.bincount(test.labels, minlength=test.num_classes).float()
                hits = torch.bincount(test.labels, weights=hit, minlength=test.num_classes)
                present = counts > 0
                balanced = (hits[present] / counts[present]).mean()
        finally:
            module.train(was_training)
        return {"accuracy": float(acc), "loss": float(loss), "balanced_accuracy": float(balanced)}

    return evaluate


def calibration_inputs(config: RunConfig, train: Dataset) -> torch.Tensor | None:
    """The server's calibration set for static BN: the first ``calibration_samples`` of a
    seeded permutation of the training set (None without static BN)."""
    mc = config.model
    if not mc.static_batchnorm:
        return None
    assert isinstance(mc, BatchNormConfig), "only a BatchNormConfig has static BN"
    return calibration_set(train, int(mc.calibration_samples), config.seed)
