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
    update: Mapping[str, Any],
    index_set: IndexSet,
    shapes: Mapping[str, torch.Size],
    *,
    finite: bool = True,
) -> str | None:
    """Why a client's update must not be aggregated, or ``None`` when it is sound.

    Every tensor of an update is in submodel coordinates of a model tensor, named either
    ``name`` or ``"prefix:name"`` (:func:`radbo.masks.index.alias`: SimFBO's v, an estimator's
    state). It must be a floating tensor of the shape the client's index set selects from
    ``name`` and hold no NaN or Inf. A faulty or malicious client can break any of these;
    the engine then rejects the whole update and counts it (``RoundRecord.rejected``).
    ``finite=False`` leaves out the NaN / Inf test (:func:`screen` makes it for a whole
    phase at once).

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
        if finite and tensor.is_floating_point() and not _finite([tensor])[0]:
            return f"{key!r} holds NaN or Inf"
    return None


def _finite(tensors: Sequence[Tensor]) -> list[bool]:
    """For each tensor, whether it holds no NaN or Inf: its sum is finite (a NaN or an Inf
    makes every sum NaN or infinite), or else, the sum having overflowed, every element is.
    One reduction per tensor (accumulated in float64: one operation, where a sum and a cast
    were two) and one read for all of them (on a GPU, one host synchronisation per phase
    instead of one per tensor of every client's update)."""
    if not tensors:
        return []
    sums = torch.stack([t.sum(dtype=torch.float64) for t in tensors]).tolist()
    return [
        math.isfinite(v) or bool(torch.isfinite(t).all())
        for v, t in zip(sums, tensors, strict=True)
    ]


def _unsound(
    results: Sequence[ClientResult],
    index_sets: Sequence[IndexSet],
    shapes: Mapping[str, torch.Size],
    checked: Sequence[int],
) -> set[int]:
    """The positions of ``checked`` whose result was rejected or fails
    :func:`update_problem`; the NaN / Inf tests of all their tensors read at once."""
    bad, tensors, owners = set(), [], []
    for j in checked:
        r = results[j]
        if r.rejected is not None or update_problem(r.update, index_sets[j], shapes, finite=False):
            bad.add(j)
            continue
        for t in r.update.values():
            if t.is_floating_point():
                tensors.append(t)
                owners.append(j)
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    for members in groups.values():
        flags = _finite([tensors[i] for i in members])
        bad.update(owners[i] for i, ok in zip(members, flags, strict=True) if not ok)
    return bad


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
    if not len(results) == len(index_sets) == len(lost) == len(slow):
        raise ValueError("screen needs one index set, lost and slow flag per result")
    checked = [j for j in range(len(results)) if not lost[j] and not slow[j]]
    unsound = _unsound(results, index_sets, shapes, checked)
    keep, gone, bad = [], [], []
    for j, r in enumerate(results):
        if lost[j]:
            gone.append(r.client)
        elif slow[j]:
            continue
        elif j in unsound:
            bad.append(r.client)
        else:
            keep.append(j)
    late = [r.client for r, s in zip(results, slow, strict=True) if s]
    return Screened(keep=keep, dropped=gone, rejected=bad, late=late)
