"""Freed memory kept for reuse: glibc's malloc asked not to give large blocks back to the
kernel (``[runtime] allocator = "retain"``, the default).

A round allocates and frees large tensors over and over: a stacked cohort's parameters,
activations, gradients and CG vectors are tens of MB each at 1,000 clients. glibc's malloc
serves a block above its mmap threshold (adaptive, from 128 KiB up to 32 MiB) with a mapping of
its own and unmaps it when it is freed, and it trims free memory off the top of its heap;
the next block of that size is a new mapping whose pages the kernel must fault in and zero
again. At 1,000 batched demo clients per round that was about 25,000 page faults and 56 ms of
system time per round (BENCHMARKS.md, "Freed memory kept for reuse"). :func:`retain_freed_memory`
fixes the mmap threshold at 1 GiB and turns trimming off (glibc's ``mallopt``), so such blocks
come from the heap and stay mapped for the next round: the process's resident memory stays at
its high-water mark instead of falling between rounds and rising again. The mmap threshold is
that high because a stacked cohort's tensors grow with its clients: 50 clients of
pfl-research's CIFAR-10 CNN stack 321 MB per copy of its 1.6 M-weight layer, which a 256 MiB
threshold mapped afresh at each use; batched 50-client rounds of that CNN took 0.82-0.88x
the sequential backend's speed with it and 0.91-1.03x with 1 GiB (BENCHMARKS.md, "The weight
gradient of a stacked linear layer").

Trimming is off rather than given a large threshold because glibc's threshold is a cliff,
not a cap: once the free memory at the top of the heap reaches it, a ``free`` gives *all* of
that memory back (``systrim`` keeps only ``M_TOP_PAD``, 128 KiB). A 1 GiB threshold, which
this module set before, let a batched 50-client RABO round of that CNN, whose tensors free
more than 1 GiB at once, give its heap back and fault 78,000-314,000 pages in again per
round (0.15-1.25 s of system time; ``benchmarks/host_settings.py --setting trim``, BENCHMARKS.md
"A trim threshold is a cliff").
``tests/test_allocator.py`` measures both in a process of its own.

The setting is the process's, and one way: glibc has no call that gives back its adaptive
thresholds, so :func:`radbo.run` applies it for the rest of the process (worker processes
forked later inherit it). Other C libraries (musl, macOS, Windows) are left as they are.

Written by hand because it is one documented C call (``mallopt(3)``) made through ctypes; the
environment variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set the same
thresholds, but only before the process starts.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Any

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "retain_freed_memory", "retained"]

#: blocks below this many bytes come from the heap (``M_MMAP_THRESHOLD``)
MMAP_THRESHOLD = 1 << 30
#: ``M_TRIM_THRESHOLD``: -1 turns trimming off (mallopt(3)); a threshold gives back the whole
#: free top of the heap once it reaches that size (module doc)
TRIM_THRESHOLD = -1

# mallopt's parameter numbers, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_state = {"retained": False}


@functools.cache
def _glibc() -> Any:
    """The process's C library when it is glibc (with ``mallopt``), else ``None``."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def retain_freed_memory() -> bool:
    """Set glibc's mmap threshold to :data:`MMAP_THRESHOLD` (32 MiB where an older glibc
    refuses more) and turn its trimming off (:data:`TRIM_THRESHOLD`) for the rest of the
    process; ``True`` once they are set (also on later calls), ``False`` where the C library
    is not glibc or refuses the values (then nothing was changed)."""
    if _state["retained"]:
        return True
    libc = _glibc()
    if libc is None:
        return False
    # the mmap threshold first: a glibc that refuses it (older ones cap it at 32 MiB, which
    # every glibc takes) has changed nothing, where a trim threshold set alone would fix the
    # mmap threshold at 128 KiB and map every large block afresh
    if not any(libc.mallopt(_M_MMAP_THRESHOLD, v) == 1 for v in (MMAP_THRESHOLD, 32 << 20)):
        return False
    _state["retained"] = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return _state["retained"]


def retained() -> bool:
    """Whether :func:`retain_freed_memory` has taken effect in this process."""
    return _state["retained"]
