"""Server-side aggregation of client updates given in submodel coordinates.

The parameter-wise coverage-weighted mean is RABO's server rule (eqs. (6) and (8) of
``papers/rabo_rafbo.txt``): for every coordinate k of a tensor,

    mean_k = sum_{i in N_k} w_i * u_{i,k} / sum_{i in N_k} w_i,

where N_k is the set of clients whose mask holds k. Coordinates no client holds have no
mean; :func:`apply_step` leaves them unchanged (Alg. 1, lines 15-16 and 28-29).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from radbo.masks.index import add_at_many, holder_sums, integer_valued, kept_shape
from radbo.threads import torch_threads
from radbo.typing import IndexSet, Params

#: elements below which PyTorch runs an elementwise operation on one thread
#: (``at::internal::GRAIN_SIZE``): an aggregation of smaller tensors stays on one
_GRAIN_SIZE = 32768

#: intra-op threads :func:`coverage_weighted_mean` may use (:func:`aggregation_threads`)
_THREADS: ContextVar[int] = ContextVar("radbo_aggregation_threads", default=1)


@contextmanager
def aggregation_threads(threads: int) -> Iterator[None]:
    """Within the block, :func:`coverage_weighted_mean` runs on up to ``threads`` intra-op
    threads (never fewer than the process has: ``torch.get_num_threads()``) where a tensor it
    aggregates is big enough for PyTorch to split (32,768 elements or more).

    Its results do not depend on the thread count: its arithmetic is elementwise (every
    coordinate's sum is added in client order, one addition per client, whichever thread
    makes it; each ``index_add_`` meets every coordinate at most once) and its contractions
    (:func:`~radbo.masks.index.holder_sums`) sum integers, exactly, in any order. The engine
    opens it around the server's phase with the CPUs its backend owns and leaves idle while
    the server works (:attr:`radbo.simulation.ProcessBackend.server_threads`): the workers'
    cores, otherwise idle while the server aggregates.

    >>> import torch
    >>> u = [{"w": torch.ones(3)}, {"w": torch.full((3,), 2.0)}]
    >>> with aggregation_threads(2):
    ...     coverage_weighted_mean(u, [{}, {}], {"w": torch.Size([3])}).mean["w"].tolist()
    [1.5, 1.5, 1.5]
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"aggregation_threads needs an integer >= 1, got {threads!r}")
    token = _THREADS.set(threads)
    try:
        yield
    finally:
        _THREADS.reset(token)


@dataclass(frozen=True)
class CoverageMean:
    """Result of :func:`coverage_weighted_mean`, everything in full-model coordinates.

    Attributes:
        mean: per tensor, the weighted mean over the clients holding each coordinate (zero
            where nobody holds it).
        weight: per tensor, the summed weights ``sum_{i in N_k} w_i`` (zero where nobody holds it).
        count: per tensor, the number of clients holding each coordinate, ``C^k = |N_k|``
            (int64; clients of weight 0 hold nothing).
        scale: with per-client ``scales`` s_i, the weighted mean of s_i over the clients
            holding each coordinate (ShroFBO's per-coordinate rho), else ``None``.
    """

    mean: Params
    weight: Params
    count: Params
    scale: Params | None = None

    def covered(self, name: str) -> Tensor:
        """Boolean tensor: True where at least one client held the coordinate."""
        held = self.count[name] > 0
        return held.to(self.mean[name].device) if name in self.mean else held


