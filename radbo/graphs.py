"""CUDA graphs of a stacked cohort's phase: captured once per shape, replayed every round.

On a GPU, a round of the small models radbo simulates is bound by the host: the device
computes for a few milliseconds of a 0.2 s round, and the rest is Python launching thousands
of microsecond kernels one after another (BENCHMARKS.md, "GPU"). A CUDA graph records a
phase's launches once and replays them in one call: on an H200 RABO's whole inner phase of
10 local steps on a cohort of 37 demo clients took 23.1 ms eager and 0.98 ms replayed, with
bitwise equal results (``benchmarks/compile_step.py --device cuda --graphs``).

:class:`PhaseGraphs` runs a phase written as a *pure function of tensors*: ``fn(inputs)``
reads nothing that changes between calls except ``inputs`` (nested dicts, tuples and lists of
tensors, every tensor with the cohort's clients on its first dimension) and returns such a
tree. The first call for a key and a set of input shapes captures ``fn`` on private copies of
the inputs (after warm-up calls on a side stream, as ``torch.cuda.graph``'s documentation
prescribes); every call copies its inputs into those copies, replays the graph and returns
clones of the outputs. Whatever else ``fn`` reads (Python numbers such as a learning rate, a
module skeleton, the training set on the device) is baked into the graph: the caller puts
all of it into the key.

Cohort sizes change from round to round with participation, and each new shape costs a
capture (a few eager calls). :class:`PhaseGraphs` therefore pads the client dimension up to a
multiple of ``granule`` (or of an eighth of the cohort, rounded down to a power of two, where
that is larger: less than 1/8 more clients), repeating the first client (real data: nothing
non-finite enters the padded rows), and cuts the outputs back. A phase whose clients do not
interact (radbo's: the stacked losses are summed, so each client's gradient is its own) gives
every real client what it gives unpadded, up to the rounding of kernels of another batch size.

A phase whose capture fails (an operation that synchronises with the host, say) warns once
and runs eagerly from then on, for that key and shape. A check that must read a value to raise
an error (a finite-difference step lost in rounding) calls :func:`check` instead: inside a
phase the cache runs it is deferred to after the replay, whose values it then reads (one
host read per replay, outside the graph); anywhere else it is made at once.

Written here rather than taken from ``torch.cuda.make_graphed_callables``, which graphs a
callable's forward and backward for use inside autograd, on one set of sample shapes: a phase
runs autograd itself (double backward included) and meets a new shape whenever its cohort
changes. The trees are walked by hand, not with ``torch.utils._pytree``, a private module.

``capture=False`` runs the same padding and copying eagerly, without a graph: the path the
CPU tests check (a CPU has no graphs). Like a replay, which runs the kernels the first call
launched, it runs the *first* call's function for every later call of the same key and
shape, so that a phase whose function bakes in something of its round that the key does not
name gives wrong results on the CPU too.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["PhaseGraphs", "check"]

#: a tree of tensors: nested dicts, tuples and lists whose leaves are tensors (or other values,
#: passed through unchanged)
Tree = Any


#: a deferred check: a one-element bool tensor, and what to call when it holds True
Check = tuple[Tensor, Callable[[], object]]

# the checks deferred by the phase each thread is running through PhaseGraphs (innermost last)
_pending = threading.local()


def check(failed: Tensor, fail: Callable[[], object]) -> None:
    """Call ``fail()`` (which raises) when the one-element bool tensor ``failed`` holds True:
    at once, or, inside a phase :class:`PhaseGraphs` runs, after the phase (after each replay
    of its capture, ``failed`` and whatever ``fail`` reads holding that replay's values), so
    that no value is read on the host inside a capture."""
    stack = _stack()
    if stack:
        stack[-1].append((failed, fail))
    elif bool(failed):
        fail()


def _stack() -> list[list[Check]]:
    """This thread's deferred checks, one list per phase being run (innermost last)."""
    return _pending.__dict__.setdefault("stack", [])


@contextmanager
def _deferring() -> Iterator[list[Check]]:
    """The checks :func:`check` defers inside the block."""
    stack = _stack()
    stack.append([])
    try:
        yield stack[-1]
    finally:
        stack.pop()


def _run_checks(checks: list[Check]) -> None:
    for failed, fail in checks:
        if bool(failed):
            fail()


def _leaves(tree: Tree) -> Iterator[Tensor]:
    """The tensors of ``tree`` in a fixed order (dicts in their key order)."""
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, tuple | list):
        for value in tree:
            yield from _leaves(value)


