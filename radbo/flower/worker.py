"""A long-lived worker process per key, reached over a local Unix-domain socket.

Flower 1.41 starts one ``flwr-clientapp`` process per message, so anything a ClientApp imports
or builds is paid again for every message. :func:`call` hands a request (bytes) to a worker
process that imported its handler once and keeps whatever state the handler keeps across
requests; the first call for a key starts the worker. This module is transport only: it
knows nothing of Flower or radbo's messages and imports only the standard library, so a
forwarding ClientApp that uses it loads without torch.

Worker. ``python -m radbo.flower.worker --key K --handler module:function --parent-pid P``
imports ``function(request: bytes) -> bytes`` once and serves requests one at a time. An
exception in the handler goes back to the caller as an error frame (:func:`call` raises
:class:`WorkerError` with the exception's type and message) and the worker keeps running; a
handler that cannot be imported is reported the same way to the first caller, then the
worker exits. The worker exits, removing its socket, when process ``P`` is gone (checked
every :data:`POLL_S` seconds; ``P`` is the SuperNode, so stopping a SuperNode stops its
worker), after ``--idle-s`` seconds without a request (default 600), or on SIGTERM. A key
names one worker: the handler is the one the worker was started with.

Files. The socket, lock, PID file and log of key ``K`` live in a private directory (mode
0700, owned by the user): ``$RADBO_WORKER_DIR`` if set, else ``$XDG_RUNTIME_DIR/radbo``, else
``<tempdir>/radbo-<uid>``; their names are a hash of ``K``, so any key fits AF_UNIX's
107-byte path limit. The worker's stdout and stderr go to ``<hash>.log``.

Frames. Each request and reply is one frame: an 8-byte big-endian payload length, one status
byte and the payload; frames over :data:`MAX_FRAME_BYTES` are refused.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

#: Largest payload a frame may carry (1 GiB).
MAX_FRAME_BYTES = 1 << 30
#: How often (seconds) a worker checks its parent and its idle time.
POLL_S = 0.5
#: Seconds a worker waits for a connected caller to send its request (or take its reply).
IO_TIMEOUT_S = 60.0
#: Environment variable naming the directory of the workers' sockets, locks and logs.
DIR_ENV = "RADBO_WORKER_DIR"

REQUEST = 0  # a frame's status byte: caller -> worker
OK = 0  # worker -> caller: the handler's reply
ERROR = 1  # worker -> caller: an error message (UTF-8)

_HEADER = struct.Struct(">QB")
_AF_UNIX_PATH_MAX = 107
_LOG_ROTATE_BYTES = 1 << 20

Handler = Callable[[bytes], bytes]


class WorkerError(RuntimeError):
    """A worker could not be started, went away, or its handler raised (the message says
    which, with the exception's type and message or the tail of the worker's log)."""


class FrameError(WorkerError):
    """A frame was malformed, truncated or over :data:`MAX_FRAME_BYTES`."""


# ----------------------------------------------------------------------------- files


@dataclasses.dataclass(frozen=True)
class WorkerPaths:
    """Where the worker of one key keeps its socket, start lock, PID file and log."""

    socket: Path
    lock: Path
    pid: Path
    log: Path


def runtime_dir() -> Path:
    """The private directory of radbo's worker files, created with mode 0700.

    ``$RADBO_WORKER_DIR`` if set, else ``$XDG_RUNTIME_DIR/radbo``, else
    ``<tempdir>/radbo-<uid>``. Raises :class:`WorkerError` when it is a symlink or owned by
    another user.
    """
    if os.environ.get(DIR_ENV):
        directory = Path(os.environ[DIR_ENV])
    elif os.environ.get("XDG_RUNTIME_DIR") and os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
        directory = Path(os.environ["XDG_RUNTIME_DIR"]) / "radbo"
    else:
        directory = Path(tempfile.gettempdir()) / f"radbo-{os.getuid()}"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(directory)
    if not os.path.isdir(directory) or os.path.islink(directory) or info.st_uid != os.getuid():
        raise WorkerError(
            f"the radbo worker directory {directory} is a link or not owned by uid "
            f"{os.getuid()}; remove it or set {DIR_ENV} to a directory of your own"
        )
    if info.st_mode & 0o077:
        directory.chmod(0o700)
    return directory


def worker_paths(key: str, directory: Path | None = None) -> WorkerPaths:
    """The files of the worker of ``key`` in ``directory`` (default :func:`runtime_dir`)."""
    base = runtime_dir() if directory is None else directory
    stem = base / ("w-" + hashlib.sha256(key.encode()).hexdigest()[:24])
    sock = stem.with_suffix(".sock")
    if len(os.fsencode(sock)) > _AF_UNIX_PATH_MAX:
        raise WorkerError(
            f"the worker socket path {sock} is {len(os.fsencode(sock))} bytes, over AF_UNIX's "
            f"{_AF_UNIX_PATH_MAX}-byte limit; set {DIR_ENV} to a shorter directory"
        )
    return WorkerPaths(
        socket=sock,
        lock=stem.with_suffix(".lock"),
        pid=stem.with_suffix(".pid"),
        log=stem.with_suffix(".log"),
    )


def _log_tail(log: Path, chars: int = 2000) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - chars))
            return f.read().decode(errors="replace").strip() or "(empty)"
    except OSError:
        return "(no log)"


# ----------------------------------------------------------------------------- frames


def send_frame(sock: socket.socket, status: int, payload: bytes) -> None:
    """Send one frame; raises :class:`FrameError` when ``payload`` is over the cap."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(
            f"a frame of {len(payload)} bytes is over the {MAX_FRAME_BYTES}-byte cap "
            f"(radbo.flower.worker.MAX_FRAME_BYTES); send less per request"
        )
    sock.sendall(_HEADER.pack(len(payload), status))
    sock.sendall(payload)


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise FrameError(f"the connection closed after {got} of {size} bytes of a frame")
        got += n
    return data


