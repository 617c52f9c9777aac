"""Pure functions on index sets: extraction, scatter back, dense masks, counts.

An :data:`~radbo.typing.IndexSet` maps a tensor name to one entry per dimension: a sorted
``LongTensor`` of kept indices, or ``None`` when the whole dimension is kept. The kept
coordinates are the Cartesian product of the entries (structured masks), so a submodel tensor is
``full[k]`` restricted to that product and every function here is a sequence of
``index_select`` / ``index_copy`` calls — exact, no arithmetic on values.

>>> import torch
>>> full = {"w": torch.arange(12.0).reshape(3, 4)}
>>> idx = {"w": (torch.tensor([0, 2]), None)}
>>> extract(full, idx)["w"].tolist()
[[0.0, 1.0, 2.0, 3.0], [8.0, 9.0, 10.0, 11.0]]
>>> torch.equal(scatter(extract(full, idx), idx, full)["w"], full["w"])
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from radbo.typing import IndexSet, Params

__all__ = [
    "add_at_many",
    "alias",
    "coverage_counts",
    "dense_mask",
    "extract",
    "extract_many",
    "holder_sums",
    "index_set_numel",
    "restrict",
    "scatter",
]


#: bytes at whose multiples :func:`extract_many` starts each client's tensor
_ROW_ALIGN = 64


def _entry(index_set: IndexSet, key: str, ndim: int) -> tuple[Tensor | None, ...]:
    try:
        entry = index_set[key]
    except KeyError:
        raise ValueError(
            f"index set has no entry for tensor {key!r}; build it with "
            "StructurePlan.index_sets, which covers every tensor of the state dict"
        ) from None
    if len(entry) != ndim:
        raise ValueError(
            f"index set entry for {key!r} has {len(entry)} dimensions but the tensor has {ndim}"
        )
    return entry


def _select(tensor: Tensor, entry: tuple[Tensor | None, ...]) -> Tensor:
    out = tensor
    for dim, idx in enumerate(entry):
        if idx is not None:
            out = out.index_select(dim, idx.to(out.device))
    return out


def extract(full: Params, index_set: IndexSet) -> Params:
    """Restrict every tensor of ``full`` to its kept coordinates.

    Returns a new dict with the keys of ``full`` (``index_set`` may have more keys);
    ``sub[k]`` is ``full[k]`` restricted to the Cartesian product of ``index_set[k]``. The
    result never aliases ``full``: a tensor with no pruned dimension is cloned.
    """
    return {key: _extract(t, _entry(index_set, key, t.ndim)) for key, t in full.items()}


def _extract(tensor: Tensor, entry: tuple[Tensor | None, ...]) -> Tensor:
    """``tensor`` restricted to ``entry``, never aliasing it (cloned when nothing is pruned)."""
    sub = _select(tensor, entry)
    return tensor.clone() if sub is tensor else sub


def extract_many(full: Params, index_sets: Sequence[IndexSet]) -> list[Params]:
    """:func:`extract` for many clients at once: ``[extract(full, s) for s in index_sets]``,
    the same values, shapes, dtypes and contiguity, in a few operations per tensor and group
    of clients instead of one or two per tensor and client (on a GPU, launches).

    Clients whose entries for a tensor select equal shapes are gathered together by one
    advanced index, ``full[k][I_0, I_1, ...]``, with each pruned dimension's index lists
    stacked over the group and each kept one a broadcast ``arange``. Each client's tensor is
    its row of the gathered block: a contiguous view that starts at a multiple of 64 bytes of
    the block (rows are padded to that), so it sits in memory as a tensor of its own would (a
    fresh allocation is 64-byte aligned, and some BLAS kernels take another path, with other
    roundings, on data that is not). The views of one block share its storage and never
    overlap; nothing aliases ``full``. Written by hand because the index sets are radbo's own
    structured-mask format.

    >>> import torch
    >>> full = {"w": torch.arange(6.0).reshape(2, 3)}
    >>> sets = [{"w": (None, torch.tensor([0, 2]))}, {"w": (torch.tensor([1]), None)}]
    >>> [sub["w"].tolist() for sub in extract_many(full, sets)]
    [[[0.0, 2.0], [3.0, 5.0]], [[3.0, 4.0, 5.0]]]
    """
    out: list[Params] = [{} for _ in index_sets]
    for key, tensor in full.items():
        entries = [_entry(index_set, key, tensor.ndim) for index_set in index_sets]
        groups: dict[tuple[int | None, ...], list[int]] = {}
        for c, entry in enumerate(entries):
            shape = tuple(None if idx is None else int(idx.numel()) for idx in entry)
            groups.setdefault(shape, []).append(c)
        for members in groups.values():
            rows = _gathered(tensor, [entries[c] for c in members])
            for row, c in zip(rows, members, strict=True):
                out[c][key] = row
    return out


def _gathered(tensor: Tensor, entries: Sequence[tuple[Tensor | None, ...]]) -> list[Tensor]:
    """``_select(tensor, e)`` for each of ``entries`` (all selecting one shape), as rows of one
    gathered block whose rows start at multiples of 64 bytes (:func:`extract_many`)."""
    k, ndim = len(entries), tensor.ndim
    if tensor.requires_grad:  # as extract does, with its graph
        return [_extract(tensor, e) for e in entries]
    kept = tuple(
        n if idx is None else int(idx.numel())
        for idx, n in zip(entries[0], tensor.shape, strict=True)
    )
    numel = math.prod(kept)
    pruned = [d for d in range(ndim) if entries[0][d] is not None]
    if not pruned:  # every client keeps the whole tensor: copies of it
        block = tensor.reshape(1, numel).expand(k, numel)
    else:
        index: list[Tensor] = []
        for d in range(ndim):
            shape = [1] * (ndim + 1)
            if d in pruned:
                shape[0], shape[d + 1] = k, -1
                lists = torch.stack([e[d] for e in entries])  # type: ignore[misc]
                index.append(lists.to(device=tensor.device, dtype=torch.long).view(shape))
            else:
                shape[d + 1] = tensor.shape[d]
                index.append(torch.arange(tensor.shape[d], device=tensor.device).view(shape))
        block = tensor[tuple(index)].reshape(k, numel)
    per_row = max(1, _ROW_ALIGN // tensor.element_size())  # elements in 64 bytes
    padded = -(-numel // per_row) * per_row
    if pruned and padded == numel:
        rows = block  # new memory already, each row at a multiple of 64 bytes
    else:
        rows = torch.empty((k, padded), dtype=tensor.dtype, device=tensor.device)
        rows[:, :numel].copy_(block)
    return list(rows[:, :numel].view(k, *kept).unbind(0))


def _put(target: Tensor, values: Tensor, entry: tuple[Tensor | None, ...], start: int) -> Tensor:
    """``target`` with ``values`` written at the product ``entry[start:]`` (dims >= start)."""
    for dim in range(start, len(entry)):
        idx = entry[dim]
        if idx is not None:
            idx = idx.to(target.device)
            inner = _put(target.index_select(dim, idx), values, entry, dim + 1)
            return target.index_copy(dim, idx, inner)
    return values.to(dtype=target.dtype)


def scatter(sub: Params, index_set: IndexSet, base: Params) -> Params:
    """Write submodel tensors back into full coordinates.

    Returns a new dict with the keys of ``base``: copies of ``base`` whose kept positions (per
    ``index_set``) are overwritten by ``sub``. Keys of ``base`` absent from ``sub`` are copied
    unchanged; ``base`` is not mutated.
    """
    unknown = sorted(set(sub) - set(base))
    if unknown:
        raise ValueError(f"submodel tensors {unknown} have no counterpart in the base state")
    out: Params = {}
    for key, tensor in base.items():
        if key not in sub:
            out[key] = tensor.clone()
            continue
        entry = _entry(index_set, key, tensor.ndim)
        expected = tuple(
            tensor.shape[d] if idx is None else int(idx.numel()) for d, idx in enumerate(entry)
        )
        if tuple(sub[key].shape) != expected:
            raise ValueError(
                f"submodel tensor {key!r} has shape {tuple(sub[key].shape)} but the index set "
                f"keeps {expected}"
            )
        if all(idx is None for idx in entry):
            out[key] = sub[key].to(dtype=tensor.dtype, device=tensor.device, copy=True)
        else:
            out[key] = _put(tensor, sub[key].to(tensor.device), entry, 0)
    return out


def dense_mask(index_set: IndexSet, shapes: Mapping[str, torch.Size]) -> Params:
    """Boolean masks in full coordinates, ``True`` where kept, one per name in ``shapes``."""
    out: Params = {}
    for key, shape in shapes.items():
        entry = _entry(index_set, key, len(shape))
        mask = torch.ones((), dtype=torch.bool)
        for dim, idx in enumerate(entry):
            axis = torch.ones(shape[dim], dtype=torch.bool)
            if idx is not None:
                axis = torch.zeros(shape[dim], dtype=torch.bool)
                axis[idx.cpu()] = True
            mask = mask.unsqueeze(-1) & axis
        out[key] = mask.reshape(shape)
    return out


def kept_shape(index: tuple[Tensor | None, ...], shape: torch.Size) -> tuple[int, ...]:
    """Shape of the submodel tensor that ``index`` selects from a tensor of ``shape``."""
    if len(index) != len(shape):
        raise ValueError(f"index set has {len(index)} dimensions, tensor has {len(shape)}")
    return tuple(
        n if idx is None else int(idx.numel()) for idx, n in zip(index, shape, strict=True)
    )


def add_at(target: Tensor, index: tuple[Tensor | None, ...], value: Tensor | float) -> None:
    """``target[kept coordinates] += value`` for radbo's structured index sets (each dimension
    keeps everything, ``None``, or a sorted list of distinct indices).

    Written by hand because the index sets are radbo's own structured-mask format. A full index
    set is one in-place addition; otherwise the value is scattered one indexed dimension at a
    time with ``index_add_`` (innermost first, into zero blocks). Every coordinate receives one
    exact ``0 + v`` then one ``t + v``, so the result is bitwise what adding ``value`` to the
    selected Cartesian product gives, without that product's index grids."""
    kept = [
        (d, idx.to(device=target.device, dtype=torch.long))
        for d, idx in enumerate(index)
        if idx is not None
    ]
    if not kept:
        target += value
        return
    block = (
        value.to(target.device)
        if isinstance(value, Tensor)
        else torch.full(
            kept_shape(index, target.shape), value, dtype=target.dtype, device=target.device
        )
    )
    for d, idx in reversed(kept[1:]):
        shape = list(block.shape)
        shape[d] = target.shape[d]
        zeros = torch.zeros(shape, dtype=target.dtype, device=target.device)
        block = zeros.index_add_(d, idx, block.to(target.dtype))
    d, idx = kept[0]
    target.index_add_(d, idx, block.to(target.dtype))


