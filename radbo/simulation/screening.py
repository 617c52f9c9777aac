"""Screening a phase's results before the server aggregates them.

A client's update reaches the server function only when it arrived (the client did not drop
out and its result was not lost), in time (:meth:`radbo.simulation.participation.
Participation.arrivals`), and is sound: not rejected by the backend and passing
:func:`update_problem`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from radbo.client import ClientResult
from radbo.typing import IndexSet

__all__ = ["Screened", "screen", "update_problem"]


def update_problem(
    update: Mapping[str, Any], index_set: IndexSet, shapes: Mapping[str, torch.Size]
) -> str | None:
    """Why a client's update must not be aggregated, or ``None`` when it is sound.

    Every tensor of an update is in submodel coordinates of a model tensor, named either
    ``name`` or ``"prefix:name"`` (:func:`radbo.masks.index.alias`: SimFBO's v, an estimator's
    state). It must be a floating tensor of the shape the client's index set selects from
    ``name`` and hold no NaN or Inf. A faulty or malicious client can break any of these;
    the engine then rejects the whole update and counts it (``RoundRecord.rejected``).

    >>> import torch
    >>> shapes = {"w": torch.Size([3])}
    >>> update_problem({"w": torch.ones(2)}, {"w": (torch.tensor([0, 2]),)}, shapes) is None
    True
    >>> update_problem({"v:w": torch.ones(3)}, {"w": (torch.tensor([0, 2]),)}, shapes)
    "'v:w' has shape (3,), expected (2,)"
    >>> update_problem({"w": torch.tensor([1.0, float("inf"), 0.0])}, {"w": (None,)}, shapes)
    "'w' holds NaN or Inf"
    """
    for key, tensor in update.items():
        name = key.rsplit(":", 1)[-1]
        if name not in shapes:
            return f"{key!r} is not a model tensor"
        if not isinstance(tensor, Tensor):
            return f"{key!r} is a {type(tensor).__name__}, not a tensor"
        index = index_set.get(name, (None,) * len(shapes[name]))
        expected = tuple(
            n if i is None else int(i.numel()) for i, n in zip(index, shapes[name], strict=True)
        )
        if tuple(tensor.shape) != expected:
            return f"{key!r} has shape {tuple(tensor.shape)}, expected {expected}"
        if tensor.is_floating_point() and not _finite(tensor):
            return f"{key!r} holds NaN or Inf"
    return None


def _finite(tensor: Tensor) -> bool:
    """No NaN or Inf in ``tensor``: its sum is finite (a NaN or an Inf makes every sum NaN or
    infinite), or else, the sum having overflowed, every element is. One reduction and one
    read instead of an elementwise test, a reduction and a read, for every client's update."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


@dataclass(frozen=True)
class Screened:
    """A phase's results sorted by :func:`screen`.

    Attributes:
        keep: positions of the results the server aggregates.
        dropped: clients that dropped out (or whose result was lost).
        rejected: clients whose update the backend rejected or that fails
            :func:`update_problem`.
        late: clients whose result arrived too late.
    """

    keep: list[int]
    dropped: list[int]
    rejected: list[int]
    late: list[int]


def screen(
    results: Sequence[ClientResult],
    index_sets: Sequence[IndexSet],
    lost: Sequence[bool],
    slow: Sequence[bool],
    shapes: Mapping[str, torch.Size],
) -> Screened:
    """Sort a phase's results: lost ones (``lost``) dropped out, late ones (``slow``) are
    left out, and of the others the unsound ones are rejected; the rest are kept."""
    keep, gone, bad = [], [], []
    for j, (r, idx, dropped) in enumerate(zip(results, index_sets, lost, strict=True)):
        if dropped:
            gone.append(r.client)
        elif slow[j]:
            continue
        elif r.rejected is not None or update_problem(r.update, idx, shapes) is not None:
            bad.append(r.client)
        else:
            keep.append(j)
    late = [r.client for r, s in zip(results, slow, strict=True) if s]
    return Screened(keep=keep, dropped=gone, rejected=bad, late=late)
