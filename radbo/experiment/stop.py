"""Graceful stop of a run: SIGINT (Ctrl-C) or SIGTERM finish the current round, then the run
writes a checkpoint and its results so far and ends with :class:`RunStopped`.

``radbo run`` installs the handlers (:func:`stop_on_signals`) around its runs and restores
the previous ones after; a Python program may do the same around :func:`radbo.run`. The
handler only sets a flag (:func:`stop_requested`), which the round loop reads between rounds:
a round is never cut in two, so the checkpoint written is one an uninterrupted run also
passes through, and ``radbo run ... --resume`` continues it to the same numbers. A second
signal while the run is stopping raises :class:`RunAborted` at once (the previous checkpoint,
if any, stays intact: checkpoints are written atomically).

>>> import os, signal
>>> with stop_on_signals():
...     os.kill(os.getpid(), signal.SIGTERM)
...     stop_requested() == signal.SIGTERM
True
>>> stop_requested() is None   # cleared when the block ends
True
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "RunAborted",
    "RunStopped",
    "exit_code",
    "signal_name",
    "stop_on_signals",
    "stop_requested",
]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested: list[int] = []  # the signal that asked for a stop, once one did
_owner: list[int] = []  # the process that installed the handlers


class RunStopped(Exception):  # noqa: N818 - a request honoured, not an error
    """A run stopped early on request (SIGINT / SIGTERM), after a whole round, with its
    checkpoint and results so far written.

    Attributes:
        signum: the signal that asked for the stop.
        output_dir: the run folder (checkpoint in ``checkpoints/run`` or
            ``checkpoints/baseline``, results so far in ``results.json`` when saved), or
            ``None`` when the run writes nothing.
        result: the :class:`radbo.experiment.RunResult` so far; its ``stopped`` says when
            (``"SIGTERM after round 3 of 60"``, ``"... of the baseline"``).
    """

    def __init__(self, signum: int, output_dir: Path | None, result: Any) -> None:
        self.signum = signum
        self.output_dir = output_dir
        self.result = result
        super().__init__(f"stopped by {result.stopped}")


class RunAborted(KeyboardInterrupt):
    """A second SIGINT / SIGTERM while a run was stopping: it ended at once, mid-round."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped at once by a second {signal_name(signum)}")


def signal_name(signum: int) -> str:
    """``SIGINT``, ``SIGTERM``, ... (``signal 42`` for one Python has no name for)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(signum: int) -> int:
    """The exit code of a command that a signal stopped: 128 + the signal (130, 143)."""
    return 128 + signum


def stop_requested() -> int | None:
    """The signal that asked the running run to stop, or ``None``."""
    return _requested[0] if _requested else None


def _handler(signum: int, frame: FrameType | None) -> None:
    if _owner and os.getpid() != _owner[-1]:
        # a process forked from the run (a ProcessBackend worker): the signal does what it
        # did before, so that a worker told to terminate ends
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _requested:
        raise RunAborted(signum)
    _requested.append(signum)


@contextmanager
def stop_on_signals(signals: Sequence[int] = _STOP_SIGNALS) -> Iterator[None]:
    """Inside the block, ``signals`` (SIGINT and SIGTERM) ask the run to stop after its
    current round (:func:`stop_requested`) and a second one raises :class:`RunAborted`; the
    previous handlers are restored and the request cleared at the end. Outside the main
    thread (where Python cannot install handlers) the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signals}
    _requested.clear()
    _owner.append(os.getpid())
    try:
        for s in signals:
            signal.signal(s, _handler)
        yield
    finally:
        for s, handler in previous.items():
            # None: a handler installed outside Python; the default is the nearest to it
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        _requested.clear()
        _owner.pop()