# a scatter of many clients is cut into chunks of at most this many elements (64 MiB of
# float64 values and as much of int64 indices), so that a large model's does not hold every
# client's update twice
_SCATTER_CHUNK = 1 << 23


def add_at_many(
    target: Tensor,
    index_sets: Sequence[tuple[Tensor | None, ...]],
    values: Sequence[Tensor | float],
    flat: bool | None = None,
) -> None:
    """:func:`add_at` of ``values[i]`` at ``index_sets[i]`` for every i in order: bitwise what
    the calls one after the other give, since a coordinate receives its values in the same
    order.

    With ``flat`` (the default on a GPU, where each call's few kernels cost more than their
    arithmetic) the values are scattered in a few operations per chunk of clients: each
    distinct index entry (the same tensor objects: a mask policy's selection shared by one
    capacity) becomes linear coordinates once, and one ``index_put_(accumulate=True)`` adds
    the chunk's values, listed client after client. That accumulation adds the duplicates of
    a coordinate one after another in the order they are listed: serially on the CPU, and in
    a stable sort's order on CUDA (``benchmarks/scatter_order.py`` checks both, and a CUDA test
    holds the flat path to :func:`add_at` called client by client on the GPU). On the CPU
    the calls one by one are as fast or faster (same script) and stay the default. Written by
    hand, as :func:`add_at`, because the index sets are radbo's own structured format."""
    if len(index_sets) != len(values):
        raise ValueError(f"got {len(index_sets)} index entries but {len(values)} values")
    if flat is None:
        flat = target.device.type != "cpu"
    if not flat or not target.is_contiguous():
        for index, value in zip(index_sets, values, strict=True):
            add_at(target, index, value)
        return
    coordinates: dict[tuple[int | None, ...], Tensor] = {}
    chunk: list[tuple[Tensor, Tensor | float]] = []
    size = 0
    for index, value in zip(index_sets, values, strict=True):
        key = _identity(index)
        if key not in coordinates:
            coordinates[key] = _linear(index, target.shape).to(target.device)
        lin = coordinates[key]
        if isinstance(value, Tensor) and value.numel() != lin.numel():
            raise ValueError(f"a value of {value.numel()} elements for {lin.numel()} coordinates")
        if size and size + lin.numel() > _SCATTER_CHUNK:
            _scatter(target, chunk)
            chunk, size = [], 0
        chunk.append((lin, value))
        size += lin.numel()
    if chunk:
        _scatter(target, chunk)