def _rebuild(tree: Tree, leaves: Iterator[Tensor]) -> Tree:
    """``tree`` with its tensors replaced, in :func:`_leaves` order, by ``leaves``."""
    if isinstance(tree, Tensor):
        return next(leaves)
    if isinstance(tree, dict):
        return {k: _rebuild(v, leaves) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_rebuild(v, leaves) for v in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(_rebuild(v, leaves) for v in tree)
    return tree


def _structure(tree: Tree) -> Hashable:
    """What two trees must share to use one capture: the nesting, keys and, per tensor, its
    shape, dtype and device."""
    if isinstance(tree, Tensor):
        return (tuple(tree.shape), tree.dtype, str(tree.device))
    if isinstance(tree, dict):
        return ("dict", tuple((k, _structure(v)) for k, v in tree.items()))
    if isinstance(tree, tuple | list):
        return (type(tree).__name__, tuple(_structure(v) for v in tree))
    return ("value", type(tree).__name__)


def _pad_clients(t: Tensor, padded: int) -> Tensor:
    """``t`` with its first (client) dimension padded to ``padded`` by repeating client 0."""
    extra = padded - t.shape[0]
    if extra == 0:
        return t
    return torch.cat([t, t[:1].expand(extra, *t.shape[1:])])


@dataclass
class _Capture:
    graph: Any  # torch.cuda.CUDAGraph, or None with capture=False
    inputs: list[Tensor]  # the tensors the graph reads: each call copies its inputs in
    outputs: Tree  # the tensors the graph writes (overwritten by the next replay)
    #: with capture=False, the function of the first call, which every later call runs again
    #: (as a replay runs the first call's kernels, whatever the caller's function is now)
    fn: Callable[[Tree], Tree] | None = None
    #: the checks the captured call deferred (:func:`check`), made after every replay
    checks: list[Check] = field(default_factory=list)


@dataclass
class PhaseGraphs:
    """Captured phases of stacked cohorts by key and input shapes (see the module docstring).

    Args:
        granule: the client dimension is padded up to a multiple of this (``>= 1``).
        warmup: eager calls on a side stream before a capture (``>= 1``; cuBLAS and autograd
            set up their workspaces there, not inside the graph).
        capture: ``False`` runs ``fn`` eagerly on the padded copies (no GPU needed).
        max_captures: captures kept; beyond, the least recently used is dropped (and its
            memory freed).
    """

    granule: int = 8
    warmup: int = 2
    capture: bool = True
    max_captures: int = 64
    _captures: dict[Hashable, _Capture] = field(default_factory=dict, repr=False)
    _failed: set[Hashable] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if min(self.granule, self.warmup, self.max_captures) < 1:
            raise ValueError(
                "PhaseGraphs needs granule, warmup and max_captures >= 1, got "
                f"{self.granule}, {self.warmup}, {self.max_captures}"
            )

    def __len__(self) -> int:
        """The number of phases captured so far."""
        return len(self._captures)

    def padded_size(self, clients: int) -> int:
        """``clients`` rounded up to a multiple of :attr:`granule`, or of the largest power of
        two at most an eighth of ``clients`` where that is larger: less than 1/8 padding, and
        a handful of shapes for cohorts of hundreds of clients."""
        step = max(self.granule, 1 << max(0, clients.bit_length() - 4))
        return -(-clients // step) * step

    def run(self, key: Hashable, fn: Callable[[Tree], Tree], inputs: Tree, clients: int) -> Tree:
        """``fn(inputs)`` for a cohort of ``clients`` clients, replayed from a capture: the
        outputs' first dimension is cut back to ``clients`` and cloned (the next replay
        overwrites the capture's own). ``key`` must name everything ``fn`` reads besides
        ``inputs``."""
        padded = self.padded_size(clients)
        leaves = [_pad_clients(t, padded) for t in _leaves(inputs)]
        full = _rebuild(inputs, iter(leaves))
        cache_key = (key, _structure(full))
        if cache_key in self._failed:
            return fn(inputs)
        entry = self._captures.pop(cache_key, None)  # put back last: least recently used first
        if entry is None:
            try:
                entry = self._record(fn, full)
            except Exception as error:  # a phase the graph cannot hold: eager from now on
                self._failed.add(cache_key)
                lines = str(error).strip().splitlines()
                warnings.warn(
                    f"radbo: capturing phase {key!r} as a CUDA graph failed "
                    f"({type(error).__name__}: {lines[0] if lines else ''}); it runs eagerly",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return fn(inputs)
            if len(self._captures) >= self.max_captures:
                del self._captures[next(iter(self._captures))]
        self._captures[cache_key] = entry
        for static, value in zip(entry.inputs, leaves, strict=True):
            static.copy_(value)
        if entry.graph is None:
            assert entry.fn is not None
            with _deferring() as checks:
                outputs = entry.fn(_rebuild(full, iter(entry.inputs)))
        else:
            with torch.cuda.device(entry.inputs[0].device):
                entry.graph.replay()
            outputs, checks = entry.outputs, entry.checks
        _run_checks(checks)
        cut = [t[:clients].clone() for t in _leaves(outputs)]
        return _rebuild(outputs, iter(cut))

    def _record(self, fn: Callable[[Tree], Tree], inputs: Tree) -> _Capture:
        """A capture of ``fn`` on private copies of ``inputs`` (their values are copied in by
        each call)."""
        static = [t.detach().clone() for t in _leaves(inputs)]
        if not self.capture:
            return _Capture(None, static, None, fn)
        tree = _rebuild(inputs, iter(static))
        with torch.cuda.device(static[0].device):  # cuda:N, where N need not be current
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # the warm-ups' checks are dropped: the capture computes the same values, and its
            # checks are made after its first replay
            with torch.cuda.stream(side), _deferring():
                for _ in range(self.warmup):
                    fn(tree)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), _deferring() as checks:
                outputs = fn(tree)
        return _Capture(graph, static, outputs, checks=checks)
