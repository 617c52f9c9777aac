"""Python's cyclic garbage collector paused for the length of a round.

A round of many clients makes and drops tens of thousands of Python objects (tasks, prepared
draws, results, ledger entries, index tensors). CPython's generational collector runs whenever
allocations outnumber deallocations by its threshold; every object of the round alive at that
moment is promoted to an older generation, and once enough have been promoted, a full
collection walks every object the process tracks (several hundred thousand once torch is
imported and a run is built), however little of it is garbage. At 1,000 RABO clients per
round that took about a tenth of a round (BENCHMARKS.md, "the garbage collector paused and
freed memory kept in a round"). radbo's rounds leave no garbage that only the collector can
free: what a round drops is freed by reference counting when it drops it. So
:meth:`radbo.simulation.Simulation.step`
runs with the collector paused (``Simulation.pause_gc``, default on) and lets it run again at
the end of the round, where its first young collection frees any cycle a client function did
make. Nothing a round computes depends on when the collector runs.

Written by hand because it is a few lines around :func:`gc.disable`; what matters is what it
leaves alone: a collector that was already paused (by the caller, or by an enclosing round)
stays paused, and one that was running runs again also when the round raises.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_collection"]


@contextmanager
def paused_collection(pause: bool = True) -> Iterator[None]:
    """The block with Python's cyclic garbage collector paused (``pause``), then running
    again if it ran before; a collector already paused is left as it is.

    >>> import gc
    >>> with paused_collection():
    ...     inside = gc.isenabled()
    >>> inside, gc.isenabled()
    (False, True)
    """
    if not pause or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
