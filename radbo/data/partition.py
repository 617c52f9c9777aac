"""Split a data set's sample indices over federated clients.

Every partition function takes the label vector of the whole data set and a
``torch.Generator`` and returns one sorted ``int64`` index tensor per client. The
parts are disjoint, together cover every index, no part is empty, and the result
is a deterministic function of the labels, the arguments and the generator's
state (the generator is advanced; nothing global is seeded). Impossible requests
(more clients than samples, ``alpha <= 0``, ``classes_per_client`` out of range,
...) raise :class:`ValueError` with a sentence naming the argument.

Schemes:

* :func:`partition_iid` -- uniform random split into near-equal parts.
* :func:`partition_shards` -- the "pathological non-iid" split of FedAvg
  (McMahan et al., 2017, Sec. 3) used by FedNest/FedMBO: sort by label, cut into
  shards, give each client ``classes_per_client`` shards.
* :func:`partition_dirichlet` -- per class, client proportions drawn from
  ``Dir(alpha)`` (Hsu et al., 2019, "Measuring the effects of non-identical data
  distribution for federated visual classification").
* :func:`partition_q_dominant` -- FedMSA's heterogeneity-level-``q`` split
  (Tarzanagh et al., FedMSA, Sec. 4 "Loss function tuning", ``papers/fedmsa.txt``).

The ``[partition]`` section (:class:`PartitionConfig` and its kinds) adds two things on top of
the functions: :meth:`PartitionConfig.max_clients`, the largest fleet a kind can give a number
of examples each, and ``allow_overlap``, which lets a larger fleet share examples
(:meth:`PartitionConfig.partition`). Its result is an :class:`IndexParts`: every part in one
flat tensor, so that a fleet of 100,000 clients is two tensors, not 100,000.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from numbers import Integral, Real
from typing import ClassVar, Literal, overload

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from radbo.registry import Registry, Section

__all__ = [
    "PARTITIONS",
    "DirichletPartition",
    "FleetTooLargeError",
    "IIDPartition",
    "ClassesPartition",
    "IndexParts",
    "PartitionConfig",
    "QDominantPartition",
    "ShardsPartition",
    "partition_classes",
    "partition_iid",
    "partition_shards",
    "partition_dirichlet",
    "partition_q_dominant",
    "split_indices",
    "split_parts",
    "label_histogram",
]


def _check_labels(labels: Tensor, where: str) -> Tensor:
    """Return ``labels`` as a 1-D CPU ``int64`` tensor, or raise a clear error."""
    if not isinstance(labels, Tensor):
        raise ValueError(f"{where}: labels must be a torch.Tensor, got {type(labels).__name__}.")
    if labels.ndim != 1 or labels.dtype.is_floating_point or labels.dtype.is_complex:
        raise ValueError(
            f"{where}: labels must be a 1-D integer tensor, got dtype {labels.dtype} and shape "
            f"{tuple(labels.shape)}."
        )
    return labels.detach().to(device="cpu", dtype=torch.int64)


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and np.isfinite(float(value))


def _check_num_clients(num_clients: int, num_samples: int, where: str) -> int:
    """Validate ``num_clients`` against the number of samples and return it as an ``int``."""
    if not _is_int(num_clients) or num_clients < 1:
        raise ValueError(f"{where}: num_clients must be a positive int, got {num_clients!r}.")
    if num_clients > num_samples:
        raise ValueError(
            f"{where}: cannot give {num_clients} clients at least one sample each from "
            f"{num_samples} samples; use at most {num_samples} clients."
        )
    return int(num_clients)


def _check_generator(generator: torch.Generator, where: str) -> None:
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            f"{where}: generator must be a torch.Generator (e.g. "
            f"torch.Generator().manual_seed(0)), got {type(generator).__name__}."
        )


def _sorted_parts(parts: list[Tensor]) -> list[Tensor]:
    return [torch.sort(p.to(torch.int64)).values for p in parts]


def _equal_sizes(total: int, num_parts: int) -> list[int]:
    """Sizes of ``num_parts`` near-equal parts of ``total``; the first ones get the extra."""
    base, extra = divmod(total, num_parts)
    return [base + (1 if i < extra else 0) for i in range(num_parts)]


def partition_iid(labels: Tensor, num_clients: int, generator: torch.Generator) -> list[Tensor]:
    """Uniform random split into ``num_clients`` parts whose sizes differ by at most one.

    The first ``N mod num_clients`` clients hold one extra sample.

    Example:
        >>> parts = partition_iid(torch.arange(10) % 2, 3, torch.Generator().manual_seed(0))
        >>> [len(p) for p in parts], sorted(torch.cat(parts).tolist()) == list(range(10))
        ([4, 3, 3], True)
    """
    where = "partition_iid"
    labels = _check_labels(labels, where)
    num_clients = _check_num_clients(num_clients, labels.numel(), where)
    _check_generator(generator, where)
    order = torch.randperm(labels.numel(), generator=generator)
    return _sorted_parts(list(torch.split(order, _equal_sizes(labels.numel(), num_clients))))


def partition_classes(labels: Tensor, num_clients: int, generator: torch.Generator) -> list[Tensor]:
    """Whole classes dealt to clients: the classes, in a random order, are cut into
    ``num_clients`` near-equal runs, and a client holds every example of its classes (the
    few-shot split of the RABO paper, Sec. V-A: "the characters ... are divided into 10 shards,
    with each shard assigned to a client").

    >>> parts = partition_classes(torch.arange(6).repeat_interleave(2), 3, torch.Generator())
    >>> sorted(len(p) for p in parts), sorted(len(set(torch.arange(6).repeat_interleave(2)[p]
    ...     .tolist())) for p in parts)
    ([4, 4, 4], [2, 2, 2])
    """
    where = "partition_classes"
    labels = _check_labels(labels, where)
    _check_generator(generator, where)
    classes = torch.unique(labels)
    if not _is_int(num_clients) or not 1 <= num_clients <= classes.numel():
        raise ValueError(
            f"{where}: num_clients must be an integer in [1, {classes.numel()}] (one class at "
            f"least per client), got {num_clients!r}."
        )
    order = classes[torch.randperm(classes.numel(), generator=generator)]
    sizes = _equal_sizes(classes.numel(), num_clients)
    parts, start = [], 0
    for size in sizes:
        mine = order[start : start + size]
        start += size
        parts.append(torch.nonzero(torch.isin(labels, mine)).flatten())
    return _sorted_parts(parts)


def partition_shards(
    labels: Tensor, num_clients: int, classes_per_client: int, generator: torch.Generator
) -> list[Tensor]:
    """FedAvg's shard split: each client receives ``classes_per_client`` label-sorted shards.

    Following McMahan et al. (2017, Sec. 3) as used by FedNest and FedMBO: the
    samples are sorted by label (class order and the order inside a class are
    drawn at random from ``generator``), cut into
    ``S = num_clients * classes_per_client`` contiguous shards of near-equal size,
    and client ``k`` gets shards ``pi(k), pi(k) + num_clients, pi(k) + 2 num_clients, ...``
    for a random permutation ``pi`` of the clients. Striding by ``num_clients``
    (instead of FedAvg's unconstrained random assignment) guarantees that a
    client's shards come from different classes: when every class holds the same
    number of samples and that number is a multiple of the shard size, every
    client sees exactly ``classes_per_client`` distinct labels.

    Raises:
        ValueError: ``classes_per_client`` is not in ``[1, number of classes]`` or
            there are fewer samples than shards.
    """
    where = "partition_shards"
    labels = _check_labels(labels, where)
    num_clients = _check_num_clients(num_clients, labels.numel(), where)
    _check_generator(generator, where)
    classes = torch.unique(labels)
    if not _is_int(classes_per_client) or not 1 <= classes_per_client <= classes.numel():
        raise ValueError(
            f"{where}: classes_per_client must be an int in [1, {classes.numel()}] (the number "
            f"of distinct labels), got {classes_per_client!r}."
        )
    num_shards = num_clients * int(classes_per_client)
    if num_shards > labels.numel():
        raise ValueError(
            f"{where}: {num_clients} clients x {classes_per_client} classes_per_client = "
            f"{num_shards} shards, more than the {labels.numel()} samples; lower either."
        )
    # Random class order and random order within a class, then a stable sort by class.
    class_rank = torch.empty(int(classes.max()) - int(classes.min()) + 1, dtype=torch.int64)
    class_rank[classes - classes.min()] = torch.randperm(classes.numel(), generator=generator)
    shuffled = torch.randperm(labels.numel(), generator=generator)
    ranks = class_rank[labels[shuffled] - classes.min()]
    order = shuffled[torch.argsort(ranks, stable=True)]
    shards = torch.split(order, _equal_sizes(labels.numel(), num_shards))
    client_of = torch.randperm(num_clients, generator=generator)
    parts: list[list[Tensor]] = [[] for _ in range(num_clients)]
    for s, shard in enumerate(shards):
        parts[int(client_of[s % num_clients])].append(shard)
    return _sorted_parts([torch.cat(p) for p in parts])


def _torch_seeded_numpy(generator: torch.Generator) -> np.random.Generator:
    """A numpy Generator whose seed is drawn from (and advances) ``generator``."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64))
    return np.random.default_rng(seed)


def partition_dirichlet(
    labels: Tensor,
    num_clients: int,
    alpha: float,
    generator: torch.Generator,
    *,
    min_size: int = 1,
) -> list[Tensor]:
    """Dirichlet label-skew split (Hsu et al., 2019), as in FedNest's non-iid experiments.

    For every class ``c`` independently, proportions ``p_c ~ Dir(alpha * 1)`` over
    the clients are drawn and the class's samples (in random order) are cut at
    ``floor(N_c * cumsum(p_c))``. Small ``alpha`` concentrates each class on few
    clients; large ``alpha`` approaches an iid split. The Dirichlet draws use a
    numpy ``Generator`` seeded from ``generator`` (numpy handles tiny ``alpha``
    stably), so the result is reproducible from the torch generator.

    Minimum size rule: a client left with fewer than ``min_size`` samples (default
    1: nobody is empty) receives samples moved one at a time from the currently
    largest client (lowest index on ties), the moved sample drawn uniformly from
    that client with ``generator``. This always terminates and changes the draw
    only where it would violate the minimum.

    Raises:
        ValueError: ``alpha`` is not a positive finite number, ``min_size < 1``, or
            ``num_clients * min_size`` exceeds the number of samples.
    """
    where = "partition_dirichlet"
    labels = _check_labels(labels, where)
    num_clients = _check_num_clients(num_clients, labels.numel(), where)
    _check_generator(generator, where)
    min_size = _check_dirichlet(where, alpha, min_size, num_clients, labels.numel())
    parts = _dirichlet_parts(labels, num_clients, alpha, generator)
    return _sorted_parts(_top_up(parts, min_size, generator))


def _check_dirichlet(where: str, alpha: float, min_size: int, num_clients: int, n: int) -> int:
    """``min_size`` as an int, after checking :func:`partition_dirichlet`'s ``alpha`` (a
    positive finite number) and ``min_size`` (an int >= 1, ``num_clients`` times it at most
    the ``n`` samples)."""
    if not (_is_real(alpha) and alpha > 0):
        raise ValueError(
            f"{where}: alpha must be a positive finite number (small = skewed, large = near "
            f"iid), got {alpha!r}."
        )
    if not _is_int(min_size) or min_size < 1:
        raise ValueError(
            f"{where}: min_size must be an int >= 1 (no client may be empty), got {min_size!r}."
        )
    min_size = int(min_size)
    if num_clients * min_size > n:
        raise ValueError(
            f"{where}: {num_clients} clients x min_size {min_size} = "
            f"{num_clients * min_size} samples needed, but there are only {n}."
        )
    return min_size


def _dirichlet_parts(
    labels: Tensor, num_clients: int, alpha: float, generator: torch.Generator
) -> list[Tensor]:
    """The Dirichlet draw of :func:`partition_dirichlet`, before the minimum size rule: each
    class's samples, in random order, cut at ``floor(N_c * cumsum(p_c))``; a client's part is
    its chunk of every class, in class order."""
    rng = _torch_seeded_numpy(generator)
    chunks: list[Tensor] = []
    owners: list[np.ndarray] = []
    for cls in torch.unique(labels).tolist():
        members = torch.nonzero(labels == cls).flatten()
        members = members[torch.randperm(members.numel(), generator=generator)]
        proportions = rng.dirichlet(np.full(num_clients, float(alpha)))
        cuts = np.floor(np.cumsum(proportions) * members.numel()).astype(np.int64)
        cuts = np.clip(cuts, 0, members.numel())
        cuts[-1] = members.numel()
        chunks.append(members)
        owners.append(np.repeat(np.arange(num_clients), np.diff(np.concatenate([[0], cuts]))))
    # a client's part: its chunk of every class, in class order (a stable sort by owner)
    owner = torch.from_numpy(np.concatenate(owners))
    flat = torch.cat(chunks)[torch.argsort(owner, stable=True)]
    return list(torch.split(flat, torch.bincount(owner, minlength=num_clients).tolist()))


def _top_up(parts: list[Tensor], min_size: int, generator: torch.Generator) -> list[Tensor]:
    """``parts`` after the minimum size rule of :func:`partition_dirichlet`: while a client
    has fewer than ``min_size`` samples, one sample drawn uniformly (with ``generator``) from
    the largest client (lowest index on ties) moves to the smallest (lowest index on ties)."""
    sizes_now = [p.numel() for p in parts]
    # the smallest and the largest client (lowest index on ties), from heaps of (size, client)
    # entries; an entry whose size is no longer the client's is skipped
    smallest = [(s, c) for c, s in enumerate(sizes_now)]
    largest = [(-s, c) for c, s in enumerate(sizes_now)]
    heapq.heapify(smallest)
    heapq.heapify(largest)
    while True:
        while smallest[0][0] != sizes_now[smallest[0][1]]:
            heapq.heappop(smallest)
        if smallest[0][0] >= min_size:
            break
        while -largest[0][0] != sizes_now[largest[0][1]]:
            heapq.heappop(largest)
        needy, donor = smallest[0][1], largest[0][1]
        pick = int(torch.randint(sizes_now[donor], (1,), generator=generator))
        moved = parts[donor][pick : pick + 1]
        parts[donor] = torch.cat([parts[donor][:pick], parts[donor][pick + 1 :]])
        parts[needy] = torch.cat([parts[needy], moved])
        sizes_now[donor] -= 1
        sizes_now[needy] += 1
        for c in (donor, needy):
            heapq.heappush(smallest, (sizes_now[c], c))
            heapq.heappush(largest, (-sizes_now[c], c))
    return parts


def partition_q_dominant(
    labels: Tensor, num_clients: int, q: float, generator: torch.Generator
) -> list[Tensor]:
    """FedMSA's split with heterogeneity level ``q`` (``papers/fedmsa.txt``, Sec. 4).

    FedMSA (following Murata & Suzuki, 2021) gives every client the same number of
    samples ``N / C``; client ``i`` first takes ``q x 100 %`` of its data from class
    ``i`` (all of class ``i`` if it is too small), then the gap is filled by sampling
    uniformly from the remaining samples of all classes; they then split each of
    the ``C`` clients into smaller clients. Here the same rule is applied directly
    to ``num_clients`` clients: client ``i``'s dominant class is the
    ``(i mod C)``-th smallest label; client sizes are near-equal (the first
    ``N mod num_clients`` get one extra); client ``i`` takes ``round(q * size_i)``
    random samples of its dominant class (a class shared by several clients and
    too small for all requests is shared as evenly as possible); the remaining
    samples, shuffled, fill every client up to its size.

    Because the fill is drawn from all classes (as in FedMSA), the dominant class's
    share is ``q + (1 - q) * share of that class among the leftovers``, about
    ``q + (1 - q) / C`` on balanced data: ``q = 0`` is an iid split and ``q = 1`` gives
    each client only its dominant class when classes are balanced and
    ``num_clients`` is a multiple of ``C``.

    Raises:
        ValueError: ``q`` is not in ``[0, 1]`` or there are more clients than samples.
    """
    where = "partition_q_dominant"
    labels = _check_labels(labels, where)
    num_clients = _check_num_clients(num_clients, labels.numel(), where)
    _check_generator(generator, where)
    if not (_is_real(q) and 0.0 <= q <= 1.0):
        raise ValueError(f"{where}: q must be a number in [0, 1], got {q!r}.")
    classes = torch.unique(labels).tolist()
    sizes = _equal_sizes(labels.numel(), num_clients)
    requests = [round(q * s) for s in sizes]
    taken: list[Tensor] = [torch.empty(0, dtype=torch.int64) for _ in range(num_clients)]
    leftovers: list[Tensor] = []
    for c, cls in enumerate(classes):
        members = torch.nonzero(labels == cls).flatten()
        members = members[torch.randperm(members.numel(), generator=generator)]
        clients = list(range(c, num_clients, len(classes)))
        wanted = [requests[i] for i in clients]
        if sum(wanted) > members.numel():
            shares = _equal_sizes(members.numel(), len(clients))
            wanted = [min(w, s) for w, s in zip(wanted, shares, strict=True)]
        start = 0
        for client, count in zip(clients, wanted, strict=True):
            taken[client] = members[start : start + count]
            start += count
        leftovers.append(members[start:])
    pool = torch.cat(leftovers)
    pool = pool[torch.randperm(pool.numel(), generator=generator)]
    gaps = [size - part.numel() for size, part in zip(sizes, taken, strict=True)]
    fills = torch.split(pool, gaps)
    return _sorted_parts([torch.cat([t, f]) for t, f in zip(taken, fills, strict=True)])


def _first_part_size(n: int, fraction: float) -> int:
    """``round(fraction * n)``, clamped to ``[1, n - 1]`` when ``n >= 2`` (both parts non-empty)."""
    first = round(fraction * n)
    return min(max(first, 1), n - 1) if n >= 2 else first


def split_indices(
    indices: Tensor, fraction: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Randomly split one client's indices into two disjoint sorted parts.

    The first part holds ``round(fraction * n)`` of the ``n`` indices, clamped to
    ``[1, n - 1]`` when ``n >= 2`` so that both parts are non-empty (e.g. inner/train
    and outer/validation data of a bilevel client). With ``n <= 1`` the lone index
    (if any) goes to the first part when ``fraction >= 0.5``.

    Example:
        >>> a, b = split_indices(torch.arange(10), 0.7, torch.Generator().manual_seed(0))
        >>> len(a), len(b), sorted(torch.cat([a, b]).tolist()) == list(range(10))
        (7, 3, True)

    Raises:
        ValueError: ``indices`` is not a 1-D integer tensor or ``fraction`` is not in
            ``(0, 1)``.
    """
    where = "split_indices"
    indices = _check_labels(indices, where)
    _check_generator(generator, where)
    if not (_is_real(fraction) and 0.0 < fraction < 1.0):
        raise ValueError(f"{where}: fraction must lie strictly between 0 and 1, got {fraction!r}.")
    n = indices.numel()
    first = _first_part_size(n, fraction)
    shuffled = indices[torch.randperm(n, generator=generator)]
    return torch.sort(shuffled[:first]).values, torch.sort(shuffled[first:]).values


def label_histogram(labels: Tensor, parts: list[Tensor], num_classes: int) -> Tensor:
    """Per-client label counts: an ``int64`` tensor of shape ``(len(parts), num_classes)``.

    Example:
        >>> label_histogram(torch.tensor([0, 1, 1, 2]), [torch.tensor([0, 1]),
        ...                 torch.tensor([2, 3])], 3).tolist()
        [[1, 1, 0], [0, 1, 1]]

    Raises:
        ValueError: a label lies outside ``[0, num_classes)``.
    """
    labels = _check_labels(labels, "label_histogram")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"label_histogram: labels must lie in [0, {num_classes}), found values in "
            f"[{int(labels.min())}, {int(labels.max())}]; pass the data set's num_classes."
        )
    rows = [
        torch.bincount(labels[p.to(device="cpu", dtype=torch.int64)], minlength=num_classes)
        for p in parts
    ]
    if not rows:
        return torch.zeros(0, num_classes, dtype=torch.int64)
    return torch.stack(rows)


# -- packed parts ------------------------------------------------------------------------------


class IndexParts(Sequence[Tensor]):
    """The index tensors of many parts (clients), packed in one flat ``int64`` tensor.

    Part ``i`` is ``values[offsets[i] : offsets[i + 1]]``. Indexing returns a copy, a small
    tensor of its own (pickling a part then sends only the part). A list of 100,000 small
    tensors costs about 55 MB of tensor and allocator overhead; packed, the same parts cost
    8 bytes per index plus 8 per part.

    >>> parts = IndexParts.pack([torch.tensor([3, 5]), torch.tensor([1])])
    >>> len(parts), parts[0].tolist(), parts[-1].tolist(), parts.sizes().tolist()
    (2, [3, 5], [1], [2, 1])
    """

    __slots__ = ("_bounds", "offsets", "values")

    def __init__(self, values: Tensor, offsets: Tensor) -> None:
        if values.ndim != 1 or values.dtype != torch.int64:
            raise ValueError(
                f"IndexParts: values must be a 1-D int64 tensor, got dtype {values.dtype} and "
                f"shape {tuple(values.shape)}."
            )
        if offsets.ndim != 1 or offsets.dtype != torch.int64 or offsets.numel() < 1:
            raise ValueError(
                "IndexParts: offsets must be a non-empty 1-D int64 tensor (one more entry than "
                f"parts), got dtype {offsets.dtype} and shape {tuple(offsets.shape)}."
            )
        if (
            int(offsets[0]) != 0
            or int(offsets[-1]) != values.numel()
            or bool((offsets.diff() < 0).any())
        ):
            raise ValueError(
                "IndexParts: offsets must rise from 0 to len(values) = "
                f"{values.numel()}, got {int(offsets[0])} .. {int(offsets[-1])}."
            )
        self.values = values
        self.offsets = offsets
        self._bounds: list[int] | None = None  # offsets.tolist(), made on the first read (_numbers)

    @classmethod
    def pack(cls, parts: Iterable[Tensor]) -> IndexParts:
        """Pack index tensors (any integer dtype, each flattened) in order."""
        chunks = [p.detach().to(device="cpu", dtype=torch.int64).flatten() for p in parts]
        offsets = torch.zeros(len(chunks) + 1, dtype=torch.int64)
        if chunks:
            sizes = torch.tensor([c.numel() for c in chunks], dtype=torch.int64)
            torch.cumsum(sizes, 0, out=offsets[1:])
        values = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)
        return cls(values, offsets)

    @classmethod
    def concat(cls, groups: Sequence[IndexParts]) -> IndexParts:
        """The parts of ``groups``, one group after the other."""
        if not groups:
            return cls.pack([])
        values = torch.cat([g.values for g in groups])
        starts = torch.tensor([0] + [g.values.numel() for g in groups[:-1]], dtype=torch.int64)
        bases = torch.cumsum(starts, 0)
        offsets = torch.cat(
            [torch.zeros(1, dtype=torch.int64)]
            + [g.offsets[1:] + b for g, b in zip(groups, bases.tolist(), strict=True)]
        )
        return cls(values, offsets)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @overload
    def __getitem__(self, index: int) -> Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> IndexParts: ...
    def __getitem__(self, index: int | slice) -> Tensor | IndexParts:
        """Part ``index`` (a copy), or the packed parts of a slice."""
        n = len(self)
        if isinstance(index, slice):
            return IndexParts.pack(self[i] for i in range(*index.indices(n)))
        if type(index) is not int and not _is_int(index):  # the ABC test only off the fast path
            raise TypeError(f"IndexParts: an index must be an int or a slice, not {index!r}")
        i = int(index) + n if index < 0 else int(index)
        if not 0 <= i < n:
            raise IndexError(f"part {index} out of range for {n} parts")
        bounds = self._numbers()
        return self.values[bounds[i] : bounds[i + 1]].clone()

    def _numbers(self) -> list[int]:
        """The offsets as numbers, read once (a round reads one part per client)."""
        if self._bounds is None:
            self._bounds = self.offsets.tolist()
        return self._bounds

    def __iter__(self) -> Iterator[Tensor]:
        bounds = self._numbers()
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
            yield self.values[start:stop].clone()

    def sizes(self) -> Tensor:
        """The number of indices of every part (``int64``)."""
        return self.offsets.diff()

    def __repr__(self) -> str:
        return f"IndexParts({len(self)} parts, {self.values.numel()} indices)"


_DRAW_CHUNK = 4096  # parts whose permutations are drawn before they are packed


def split_parts(
    parts: IndexParts, fraction: float, generator: torch.Generator
) -> tuple[IndexParts, IndexParts]:
    """:func:`split_indices` on every part, one part after the other from ``generator``: the
    same draws and, bit for bit, the same two parts per part, as packed :class:`IndexParts`.
    Only the permutations are drawn part by part; shuffling and sorting are done on all parts
    at once (a fleet of 100,000 clients splits in about a second).

    >>> parts = IndexParts.pack([torch.arange(10), torch.arange(10, 14)])
    >>> inner, outer = split_parts(parts, 0.7, torch.Generator().manual_seed(0))
    >>> a, b = split_indices(torch.arange(10), 0.7, torch.Generator().manual_seed(0))
    >>> torch.equal(inner[0], a), torch.equal(outer[0], b), inner.sizes().tolist()
    (True, True, [7, 3])
    """
    where = "split_parts"
    _check_generator(generator, where)
    if not (_is_real(fraction) and 0.0 < fraction < 1.0):
        raise ValueError(f"{where}: fraction must lie strictly between 0 and 1, got {fraction!r}.")
    sizes = parts.sizes().tolist()
    firsts = [_first_part_size(n, fraction) for n in sizes]
    drawn: list[Tensor] = []
    for start in range(0, len(sizes), _DRAW_CHUNK):
        chunk = [torch.randperm(n, generator=generator) for n in sizes[start : start + _DRAW_CHUNK]]
        drawn.append(torch.cat(chunk) if chunk else torch.empty(0, dtype=torch.int64))
    counts = parts.sizes()
    owner = torch.repeat_interleave(torch.arange(len(sizes)), counts)
    local = torch.cat(drawn) if drawn else torch.empty(0, dtype=torch.int64)
    shuffled = parts.values[parts.offsets[:-1][owner] + local]
    rank = torch.arange(shuffled.numel()) - parts.offsets[:-1][owner]
    first_size = torch.tensor(firsts, dtype=torch.int64)
    in_first = rank < first_size[owner]

    def packed(mask: Tensor, part_sizes: Tensor) -> IndexParts:
        values, owners = shuffled[mask], owner[mask]
        by_value = torch.argsort(values, stable=True)
        order = by_value[torch.argsort(owners[by_value], stable=True)]
        offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        torch.cumsum(part_sizes, 0, out=offsets[1:])
        return IndexParts(values[order], offsets)

    return packed(in_first, first_size), packed(~in_first, counts - first_size)


# -- the [partition] section -------------------------------------------------------------------

#: The registered ``[partition]`` kinds.
PARTITIONS: Registry[PartitionConfig] = Registry("partition", "kind")


class PartitionConfig(Section):
    """Base of every ``[partition]`` kind: how training examples are split over clients.

    A kind's own rule is :meth:`split` (disjoint parts covering every example); the largest
    fleet it can give at least ``min_size`` examples each is :meth:`max_clients` (a bilevel
    client needs 2: one inner, one outer). :meth:`partition` applies the rule to a fleet of any
    size:

    ``allow_overlap`` (default false): when the fleet is larger than ``max_clients``, clients
    share examples. The fleet is cut into ``R = ceil(num_clients / max_clients)`` groups of
    consecutive clients of near-equal size (the first ``num_clients mod R`` groups one client
    larger), and each group splits a whole copy of the data set by the kind's rule, one group
    after the other from the same generator. Within a group the parts are disjoint, cover
    every example and carry the kind's label skew (a Dirichlet group is a ``Dir(alpha)``
    split, in a q_dominant group the group's ``j``-th client is dominated by the
    ``(j mod C)``-th class); no client holds an example twice; every example is held by
    exactly ``R`` clients, one per group. When the data suffice (``R = 1``) the result is the
    partition without overlap, bit for bit. With ``allow_overlap = false`` a fleet larger than
    ``max_clients`` is an error naming that limit. The config dump leaves the field out at its
    default, so configs without it dump as before it existed.

    >>> labels = torch.arange(4)  # 4 examples, 2 per client: at most 2 clients
    >>> IIDPartition(allow_overlap=True).max_clients(labels, 2)
    2
    >>> parts = IIDPartition(allow_overlap=True).partition(labels, 6, torch.Generator(),
    ...                                                   min_size=2)
    >>> parts.sizes().tolist(), torch.bincount(parts.values).tolist()  # each example: 3 clients
    ([2, 2, 2, 2, 2, 2], [3, 3, 3, 3])
    """

    kind: str
    allow_overlap: bool = Field(
        False,
        description="let clients share examples when the data set is too small for the fleet",
    )

    dump_omits_defaults: ClassVar[tuple[str, ...]] = ("allow_overlap",)

    def split(self, labels: Tensor, num_clients: int, generator: torch.Generator) -> list[Tensor]:
        """One sorted index tensor per client, disjoint and covering every example (the kind's
        own rule; see the module docstring)."""
        raise NotImplementedError

    def max_clients(self, labels: Tensor, min_size: int = 1) -> int:
        """The largest number of clients :meth:`split` gives at least ``min_size`` examples
        each, whatever the generator draws (0: not even one client). This default holds for
        kinds whose parts differ in size by at most one: ``floor(N / min_size)``."""
        return _check_labels(labels, "max_clients").numel() // _check_min_size(min_size)

    def split_at_least(
        self, labels: Tensor, num_clients: int, generator: torch.Generator, min_size: int
    ) -> list[Tensor]:
        """:meth:`split` for ``num_clients <= max_clients(labels, min_size)``: every part holds
        at least ``min_size`` examples (kinds with a minimum-size rule of their own apply
        ``min_size`` there)."""
        return self.split(labels, num_clients, generator)

    def partition(
        self, labels: Tensor, num_clients: int, generator: torch.Generator, *, min_size: int = 1
    ) -> IndexParts:
        """One sorted index tensor per client, each of at least ``min_size`` examples: the
        kind's :meth:`split` when the data suffice, else groups sharing examples when
        ``allow_overlap`` is set (see the class docstring).

        Raises:
            ValueError: more than :meth:`max_clients` clients without ``allow_overlap`` (the
                message names the limit), fewer than ``min_size`` examples in all, or the
                kind's own errors.
        """
        where = f"partition {self.kind!r}"
        labels = _check_labels(labels, where)
        if not _is_int(num_clients) or num_clients < 1:
            raise ValueError(f"{where}: num_clients must be a positive int, got {num_clients!r}.")
        min_size = _check_min_size(min_size)
        limit = self.max_clients(labels, min_size)
        if num_clients <= limit:
            return IndexParts.pack(self.split_at_least(labels, num_clients, generator, min_size))
        if limit < 1:
            message = (
                f"{where}: the {labels.numel()} examples cannot give even one client "
                f"{min_size} examples."
            )
        else:
            message = (
                f"{where}: {labels.numel()} examples give at most {limit} clients {min_size} "
                f"examples each, not {num_clients}; use at most {limit} clients, or set "
                "allow_overlap = true to let clients share examples."
            )
        if not self.allow_overlap:
            raise FleetTooLargeError(message, limit=limit)
        if limit < 1:
            raise ValueError(message)
        groups = math.ceil(num_clients / limit)
        return IndexParts.concat(
            [
                IndexParts.pack(self.split_at_least(labels, size, generator, min_size))
                for size in _equal_sizes(num_clients, groups)
            ]
        )


class FleetTooLargeError(ValueError):
    """A fleet larger than a partition kind can serve without sharing examples; ``limit`` is
    :meth:`PartitionConfig.max_clients` for the data and minimum size asked for."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


def _check_min_size(min_size: int) -> int:
    if not _is_int(min_size) or min_size < 1:
        raise ValueError(f"min_size must be an int >= 1, got {min_size!r}.")
    return int(min_size)


@PARTITIONS.register
class IIDPartition(PartitionConfig):
    """Uniform random split into near-equal parts."""

    kind: Literal["iid"] = "iid"

    def split(self, labels: Tensor, num_clients: int, generator: torch.Generator) -> list[Tensor]:
        return partition_iid(labels, num_clients, generator)


@PARTITIONS.register
class ClassesPartition(PartitionConfig):
    """Whole classes per client, near-equal numbers of classes (few-shot: each client's
    episodes come from classes only it holds)."""

    kind: Literal["classes"]

    def split(self, labels: Tensor, num_clients: int, generator: torch.Generator) -> list[Tensor]:
        return partition_classes(labels, num_clients, generator)

    def max_clients(self, labels: Tensor, min_size: int = 1) -> int:
        """At most one client per class, and the ``C // n`` smallest classes (the fewest a
        client may get) must hold ``min_size`` examples together."""
        labels = _check_labels(labels, "max_clients")
        min_size = _check_min_size(min_size)
        counts = sorted(torch.unique(labels, return_counts=True)[1].tolist())
        for n in range(len(counts), 0, -1):
            if sum(counts[: len(counts) // n]) >= min_size:
                return n
        return 0


@PARTITIONS.register
class ShardsPartition(PartitionConfig):
    """FedAvg's shards: each client gets ``classes_per_client`` label-sorted shards."""

    kind: Literal["shards"] = "shards"
    classes_per_client: int = Field(2, ge=1, description="label-sorted shards each client gets")

    def split(self, labels: Tensor, num_clients: int, generator: torch.Generator) -> list[Tensor]:
        return partition_shards(labels, num_clients, self.classes_per_client, generator)

    def max_clients(self, labels: Tensor, min_size: int = 1) -> int:
        """At most one shard per example (``n * classes_per_client <= N``), and the client
        with the fewest of the one-longer shards must hold ``min_size`` examples."""
        labels = _check_labels(labels, "max_clients")
        min_size = _check_min_size(min_size)
        total, per = labels.numel(), self.classes_per_client
        classes = torch.unique(labels).numel()
        if per > classes:
            raise ValueError(
                f"partition_shards: classes_per_client must be an int in [1, {classes}] (the "
                f"number of distinct labels), got {per!r}."
            )
        for n in range(total // per, 0, -1):
            base, extra = divmod(total, n * per)
            # client slot t holds shards t, t + n, ...; the first `extra` shards are one longer
            if per * base + sum(1 for j in range(per) if n - 1 + j * n < extra) >= min_size:
                return n
        return 0


@PARTITIONS.register
class DirichletPartition(PartitionConfig):
    """Per class, client shares drawn from ``Dir(alpha)`` (every client keeps >= 2 examples)."""

    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(
        0.5,
        gt=0,
        allow_inf_nan=False,
        description="concentration of each class's Dir(alpha) shares",
    )

    def split(self, labels: Tensor, num_clients: int, generator: torch.Generator) -> list[Tensor]:
        return partition_dirichlet(labels, num_clients, self.alpha, generator, min_size=2)

    def max_clients(self, labels: Tensor, min_size: int = 1) -> int:
        """``floor(N / max(2, min_size))``: the split's minimum size rule keeps 2 or more."""
        return _check_labels(labels, "max_clients").numel() // max(2, _check_min_size(min_size))

    def split_at_least(
        self, labels: Tensor, num_clients: int, generator: torch.Generator, min_size: int
    ) -> list[Tensor]:
        return partition_dirichlet(
            labels, num_clients, self.alpha, generator, min_size=max(2, min_size)
        )


@PARTITIONS.register
class QDominantPartition(PartitionConfig):
    """FedMSA's heterogeneity level ``q`` (Tarzanagh, Li, Sharma and Oymak, "Federated
    Multi-Sequence Stochastic Approximation with Local Hypergradient Estimation", Sec. 4 "Loss
    function tuning", ``papers/fedmsa.txt``, after Murata & Suzuki 2021): equal-sized clients,
    client ``i`` takes ``q x 100 %`` of its examples from its dominant class (the
    ``(i mod C)``-th label) and the rest uniformly from what is left of all classes -- see
    :func:`partition_q_dominant`. ``q = 0`` is an iid split; FedMSA's experiments use ``q`` =
    0.1, 0.3 and 0.5 (there is no default).

    >>> labels = torch.tensor([1, 0, 1, 0])  # q = 1: client i holds all of class i
    >>> [p.tolist() for p in QDominantPartition(q=1.0).split(labels, 2, torch.Generator())]
    [[1, 3], [0, 2]]
    """

    kind: Literal["q_dominant"] = "q_dominant"
    q: float = Field(
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="share of each client's examples taken from its dominant class",
    )

    def split(self, labels: Tensor, num_clients: int, generator: torch.Generator) -> list[Tensor]:
        return partition_q_dominant(labels, num_clients, self.q, generator)