def recv_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """Receive one frame as ``(status, payload)``; ``None`` when the peer closed before
    sending anything. Raises :class:`FrameError` for a truncated or oversized frame."""
    first = sock.recv(_HEADER.size)
    if not first:
        return None
    header = bytes(first) + bytes(_recv_exactly(sock, _HEADER.size - len(first)))
    size, status = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise FrameError(
            f"a frame announced {size} bytes, over the {MAX_FRAME_BYTES}-byte cap "
            f"(radbo.flower.worker.MAX_FRAME_BYTES)"
        )
    return status, bytes(_recv_exactly(sock, size))


# ----------------------------------------------------------------------------- caller side


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def _connect(path: Path) -> socket.socket | None:
    """A connection to the worker listening on ``path``, or ``None`` when none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(os.fspath(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _import_path() -> str:
    """The caller's ``sys.path`` as a PYTHONPATH, so the worker imports what the caller can."""
    entries: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if path not in entries:
            entries.append(path)
    return os.pathsep.join(entries)


def _spawn(
    key: str, handler: str, parent_pid: int, idle_s: float, paths: WorkerPaths
) -> subprocess.Popen[bytes]:
    with contextlib.suppress(FileNotFoundError):
        if paths.log.stat().st_size > _LOG_ROTATE_BYTES:
            paths.log.replace(paths.log.with_suffix(".log.1"))
    command = [
        sys.executable,
        "-m",
        "radbo.flower.worker",
        "--key",
        key,
        "--handler",
        handler,
        "--parent-pid",
        str(parent_pid),
        "--idle-s",
        repr(idle_s),
        "--dir",
        os.fspath(paths.socket.parent),
    ]
    env = dict(os.environ, PYTHONPATH=_import_path())
    with open(paths.log, "ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _start(
    key: str,
    handler: str,
    parent_pid: int,
    idle_s: float,
    start_timeout_s: float,
    paths: WorkerPaths,
) -> socket.socket:
    """Connect to the worker of ``key``, starting it (once, under the lock) if none listens."""
    with _locked(paths.lock):
        sock = _connect(paths.socket)  # another caller may have started it meanwhile
        if sock is not None:
            return sock
        paths.socket.unlink(missing_ok=True)  # a stale socket: nothing listens on it
        proc = _spawn(key, handler, parent_pid, idle_s, paths)
        deadline = time.monotonic() + start_timeout_s
        while (sock := _connect(paths.socket)) is None:
            code = proc.poll()
            if code is not None:
                raise WorkerError(
                    f"the radbo worker for key {key!r} exited with code {code} before "
                    f"listening; its log {paths.log} ends with:\n{_log_tail(paths.log)}"
                )
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise WorkerError(
                    f"the radbo worker for key {key!r} did not listen within "
                    f"{start_timeout_s} s (raise start_timeout_s on a slow machine); its log "
                    f"{paths.log} ends with:\n{_log_tail(paths.log)}"
                )
            time.sleep(0.02)
    # reap the worker when it exits should this caller outlive it (a zombie would look alive)
    threading.Thread(target=proc.wait, name=f"radbo-worker-{proc.pid}", daemon=True).start()
    return sock