def coverage_weighted_mean(
    updates: Sequence[Params],
    index_sets: Sequence[IndexSet],
    shapes: Mapping[str, torch.Size],
    weights: Sequence[float] | None = None,
    scales: Sequence[float] | None = None,
) -> CoverageMean:
    """Parameter-wise coverage-weighted mean of client updates (RABO eqs. (6), (8)).

    Args:
        updates: one dict per client, tensors in that client's submodel coordinates. Only the
            names in ``shapes`` are aggregated; every client must send all of them.
        index_sets: one per client; ``index_sets[i][name]`` maps update ``name`` of client i
            to full-model coordinates (see :data:`radbo.typing.IndexSet`).
        shapes: full-model shape of each aggregated tensor.
        weights: one non-negative weight per client (default: all 1, as in the paper).
        scales: optional per-client scalars whose weighted mean over the holders of each
            coordinate is returned as ``scale`` (used for ShroFBO's rho).

    Returns:
        :class:`CoverageMean` with mean, summed weights and client counts per coordinate.

    Example (two clients, one holding only the first coordinate):
        >>> import torch
        >>> u = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0])}]
        >>> idx = [{"w": (None,)}, {"w": (torch.tensor([0]),)}]
        >>> agg = coverage_weighted_mean(u, idx, {"w": torch.Size([2])})
        >>> agg.mean["w"].tolist(), agg.count["w"].tolist()
        ([2.0, 2.0], [2, 1])
    """
    if len(updates) != len(index_sets):
        raise ValueError(f"got {len(updates)} updates but {len(index_sets)} index sets")
    if weights is None:
        weights = [1.0] * len(updates)
    if len(weights) != len(updates):
        raise ValueError(f"got {len(updates)} updates but {len(weights)} weights")
    if any(w < 0 for w in weights):
        raise ValueError(f"aggregation weights must be non-negative, got {list(weights)}")
    if scales is not None and len(scales) != len(updates):
        raise ValueError(f"got {len(updates)} updates but {len(scales)} scales")
    # the same bits on any number of threads; below PyTorch's grain size no elementwise
    # operation is split, and more threads would only wake the BLAS's for small contractions
    big = any(math.prod(shape) >= _GRAIN_SIZE for shape in shapes.values())
    threads = _THREADS.get() if big else 1
    with torch_threads(threads if threads > torch.get_num_threads() else None):  # never fewer
        return _weighted_mean(updates, index_sets, shapes, weights, scales)


def _weighted_mean(
    updates: Sequence[Params],
    index_sets: Sequence[IndexSet],
    shapes: Mapping[str, torch.Size],
    weights: Sequence[float],
    scales: Sequence[float] | None,
) -> CoverageMean:
    """:func:`coverage_weighted_mean` after its checks."""
    # the clients holding each coordinate are counted from the index sets (holder_sums); so
    # are, in the same contraction, the summed weights when they are integers (the default 1,
    # sample counts: exact); fractional ones are summed client by client in client order
    exact = integer_valued(weights)
    holders = [1.0 if w > 0 else 0.0 for w in weights]  # a client of weight 0 holds nothing
    mean: Params = {}
    weight_sum: Params = {}
    scale: Params = {}
    count: Params = {}
    for name, shape in shapes.items():
        device = updates[0][name].device if updates and name in updates[0] else None
        num = torch.zeros(shape, dtype=torch.float64, device=device)
        entries = [index_set.get(name, (None,) * len(shape)) for index_set in index_sets]
        sums = holder_sums(entries, [holders, weights] if exact else [holders], shape)
        count[name] = sums[0].to(torch.int64)
        den = (
            sums[1].to(device) if exact else torch.zeros(shape, dtype=torch.float64, device=device)
        )
        sc = None if scales is None else torch.zeros(shape, dtype=torch.float64, device=device)
        client_scales = [0.0] * len(updates) if scales is None else scales
        values: list[Tensor] = []
        for update, index, w in zip(updates, entries, weights, strict=True):
            if name not in update:
                raise ValueError(f"client update is missing tensor {name!r}")
            sub = update[name]
            expected = kept_shape(index, shape)
            if tuple(sub.shape) != expected:
                raise ValueError(
                    f"client update {name!r} has shape {tuple(sub.shape)}, "
                    f"its index set selects {expected}"
                )
            # 1.0 * v is v: the product is left out, and add_at adds v in float64 as before
            values.append(sub.detach() if w == 1.0 else w * sub.detach().to(torch.float64))
        # in client order, coordinate by coordinate (add_at_many: one scatter on a GPU)
        add_at_many(num, entries, values)
        if not exact:
            add_at_many(den, entries, [float(w) for w in weights])
        if sc is not None:
            add_at_many(
                sc, entries, [float(w * s) for w, s in zip(weights, client_scales, strict=True)]
            )
        dtype = updates[0][name].dtype if updates else torch.float32
        held = den > 0
        safe = den.clamp_min(1e-300)
        mean[name] = torch.where(held, num / safe, 0.0).to(dtype)
        weight_sum[name] = den.to(dtype)
        if sc is not None:
            scale[name] = torch.where(held, sc / safe, 0.0).to(dtype)
    return CoverageMean(
        mean=mean, weight=weight_sum, count=count, scale=None if scales is None else scale
    )