def _identity(entry: tuple[Tensor | None, ...]) -> tuple[int | None, ...]:
    """A key equal for entries made of the same tensor objects (a mask policy's selection
    shared by every client of one capacity): no tensor is read."""
    return tuple(None if idx is None else id(idx) for idx in entry)


def _linear(index: tuple[Tensor | None, ...], shape: torch.Size) -> Tensor:
    """The row-major linear coordinates of the Cartesian product ``index`` keeps, in the order
    of the kept block's elements (int64, on the index's device, the CPU)."""
    if len(index) != len(shape):
        raise ValueError(f"index set has {len(index)} dimensions, tensor has {len(shape)}")
    lin = torch.zeros((), dtype=torch.long)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = index[d]
        axis = torch.arange(shape[d]) if idx is None else idx.to(device="cpu", dtype=torch.long)
        lin = lin + (axis * stride).reshape(-1, *[1] * (len(shape) - 1 - d))
        stride *= shape[d]
    return lin.reshape(-1)


def _scatter(target: Tensor, chunk: Sequence[tuple[Tensor, Tensor | float]]) -> None:
    """One ordered accumulation of a chunk's values into ``target`` (see add_at_many)."""
    index = torch.cat([lin for lin, _ in chunk])
    tensors = [v.reshape(-1) for _, v in chunk if isinstance(v, Tensor)]
    if len(tensors) == len(chunk):
        values = torch.cat(tensors)
    else:  # numbers (add_at_many is given tensors or numbers)
        scalars = [float(v) for _, v in chunk]
        lengths = torch.tensor([lin.numel() for lin, _ in chunk])
        values = torch.tensor(scalars, dtype=target.dtype).repeat_interleave(lengths)
    values = values.to(device=target.device, dtype=target.dtype)  # float32 -> 64: exact
    target.view(-1).index_put_((index,), values, accumulate=True)


