"""torch's intra-op thread count, set for a block and restored after (:func:`torch_threads`).

A module of the lowest layer so that both the run (``[runtime] threads``,
:mod:`radbo.experiment.runner`) and the server's aggregation (:func:`radbo.aggregation.
aggregation_threads`) set threads through one helper.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["torch_threads"]


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``threads`` inside the block and restored after
    (``None``: unchanged). See :class:`radbo.config.RuntimeConfig` for why radbo runs with 1."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
