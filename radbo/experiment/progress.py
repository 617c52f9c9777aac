"""Progress of a run on stderr: a redrawn bar on a terminal, a few plain lines elsewhere.

A progress bar redraws itself at every update. On a terminal that is one line; written to a
log file, a pipe or a CI log, every redraw is kept, and a run fills its log with hundreds of
lines. :func:`progress_bar` therefore shows tqdm's bar only where it can redraw (a terminal,
or a notebook, where ``tqdm.auto`` shows a widget) and otherwise a :class:`LineProgress`: one
plain line at each tenth of the run, at most ``lines + 1`` lines however long it is.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TextIO

__all__ = ["LineProgress", "Progress", "progress_bar"]


class Progress(Protocol):
    """What the round loop calls: tqdm's bar, or :class:`LineProgress`."""

    def update(self, n: float | None = 1) -> bool | None: ...

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None) -> None: ...

    def close(self) -> None: ...


class LineProgress:
    """Progress as plain lines, for a stream that is not a terminal: a line when the run
    passes each ``1 / lines`` of ``total`` and at its end (at most ``lines + 1`` lines), e.g.
    ``radbo: round 6/60 (10%), outer 0.412, acc 0.853, 3.2 s``. The line of a round is written
    by :meth:`set_postfix` (called after :meth:`update` with that round's metrics) or, when
    none follows, by :meth:`close`.

    >>> import io
    >>> out = io.StringIO()
    >>> bar = LineProgress(total=100, desc="radbo", file=out, clock=lambda: 0.0)
    >>> for _ in range(100):
    ...     _ = bar.update(1)
    ...     bar.set_postfix({"acc": "0.900"})
    >>> bar.close()
    >>> lines = out.getvalue().splitlines()
    >>> len(lines)
    10
    >>> lines[0]
    'radbo: round 10/100 (10%), acc 0.900, 0.0 s'
    >>> lines[-1]
    'radbo: round 100/100 (100%), acc 0.900, 0.0 s'
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        desc: str = "",
        file: TextIO | None = None,
        lines: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.n = initial
        self.desc = desc
        self.file = file
        self._every = max(1, math.ceil(total / max(1, lines)))
        self._next = (initial // self._every + 1) * self._every
        self._clock = clock
        self._start = clock()
        self._due = False
        self._postfix: dict[str, Any] = {}

    def update(self, n: float | None = 1) -> bool | None:
        self.n += int(n or 0)
        if self.n >= min(self._next, self.total) and not self._due:
            self._due = True
            while self._next <= self.n:
                self._next += self._every
        return None

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None) -> None:
        self._postfix = dict(ordered_dict or {})
        if self._due:
            self._write()

    def close(self) -> None:
        if self._due:
            self._write()

    def _write(self) -> None:
        self._due = False
        parts = [f"round {self.n}/{self.total} ({100 * self.n / max(1, self.total):.0f}%)"]
        parts += [f"{key} {value}" for key, value in self._postfix.items()]
        parts.append(f"{self._clock() - self._start:.1f} s")
        prefix = f"{self.desc}: " if self.desc else ""
        print(prefix + ", ".join(parts), file=self.file or sys.stderr, flush=True)


def progress_bar(total: int, *, initial: int = 0, desc: str = "", enabled: bool = True) -> Progress:
    """A progress display on stderr for ``total`` rounds, ``initial`` of them done: tqdm's bar
    (``tqdm.auto``) on a terminal or in a notebook, :class:`LineProgress` on any other stream
    (a file, a pipe); nothing shown when not ``enabled``."""
    from tqdm.auto import tqdm

    stream = sys.stderr
    # in a notebook tqdm.auto's bar is a widget (tqdm.notebook), which redraws in place
    notebook = any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__)
    redraws = notebook or _isatty(stream)
    if not enabled or redraws:
        return tqdm(total=total, initial=initial, desc=desc, unit="round", disable=not enabled)
    return LineProgress(total, initial=initial, desc=desc, file=stream)


def _isatty(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # a replaced stream without isatty, or a closed one
        return False
