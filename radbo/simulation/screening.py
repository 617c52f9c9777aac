"""Screening a phase's results before the server aggregates them.

A client's update reaches the server function only when it arrived (the client did not drop
out and its result was not lost), in time (:meth:`radbo.simulation.participation.
Participation.arrivals`), and is sound: not rejected by the backend and passing
:func:`update_problem`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
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


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`_finite` sums a tensor of ``dtype`` in: its own for float32 and
    float64, float32 for half precision."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _finite(
    tensors: Sequence[Tensor],
    accumulate: Callable[[torch.dtype], torch.dtype] = _accumulation,
) -> list[bool]:
    """For each tensor, whether it holds no NaN or Inf: its sum is finite (a NaN or an Inf
    makes every sum NaN or infinite, in any order of additions), or else, the sum having
    overflowed, every element is. The sums are read at once (on a GPU, one host
    synchronisation per phase instead of one per tensor of every client's update); the
    tensors that are equally spaced windows of one storage -- a stacked cohort's per-client
    slices of each update tensor -- are summed in one reduction (:func:`_windows`), so a
    phase costs a few operations per cohort, not one per tensor of every client.

    A float32 or float64 tensor is summed in its own dtype: a float64 accumulation of a
    float32 tensor converts every element, and on updates of pfl's CIFAR-10 CNN (1.6 M
    entries, one thread) it took 2x the float32 sum's time for one tensor per client and 25x
    for a stacked cohort's slices (BENCHMARKS.md, "The finiteness screen in the update's own
    dtype"). A float32 sum of finite entries overflows only past float32's largest value,
    3.4e38 (entries of 3.4e38 / numel on average, 2e32 for 1.6 M entries): such an update is
    looked at element by element, the one case that costs a second read. Half precision is
    accumulated in float32 (a float16 sum overflows from 65504). ``accumulate`` maps a
    tensor's dtype to its sum's (:func:`_accumulation`; ``benchmarks/screen_sums.py`` times
    float64 against it)."""
    if not tensors:
        return []
    groups = _windows(tensors)
    parts = []
    for _, view in groups:
        dims = tuple(range(1, view.ndim))
        wide = accumulate(view.dtype)
        parts.append(view.sum(dim=dims, dtype=wide) if dims else view.to(wide))
    sums = torch.cat(parts).tolist()  # cat promotes a float32 and float64 mix to float64
    order = [i for members, _ in groups for i in members]
    finite = [True] * len(tensors)
    for i, v in zip(order, sums, strict=True):
        finite[i] = math.isfinite(v) or bool(torch.isfinite(tensors[i]).all())
    return finite


def _windows(tensors: Sequence[Tensor]) -> list[tuple[list[int], Tensor]]:
    """``tensors`` (of one device) in groups, each with a view ``[k, *shape]`` whose rows are
    its members' elements: members of one storage, dtype, shape and strides whose storage
    offsets are equally spaced are one group (viewed with ``as_strided``, no copy); every other
    tensor, and a window met again, is a group of its own (``unsqueeze(0)``)."""
    alike: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0:  # a storage of no bytes may be shared: on its own
            alike[("empty", i)] = [i]
            continue
        key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape), t.stride())
        alike.setdefault(key, []).append(i)
    groups: list[tuple[list[int], Tensor]] = []
    for same in alike.values():
        at: dict[int, int] = {}  # storage offset -> the first member there
        repeats = []  # the same window again: on its own
        for i in sorted(same, key=lambda i: tensors[i].storage_offset()):
            if at.setdefault(int(tensors[i].storage_offset()), i) != i:
                repeats.append(i)
        members, offsets = list(at.values()), list(at)
        step = offsets[1] - offsets[0] if len(members) > 1 else 0
        if step > 0 and all(b - a == step for a, b in zip(offsets, offsets[1:], strict=False)):
            first = tensors[members[0]]
            size, stride = (len(members), *first.shape), (step, *first.stride())
            groups.append((members, first.as_strided(size, stride, offsets[0])))
        else:
            repeats += members
        groups.extend(([i], tensors[i].unsqueeze(0)) for i in repeats)
    return groups


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