def _split_handler(handler: str) -> tuple[str, str]:
    module, sep, name = handler.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"handler must be 'module:function', got {handler!r}")
    return module, name


def call(
    key: str,
    request: bytes,
    *,
    handler: str,
    parent_pid: int,
    idle_s: float = 600.0,
    start_timeout_s: float = 120.0,
) -> bytes:
    """Send ``request`` to the worker of ``key`` and return its reply.

    Starts the worker (``handler`` = ``"module:function"``, exiting when ``parent_pid`` is
    gone or after ``idle_s`` seconds without a request) when none listens, waiting up to
    ``start_timeout_s`` seconds for it to listen; concurrent callers start one worker.
    Raises :class:`WorkerError` when the handler raised (its type and message), when it could
    not be imported, or when the worker died (with the tail of its log).
    """
    _split_handler(handler)
    if not (idle_s > 0 and start_timeout_s > 0):
        raise ValueError(
            f"idle_s and start_timeout_s must be positive, got {idle_s} and {start_timeout_s}"
        )
    if not _alive(parent_pid):
        raise ValueError(
            f"parent_pid {parent_pid} is not a running process; pass the PID the worker "
            f"belongs to (in a Flower ClientApp: os.getppid(), the SuperNode)"
        )
    payload = bytes(request)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(
            f"a request of {len(payload)} bytes is over the {MAX_FRAME_BYTES}-byte frame cap "
            f"(radbo.flower.worker.MAX_FRAME_BYTES); send less per request"
        )
    paths = worker_paths(key)
    sock = _connect(paths.socket)
    if sock is None:
        sock = _start(key, handler, parent_pid, idle_s, start_timeout_s, paths)
    with sock:
        try:
            send_frame(sock, REQUEST, payload)
            frame = recv_frame(sock)
        except (OSError, FrameError) as err:
            raise WorkerError(
                f"the radbo worker for key {key!r} went away mid-request ({err}); its log "
                f"{paths.log} ends with:\n{_log_tail(paths.log)}"
            ) from err
    if frame is None:
        raise WorkerError(
            f"the radbo worker for key {key!r} exited before replying; its log {paths.log} "
            f"ends with:\n{_log_tail(paths.log)}"
        )
    status, body = frame
    if status == ERROR:
        raise WorkerError(body.decode(errors="replace"))
    return body


def running(key: str) -> int | None:
    """The PID of the worker of ``key`` if one is alive and listening, else ``None``."""
    paths = worker_paths(key)
    try:
        pid = int(paths.pid.read_text())
    except (FileNotFoundError, ValueError):
        return None
    if not _alive(pid):
        return None
    sock = _connect(paths.socket)  # the worker ignores a connection that sends nothing
    if sock is None:
        return None
    sock.close()
    return pid


def stop(key: str, *, timeout_s: float = 10.0) -> int | None:
    """Stop the worker of ``key`` (SIGTERM, then SIGKILL after ``timeout_s`` seconds) and
    return its PID, or ``None`` when none was running."""
    pid = running(key)
    if pid is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the worker leads its own session
        paths = worker_paths(key)
        paths.socket.unlink(missing_ok=True)
        paths.pid.unlink(missing_ok=True)
    return pid


# ----------------------------------------------------------------------------- worker side


def _say(message: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"{stamp} radbo worker {os.getpid()}: {message}", file=sys.stderr, flush=True)


def _load_handler(spec: str) -> tuple[Handler | None, str | None]:
    """``(function, None)``, or ``(None, why it could not be loaded)``."""
    try:
        module, name = _split_handler(spec)
        target: object = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{spec} is a {type(target).__name__}, not a function")
    except Exception as err:
        _say(f"cannot import handler {spec!r}:\n{traceback.format_exc()}")
        return None, f"the radbo worker could not import handler {spec!r}: {_describe(err)}"
    return target, None


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _listen(path: Path) -> socket.socket:
    """Bind and listen on ``path``, replacing a stale socket file; refuses a live one."""
    live = _connect(path)
    if live is not None:
        live.close()
        raise WorkerError(f"another radbo worker already listens on {path}")
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(path))
    listener.listen(128)
    return listener


