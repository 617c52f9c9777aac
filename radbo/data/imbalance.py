"""Long-tailed (class-imbalanced) subsets: the exponential profile of Cao et al. (2019, LDAM)
and Kini et al. (2021, VS loss).

Class ``c`` of ``C`` (classes sorted by index) keeps a fraction ``imbalance ** (-c / (C - 1))``
of its examples: class 0 keeps all of them, class ``C - 1`` a ``1 / imbalance`` share, so the
ratio between the largest and the smallest class is about ``imbalance`` when the classes start
out balanced. The RABO paper's loss-function-tuning experiment (``papers/rabo_rafbo.txt``,
Sec. V-B) builds its training data this way.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

from radbo.data.datasets import Dataset

__all__ = ["long_tail_counts", "long_tail_subset"]


def _check_imbalance(imbalance: float, where: str) -> float:
    if (
        isinstance(imbalance, bool)
        or not isinstance(imbalance, Real)
        or not math.isfinite(float(imbalance))
        or imbalance < 1
    ):
        raise ValueError(
            f"{where}: imbalance must be a finite number >= 1 (1 keeps every example), "
            f"got {imbalance!r}."
        )
    return float(imbalance)


def long_tail_counts(class_sizes: Tensor, imbalance: float) -> Tensor:
    """Examples each class keeps: ``floor(n_c * imbalance ** (-c / (C - 1)))``, at least 1 for
    a class that has examples (a class never disappears), ``C = len(class_sizes)``.

    >>> long_tail_counts(torch.tensor([100, 100, 100]), 10.0).tolist()
    [100, 31, 10]
    >>> long_tail_counts(torch.tensor([5, 0, 5]), 100.0).tolist()
    [5, 0, 1]

    Raises:
        ValueError: ``imbalance`` is not a finite number >= 1, or ``class_sizes`` is not a
            1-D tensor of non-negative integers.
    """
    imbalance = _check_imbalance(imbalance, "long_tail_counts")
    if (
        not isinstance(class_sizes, Tensor)
        or class_sizes.ndim != 1
        or class_sizes.dtype.is_floating_point
        or class_sizes.dtype == torch.bool
        or (class_sizes.numel() > 0 and int(class_sizes.min()) < 0)
    ):
        raise ValueError(
            "long_tail_counts: class_sizes must be a 1-D tensor of non-negative integers, got "
            f"{class_sizes!r}."
        )
    num = class_sizes.numel()
    counts = []
    for c, n in enumerate(class_sizes.tolist()):
        fraction = imbalance ** (-c / (num - 1)) if num > 1 else 1.0
        # round first: float noise such as 30 * 0.1 = 3.0000000000000004 must not move a count
        keep = math.floor(round(n * fraction, 9))
        counts.append(min(n, max(keep, 1)) if n > 0 else 0)
    return torch.tensor(counts, dtype=torch.int64)


def long_tail_subset(ds: Dataset, imbalance: float, generator: torch.Generator) -> Dataset:
    """A long-tailed subset of ``ds``: class ``c`` of ``ds.num_classes`` keeps
    :func:`long_tail_counts` of its examples, drawn at random (deterministically given
    ``generator``). The subset keeps the original sample order, the classes and the name;
    ``imbalance = 1`` returns ``ds`` itself.

    >>> ds = Dataset(torch.zeros(30, 1), torch.arange(3).repeat_interleave(10), 3, "toy")
    >>> sub = long_tail_subset(ds, 4.0, torch.Generator().manual_seed(0))
    >>> torch.bincount(sub.labels).tolist()
    [10, 5, 2]

    Raises:
        ValueError: ``imbalance`` is not a finite number >= 1.
    """
    imbalance = _check_imbalance(imbalance, "long_tail_subset")
    if imbalance == 1.0:
        return ds
    labels = ds.labels.cpu()
    sizes = torch.bincount(labels, minlength=ds.num_classes)
    counts = long_tail_counts(sizes, imbalance)
    chosen = []
    for cls, count in enumerate(counts.tolist()):
        members = torch.nonzero(labels == cls).flatten()
        order = torch.randperm(members.numel(), generator=generator)
        chosen.append(members[order[:count]])
    index = torch.sort(torch.cat(chosen)).values
    return ds.subset(index)
