"""One writer per run folder: the lock file ``<output_dir>/radbo.lock``.

:func:`radbo.run` (and so ``radbo run``, ``--resume`` included) takes the lock of its output
folder before round 0 and releases it when the run ends, on an error too. A second run into a
folder whose lock is held is refused with a :class:`RunFolderBusyError`, one line naming the
holder's PID and host, instead of writing over the first run's results and checkpoints.

The lock is an advisory ``flock`` on the file, which the operating system releases when its
holder ends, however it ends (``kill -9`` included). A lock file left behind by a process that
died is therefore stale by construction and the next run takes it over; no PID number that a
later, unrelated process happens to reuse can keep a folder locked. The file holds the
holder's PID, host and start time (JSON) only to name it. On a file system without ``flock``
(some network mounts) the PID decides: a lock whose process is alive on this host is
respected, any other is taken over.

The file is neither a result nor a checkpoint: :func:`radbo.experiment.run_folder_contents`
does not count it, and a folder that holds only a lock holds no run.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> with run_folder_lock(folder) as lock:
...     lock.path.name
'radbo.lock'
>>> (Path(folder) / LOCK_FILE).exists()   # removed on release
False
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radbo.registry import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the PID decides alone
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "LOCK_FILE",
    "RunFolderBusyError",
    "RunFolderError",
    "RunFolderLock",
    "lock_holder",
    "lock_run_folder",
    "path_errors",
    "path_problem",
    "run_folder_lock",
]

#: The lock file's name in a run folder.
LOCK_FILE = "radbo.lock"

# how long a second run waits for a lock file just created to be filled in by its holder
_READ_TRIES = 20
_READ_PAUSE_S = 0.025


class RunFolderError(ConfigError):
    """A run folder (output folder) radbo cannot use: a path the system refuses (too long, a
    NUL character), a file where a folder must be or the reverse, a folder that cannot be
    written. The message is one user-facing line naming the path."""


class RunFolderBusyError(RunFolderError):
    """Another process is running into this run folder (it holds the lock)."""


def path_problem(err: BaseException) -> str:
    """The reason in ``err`` (an ``OSError`` or the ``ValueError`` a path with a NUL character
    raises) as a short phrase: ``File name too long``, ``No space left on device``."""
    if isinstance(err, OSError):
        return err.strerror or str(err) or type(err).__name__
    return str(err) or type(err).__name__


def _is_path_error(err: BaseException) -> bool:
    """Whether ``err`` is what the system or Python raises for a path or file it refuses: an
    ``OSError``, or a bare ``ValueError`` / ``UnicodeError`` (a NUL character, a name that
    cannot be encoded). radbo's own ``ValueError`` subclasses (config and checkpoint errors)
    are not: they already say what is wrong."""
    return isinstance(err, OSError | UnicodeError) or type(err) is ValueError


@dataclass
class RunFolderLock:
    """A held lock: the lock file, and the descriptor that holds it (see :func:`lock_run_folder`).

    Attributes:
        path: the lock file.
        fd: the open file descriptor holding the ``flock``; -1 once released.
        inode: the lock file's ``(st_dev, st_ino)``, to remove only this lock's own file.
    """

    path: Path
    fd: int
    inode: tuple[int, int]

    def release(self) -> None:
        """Remove the lock file and let go of the lock (once; a second call does nothing).

        The file is removed while the lock is still held, so that a run waiting on this very
        file finds it gone (a new file is a new lock) rather than taking a lock on a removed
        file."""
        if self.fd < 0:
            return
        try:
            with suppress(OSError):
                now = os.stat(self.path)
                if (now.st_dev, now.st_ino) == self.inode:
                    os.unlink(self.path)
        finally:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> RunFolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_text(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process (its PID is not recorded)"
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    since = holder.get("started")
    when = ""
    if isinstance(since, int | float):
        when = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
    return f"PID {pid} on {host}{when}"


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_fd(fd: int) -> dict[str, Any] | None:
    """The holder recorded in the open lock file ``fd``; ``None`` when it holds no record
    (yet: its holder writes it just after taking the lock, so a few short waits)."""
    for attempt in range(_READ_TRIES):
        holder = _parse(os.pread(fd, 4096, 0))
        if holder is not None:
            return holder
        if attempt + 1 < _READ_TRIES:
            time.sleep(_READ_PAUSE_S)
    return None


def lock_holder(folder: str | Path) -> dict[str, Any] | None:
    """What the lock file of ``folder`` records (``pid``, ``host``, ``started``), or ``None``
    when there is none or it cannot be read. Says nothing about whether the lock is held."""
    try:
        return _parse((Path(folder) / LOCK_FILE).read_bytes()[:4096])
    except (OSError, ValueError):
        return None


def _alive(holder: dict[str, Any] | None) -> bool:
    """Whether ``holder``'s process runs on this host (a holder on another host, or with no
    record, cannot be checked from here: it counts as alive only with a PID and a host)."""
    if not holder or not isinstance(holder.get("pid"), int) or isinstance(holder["pid"], bool):
        return False
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder["pid"]
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except OSError:
        return False
    return True


def _busy(folder: Path, holder: dict[str, Any] | None) -> RunFolderBusyError:
    return RunFolderBusyError(
        f"run folder error: {folder} is in use by another radbo run "
        f"({_holder_text(holder)}; lock file {folder / LOCK_FILE}): wait for it to end, or "
        "write elsewhere (--output-dir)"
    )


def lock_run_folder(folder: str | Path) -> RunFolderLock:
    """Take the lock of the run folder ``folder`` (which must exist) and record this process
    in it; :meth:`RunFolderLock.release` gives it back.

    Raises:
        RunFolderBusyError: another live process holds it (the message names its PID).
        RunFolderError: the lock file cannot be made (one line naming it and why).
    """
    folder = Path(folder)
    path = folder / LOCK_FILE
    record = json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    ).encode("utf-8")
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(10):  # a retry only when the file was replaced while this took the lock
        try:
            fd = os.open(path, flags | os.O_NONBLOCK, 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise RunFolderError(
                    f"run folder error: {path} is a symbolic link; remove it (it is radbo's "
                    "lock file)"
                ) from None
            raise RunFolderError(
                f"run folder error: cannot create the lock file {path}: {path_problem(err)}"
            ) from None
        try:
            held = _take(fd, path, folder, record)
        except BaseException:
            os.close(fd)
            raise
        if held is not None:
            return held
        os.close(fd)
    raise RunFolderError(f"run folder error: cannot take the lock {path}: it keeps changing")


def _take(fd: int, path: Path, folder: Path, record: bytes) -> RunFolderLock | None:
    """Lock the open lock file ``fd`` and write ``record`` to it; ``None`` when ``path`` no
    longer names that file (its holder removed it meanwhile: try again)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise RunFolderError(
            f"run folder error: {path} is not a regular file; remove it (it is radbo's lock file)"
        )
    locked = fcntl is not None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(folder, _read_fd(fd)) from None
        except OSError:  # no flock here (some network file systems): the PID decides
            locked = False
    if not locked:
        holder = _parse(os.pread(fd, 4096, 0))
        if _alive(holder) and holder is not None and holder.get("pid") != os.getpid():
            raise _busy(folder, holder)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return None
    if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
        return None
    try:
        os.ftruncate(fd, 0)  # a stale record of a process that died: replaced
        os.pwrite(fd, record, 0)
    except OSError as err:
        with suppress(OSError):
            os.unlink(path)
        raise RunFolderError(
            f"run folder error: cannot write the lock file {path}: {path_problem(err)}"
        ) from None
    return RunFolderLock(path, fd, (info.st_dev, info.st_ino))


@contextmanager
def run_folder_lock(folder: str | Path) -> Iterator[RunFolderLock]:
    """:func:`lock_run_folder` as a context manager: released at the end of the block, also
    when it raises."""
    lock = lock_run_folder(folder)
    try:
        yield lock
    finally:
        lock.release()


@contextmanager
def path_errors(path: str | Path, what: str) -> Iterator[None]:
    """Inside the block, what the system raises for ``path`` (an ``OSError``; the bare
    ``ValueError`` of a NUL character) becomes a :class:`RunFolderError`, one line:
    ``<what> '<path>': <reason>`` (``what``: ``"config error: output_dir ="``). radbo's own
    errors pass unchanged."""
    try:
        yield
    except (OSError, ValueError) as err:
        if not _is_path_error(err):
            raise
        raise RunFolderError(f"{what} {str(path)!r}: {path_problem(err)}") from None