def _serve_connection(conn: socket.socket, handler: Handler | None, load_error: str | None) -> bool:
    """Answer one connection; ``True`` when it carried a request (a probe carries none)."""
    with conn:
        conn.settimeout(IO_TIMEOUT_S)
        try:
            frame = recv_frame(conn)
        except FrameError as err:
            _say(f"refused a request: {err}")
            with contextlib.suppress(OSError):
                send_frame(conn, ERROR, f"the radbo worker refused the request: {err}".encode())
            return False
        except OSError as err:
            _say(f"a caller went away before its request arrived: {err}")
            return False
        if frame is None:
            return False
        status, request = frame
        if status != REQUEST:
            reply_status, reply = ERROR, f"unknown frame status {status}".encode()
        elif handler is None:
            reply_status, reply = ERROR, str(load_error).encode()
        else:
            try:
                result = handler(request)
                if not isinstance(result, bytes | bytearray | memoryview):
                    raise TypeError(f"the handler returned a {type(result).__name__}, not bytes")
                reply_status, reply = OK, bytes(result)
            except Exception as err:
                _say(f"the handler raised:\n{traceback.format_exc()}")
                reply_status, reply = ERROR, _describe(err).encode()
            if len(reply) > MAX_FRAME_BYTES:
                reply_status = ERROR
                reply = f"the handler's reply of {len(reply)} bytes is over the frame cap".encode()
        try:
            send_frame(conn, reply_status, reply)
        except OSError as err:
            _say(f"a caller went away before its reply was sent: {err}")
        return True


def _drain(listener: socket.socket, handler: Handler | None, load_error: str | None) -> None:
    """Answer the connections already queued (the socket file is gone, so no more come)."""
    listener.setblocking(False)
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(True)
        _serve_connection(conn, handler, load_error)


def _unlink_if_ours(path: Path, inode: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.stat(path).st_ino == inode:
            path.unlink()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def serve(key: str, handler: str, *, parent_pid: int, idle_s: float, directory: Path) -> int:
    """The worker's main loop (see the module docstring); returns the exit code."""
    paths = worker_paths(key, directory)
    signal.signal(signal.SIGTERM, _on_sigterm)
    listener = _listen(paths.socket)
    inode = os.stat(paths.socket).st_ino
    pid_tmp = paths.pid.with_suffix(f".pid.{os.getpid()}")
    pid_tmp.write_text(str(os.getpid()))
    pid_tmp.replace(paths.pid)
    _say(f"serving key {key!r} with {handler} on {paths.socket} (parent {parent_pid})")
    try:
        function, load_error = _load_handler(handler)
        last = time.monotonic()
        while True:
            ready, _, _ = select.select([listener], [], [], POLL_S)
            if ready:
                conn, _ = listener.accept()
                if _serve_connection(conn, function, load_error):
                    last = time.monotonic()
                    if load_error is not None:
                        _say("exiting: the handler could not be imported")
                        break
            if not _alive(parent_pid):
                _say(f"exiting: parent process {parent_pid} is gone")
                return 0
            if time.monotonic() - last >= idle_s:
                _say(f"exiting: idle for {idle_s} s")
                break
        _unlink_if_ours(paths.socket, inode)  # new callers start a new worker ...
        _drain(listener, function, load_error)  # ... and queued ones are answered
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        listener.close()
        _unlink_if_ours(paths.socket, inode)
        with contextlib.suppress(OSError, ValueError):
            if int(paths.pid.read_text()) == os.getpid():
                paths.pid.unlink()


def main(argv: list[str] | None = None) -> int:
    """``python -m radbo.flower.worker``: run one worker (started by :func:`call`)."""
    parser = argparse.ArgumentParser(prog="python -m radbo.flower.worker", description=__doc__)
    parser.add_argument("--key", required=True)
    parser.add_argument("--handler", required=True, help="module:function")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--idle-s", type=float, default=600.0)
    parser.add_argument("--dir", type=Path, default=None, help="default: runtime_dir()")
    args = parser.parse_args(argv)
    if not args.idle_s > 0:
        parser.error(f"--idle-s must be positive, got {args.idle_s}")
    directory = runtime_dir() if args.dir is None else args.dir
    return serve(
        args.key, args.handler, parent_pid=args.parent_pid, idle_s=args.idle_s, directory=directory
    )


if __name__ == "__main__":
    sys.exit(main())