def holder_sums(
    entries: Sequence[tuple[Tensor | None, ...]],
    coefficients: Sequence[Sequence[float]],
    shape: torch.Size,
) -> Tensor:
    """For every row ``r`` of ``coefficients`` (one value per client) and every coordinate of a
    tensor of ``shape``, the sum of ``r[i]`` over the clients i whose index entry
    ``entries[i]`` holds the coordinate: a float64 CPU tensor ``len(coefficients) x shape``
    (index sets live on the CPU).

    Written by hand because the index sets are radbo's own structured-mask format. A client
    holds the Cartesian product of its per-dimension entries, so its indicator is an outer
    product of per-dimension indicator rows, and the sums over clients are one contraction
    ``einsum("yz,za,zb->yab", C, A, B)`` over the dimensions some client prunes (the others are
    broadcast): a few operations per tensor for all rows, however many clients there are,
    where a scatter per client and row took four. **Exact only for integer coefficients**
    (client counts, integer weights) whose totals are below 2**53: every product is then 0 or
    an integer and every partial sum an integer that float64 represents, so the order of the
    additions, which a contraction leaves to the BLAS, cannot change a bit.

    >>> import torch
    >>> entries = [(None, None), (torch.tensor([0]), None), (torch.tensor([1]), torch.tensor([2]))]
    >>> holder_sums(entries, [[1.0, 2.0, 4.0]], torch.Size([2, 3]))[0].tolist()
    [[3.0, 3.0, 3.0], [1.0, 1.0, 5.0]]
    """
    f64 = torch.float64
    if any(len(row) != len(entries) for row in coefficients):
        lengths = sorted({len(row) for row in coefficients})
        raise ValueError(f"got {len(entries)} index entries but coefficient rows of {lengths}")
    # clients whose entries are the same tensor objects (a mask policy's selection shared by
    # every client of one capacity) hold the same coordinates: their coefficients are added
    # first, integers in Python floats (exact), so the contraction runs over distinct entries
    groups: dict[tuple[int | None, ...], list[int]] = {}
    for i, entry in enumerate(entries):
        groups.setdefault(_identity(entry), []).append(i)
    members = list(groups.values())
    entries = [entries[owners[0]] for owners in members]
    table = torch.tensor(
        [[math.fsum(float(row[i]) for i in owners) for owners in members] for row in coefficients],
        dtype=f64,
    )
    table = table.reshape(len(coefficients), len(entries))
    dims = [d for d in range(len(shape)) if any(e[d] is not None for e in entries)]
    if not dims:  # every client holds the whole tensor: integers, so the sums are exact
        totals = table.sum(dim=1).reshape(-1, *[1] * len(shape))
        return totals.expand(len(coefficients), *shape).contiguous()
    factors = []
    for d in dims:
        rows = torch.zeros(len(entries), shape[d], dtype=f64)
        whole = [i for i, e in enumerate(entries) if e[d] is None]
        if whole:
            rows[whole] = 1.0
        held = [(i, idx) for i, e in enumerate(entries) if (idx := e[d]) is not None]
        owners = torch.tensor([i for i, _ in held], dtype=torch.long)
        sizes = torch.tensor([int(idx.numel()) for _, idx in held], dtype=torch.long)
        at = torch.cat([idx for _, idx in held]).to(dtype=torch.long, device="cpu")
        rows.index_put_((owners.repeat_interleave(sizes), at), torch.ones((), dtype=f64))
        factors.append(rows)
    letters = "abcdefghijklmnopqrstuvwx"[: len(dims)]
    core = torch.einsum(f"yz,{','.join('z' + a for a in letters)}->y{letters}", table, *factors)
    view = [shape[d] if d in dims else 1 for d in range(len(shape))]
    return core.reshape(len(coefficients), *view).expand(len(coefficients), *shape).contiguous()


