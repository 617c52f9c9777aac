"""Shared type aliases used across radbo."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

#: Named parameter tensors, keyed like ``state_dict`` (e.g. ``"fc1.weight"``).
Params = dict[str, Tensor]

#: A scalar loss of (x, y) with the batch already bound: ``loss(x, y) -> Tensor``.
BilevelLoss = Callable[[Params, Params], Tensor]

#: Per-tensor kept index sets in full-model coordinates. For every tensor name, a
#: tuple with one entry per dimension: a sorted ``LongTensor`` of kept indices,
#: or ``None`` when the whole dimension is kept. The kept coordinates of a tensor
#: are the Cartesian product of its per-dimension entries (structured masks).
IndexSet = dict[str, tuple[Tensor | None, ...]]
