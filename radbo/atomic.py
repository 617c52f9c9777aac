"""Writing a file atomically: radbo's one way to create or replace a file it owns.

A reader of ``path`` sees the old file or the new one, never a half-written one, even when the
process is killed or the disk fills up mid-write: :func:`atomic_write` fills a temporary file
``.NAME.RANDOM.tmp`` in the same folder (the same file system, so the rename is atomic), flushes
it to disk (``fsync``), gives it the permissions a plain ``open()`` would (the umask's), and
renames it over ``path``. When anything fails -- the writer raises, the disk is full
(``ENOSPC``), the process is interrupted -- the temporary file is removed and the error is
raised as it came, with ``path`` untouched. Checkpoints (:mod:`radbo.checkpoint`), fleet files,
reports, exports and run results are all written through it.

Kept free of every other radbo module (lowest import layer) so that any module may use it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text"]


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """Create ``path`` atomically: ``write(tmp)`` fills a temporary file in the same folder,
    which is flushed to disk and then renamed over ``path`` (what ``write`` returns is
    ignored). The folder is made when missing; on any failure the temporary file is removed
    and the error re-raised.

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> atomic_write(folder / "a.txt", lambda tmp: tmp.write_text("hi"))
    >>> [p.name for p in folder.iterdir()], (folder / "a.txt").read_text()
    (['a.txt'], 'hi')
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        # mkstemp makes the file private (0600); give it the permissions a plain open() would
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (read by setting it and putting it back: there is no getter)."""
    current = os.umask(0)
    os.umask(current)
    return current


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (temporary file + rename)."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file + rename)."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))