def integer_valued(values: Sequence[float]) -> bool:
    """Whether :func:`holder_sums` of ``values`` is exact: every value an integer and their
    total below 2**53."""
    return all(float(v).is_integer() for v in values) and sum(abs(v) for v in values) < 2**53


def coverage_counts(
    index_sets: Sequence[IndexSet],
    shapes: Mapping[str, torch.Size],
    weights: Sequence[float] | None = None,
) -> dict[str, Tensor]:
    """Per coordinate of every tensor in ``shapes``, how many clients hold it (``C^k``, RABO
    Definition 3), as int64 tensors. A client of weight 0 holds nothing: its update is never
    aggregated. A tensor an index set does not name is held whole.

    >>> import torch
    >>> idx = [{"w": (None,)}, {"w": (torch.tensor([0]),)}, {"w": (torch.tensor([1]),)}]
    >>> coverage_counts(idx, {"w": torch.Size([2])}, [1.0, 1.0, 0.0])["w"].tolist()
    [2, 1]
    """
    if weights is not None and len(weights) != len(index_sets):
        raise ValueError(f"got {len(index_sets)} index sets but {len(weights)} weights")
    holding = [
        index_set for i, index_set in enumerate(index_sets) if weights is None or weights[i] > 0
    ]
    out: dict[str, Tensor] = {}
    for key, shape in shapes.items():
        entries = [s.get(key, (None,) * len(shape)) for s in holding]
        out[key] = holder_sums(entries, [[1.0] * len(entries)], shape)[0].to(torch.int64)
    return out


def index_set_numel(index_set: IndexSet, shapes: Mapping[str, torch.Size]) -> dict[str, int]:
    """Number of kept elements of every tensor named in ``shapes``."""
    out: dict[str, int] = {}
    for key, shape in shapes.items():
        entry = _entry(index_set, key, len(shape))
        out[key] = math.prod(
            shape[d] if idx is None else int(idx.numel()) for d, idx in enumerate(entry)
        )
    return out


def restrict(index_set: IndexSet, names: Iterable[str]) -> IndexSet:
    """The sub-dict of ``index_set`` for ``names`` (e.g. only the inner variables y)."""
    names = list(names)
    missing = [n for n in names if n not in index_set]
    if missing:
        raise ValueError(f"index set has no entry for tensors {missing}")
    return {n: index_set[n] for n in names}


def alias(index_set: IndexSet, prefix: str, names: Iterable[str]) -> IndexSet:
    """Entries for auxiliary tensors shaped like model tensors (SimFBO's v, an estimator's
    y_lambda): ``f"{prefix}:{name}"`` gets ``index_set[name]``.

    >>> import torch
    >>> alias({"w": (torch.tensor([1]),)}, "v", ["w"])["v:w"][0].tolist()
    [1]
    """
    return {f"{prefix}:{name}": index_set[name] for name in names}