def apply_step(params: Params, agg: CoverageMean, lr: float) -> Params:
    """``p_k <- p_k - lr * mean_k`` on covered coordinates; uncovered ones stay unchanged."""
    out: Params = {}
    for name, value in params.items():
        if name not in agg.mean:
            out[name] = value
            continue
        out[name] = torch.where(agg.covered(name), value - lr * agg.mean[name], value)
    return out


def apply_normalized_step(params: Params, agg: CoverageMean, lr: float) -> Params:
    """Coverage-weighted *and* normalized server step (SPEC "Aggregation"; no paper has it).

    For every coordinate s with holders N_s, ``p_s <- p_s - lr * rho_s * h_s`` where
    ``h_s = sum_{N_s} p_i h_{i,s} / sum_{N_s} p_i`` (``agg.mean`` of the normalized local
    aggregates h_i = q_i / ||a_i||_1) and ``rho_s = sum_{N_s} p_i ||a_i||_1 / sum_{N_s} p_i``
    (``agg.scale``, from ``scales = ||a_i||_1``). Coordinates nobody holds stay unchanged.
    With full masks this is ShroFBO's eq. (8) with the client weights normalized over the
    sample; with a_i = 1 and tau_i = T for all clients it is RABO's coverage average of the
    summed local gradients (``apply_step`` with the same lr).
    """
    if agg.scale is None:
        raise ValueError("apply_normalized_step needs a CoverageMean computed with scales")
    out: Params = {}
    for name, value in params.items():
        if name not in agg.mean:
            out[name] = value
            continue
        step = lr * agg.scale[name] * agg.mean[name]
        out[name] = torch.where(agg.covered(name), value - step, value)
    return out


def apply_mean(params: Params, agg: CoverageMean) -> Params:
    """Replace covered coordinates by the mean (used for BatchNorm running statistics)."""
    out: Params = {}
    for name, value in params.items():
        if name not in agg.mean or not value.is_floating_point():
            out[name] = value
            continue
        out[name] = torch.where(agg.covered(name), agg.mean[name], value)
    return out


def average_buffers(
    buffers: Params,
    updates: Sequence[Params],
    index_sets: Sequence[IndexSet],
    weights: Sequence[float],
) -> Params:
    """BatchNorm running statistics averaged coordinate-wise over the clients holding them
    (floating-point buffers only; counters such as ``num_batches_tracked`` stay)."""
    shapes = {n: t.shape for n, t in buffers.items() if t.is_floating_point()}
    if not shapes:
        return buffers
    return apply_mean(buffers, coverage_weighted_mean(updates, index_sets, shapes, weights))


def step_inner(
    y: Params,
    buffers: Params,
    updates: Sequence[Params],
    index_sets: Sequence[IndexSet],
    weights: Sequence[float],
    lr: float,
    *,
    with_buffers: bool,
) -> tuple[Params, Params]:
    """The server's inner step of RABO (eq. (6)) and FedMBO (Alg. 1 line 11): y moves by
    ``lr`` times the coverage-weighted mean of the clients' gradients, and with
    ``with_buffers`` the clients' BatchNorm statistics are averaged the same way."""
    shapes = {n: t.shape for n, t in y.items()}
    y = apply_step(y, coverage_weighted_mean(updates, index_sets, shapes, weights), lr)
    if with_buffers:
        buffers = average_buffers(buffers, updates, index_sets, weights)
    return y, buffers
