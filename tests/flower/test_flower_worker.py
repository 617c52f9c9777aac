"""radbo.flower.worker: one long-lived worker process per key behind a Unix-domain socket.

Every test gets a private worker directory; the fixture stops every worker started in it and
asserts that no worker process is left. Waits are bounded poll loops, never timing claims.
"""

import ast
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from radbo.flower import worker
from radbo.flower.worker import FrameError, WorkerError, call, running, stop, worker_paths

HANDLERS = "tests.flower_worker_handlers"
COUNT = f"{HANDLERS}:count"
ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 60.0  # a generous bound for polls; the tests claim no timings


def worker_pids(directory):
    """PIDs of the live worker processes started with ``--dir directory``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"radbo.flower.worker" in argv and os.fsencode(directory) in argv:
            if worker._alive(int(entry.name)):
                pids.append(int(entry.name))
    return pids


def poll(condition):
    """Wait until ``condition()`` holds; False if it still fails after BOUND_S seconds."""
    deadline = time.monotonic() + BOUND_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def gone(pid):
    return poll(lambda: not worker._alive(pid))


def parse(reply):
    pid, served, request = reply.decode().split(" ", 2)
    return int(pid), int(served), request


class Workers:
    """Fresh keys in a private worker directory, and fake parent processes."""

    def __init__(self, directory):
        self.directory = directory
        self.keys = []
        self.parents = []

    def key(self):
        key = f"test-{uuid.uuid4().hex}"
        self.keys.append(key)
        return key

    def parent(self):
        proc = subprocess.Popen(["sleep", "600"])
        self.parents.append(proc)
        return proc


@pytest.fixture
def workers(monkeypatch):
    # a short directory of its own (AF_UNIX paths are limited to 107 bytes)
    directory = tempfile.mkdtemp(prefix="rbw-", dir="/tmp")
    monkeypatch.setenv(worker.DIR_ENV, directory)
    fleet = Workers(directory)
    try:
        yield fleet
    finally:
        for key in fleet.keys:
            stop(key)
        for proc in fleet.parents:
            proc.kill()
            proc.wait()
        leftovers = [pid for pid in worker_pids(directory) if not gone(pid)]
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)
        assert not leftovers, f"worker processes left behind: {leftovers}"
        assert not worker_pids(directory)


# ----------------------------------------------------------------------------- frames


def test_frames_round_trip_over_a_socket_pair():
    a, b = socket.socketpair()
    with a, b:
        worker.send_frame(a, worker.OK, b"")
        worker.send_frame(a, worker.ERROR, b"\x00\xffpayload")
        assert worker.recv_frame(b) == (worker.OK, b"")
        assert worker.recv_frame(b) == (worker.ERROR, b"\x00\xffpayload")
        a.shutdown(socket.SHUT_WR)
        assert worker.recv_frame(b) is None  # closed before a frame: no frame


def test_truncated_and_oversized_frames_are_refused(monkeypatch):
    a, b = socket.socketpair()
    with a, b:
        a.sendall((10).to_bytes(8, "big") + b"\x00abc")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match="closed after 3 of 10 bytes"):
            worker.recv_frame(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall((worker.MAX_FRAME_BYTES + 1).to_bytes(8, "big") + b"\x00")
        with pytest.raises(FrameError, match="over the 1073741824-byte cap"):
            worker.recv_frame(b)
    monkeypatch.setattr(worker, "MAX_FRAME_BYTES", 4)
    a, b = socket.socketpair()
    with a, b, pytest.raises(FrameError, match="a frame of 5 bytes is over the 4-byte cap"):
        worker.send_frame(a, worker.OK, b"12345")


def test_connections_queued_at_exit_are_answered(tmp_path):
    # an exiting worker unlinks its socket first, then answers the callers already queued
    path = tmp_path / "s"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.fspath(path))
    listener.listen(8)
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    try:
        for i, client in enumerate(clients):
            client.connect(os.fspath(path))
            worker.send_frame(client, worker.REQUEST, f"r{i}".encode())
        path.unlink()
        worker._drain(listener, lambda request: request.upper(), None)
        assert [worker.recv_frame(c) for c in clients] == [
            (worker.OK, b"R0"),
            (worker.OK, b"R1"),
            (worker.OK, b"R2"),
        ]
    finally:
        listener.close()
        for client in clients:
            client.close()


# ----------------------------------------------------------------------------- files


def test_socket_paths_are_private_short_and_per_key(monkeypatch, tmp_path):
    monkeypatch.setenv(worker.DIR_ENV, str(tmp_path / "w"))
    long_key = "node-" + "x" * 5000
    paths = worker_paths(long_key)
    assert len(os.fsencode(paths.socket)) <= 107
    assert paths.socket.parent == tmp_path / "w"
    assert (tmp_path / "w").stat().st_mode & 0o777 == 0o700
    assert worker_paths("a").socket != worker_paths("b").socket
    assert worker_paths("a") == worker_paths("a")
    monkeypatch.setenv(worker.DIR_ENV, str(tmp_path / ("d" * 120)))
    with pytest.raises(WorkerError, match="over AF_UNIX's 107-byte limit; set RADBO_WORKER_DIR"):
        worker_paths("a")


def test_the_module_imports_only_the_standard_library():
    tree = ast.parse(Path(worker.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_importing_the_worker_module_does_not_import_torch():
    code = (
        "import sys, radbo.flower.worker\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'flwr'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- call


def test_first_call_starts_a_worker_and_the_second_reuses_it(workers):
    key = workers.key()
    assert running(key) is None
    pid1, served1, req1 = parse(call(key, b"one", handler=COUNT, parent_pid=os.getpid()))
    assert running(key) == pid1 != os.getpid()
    pid2, served2, req2 = parse(call(key, b"two", handler=COUNT, parent_pid=os.getpid()))
    assert (pid2, served1, served2, req1, req2) == (pid1, 1, 2, "one", "two")
    other = workers.key()  # another key: another worker with its own state
    pid3, served3, _ = parse(call(other, b"x", handler=COUNT, parent_pid=os.getpid()))
    assert pid3 != pid1 and served3 == 1


def test_concurrent_threads_start_exactly_one_worker(workers):
    key, n = workers.key(), 8
    barrier = threading.Barrier(n)
    replies, errors = [None] * n, []

    def caller(i):
        try:
            barrier.wait()
            replies[i] = parse(call(key, str(i).encode(), handler=COUNT, parent_pid=os.getpid()))
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({pid for pid, _, _ in replies}) == 1
    assert worker_pids(workers.directory) == [replies[0][0]]  # and no other worker started
    assert sorted(served for _, served, _ in replies) == list(range(1, n + 1))
    assert sorted(int(r) for _, _, r in replies) == list(range(n))


def test_concurrent_processes_start_exactly_one_worker(workers):
    key, n = workers.key(), 4
    go = Path(workers.directory) / "go"
    code = (
        "import os, sys, time\n"
        "from radbo.flower.worker import call\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.005)\n"
        "reply = call(sys.argv[1], sys.argv[3].encode(), handler=sys.argv[4], "
        "parent_pid=int(sys.argv[5]))\n"
        "print(reply.decode())\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, key, str(go), str(i), COUNT, str(os.getpid())],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    try:
        go.touch()
        outs = [p.communicate(timeout=BOUND_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0] * n, [err for _, err in outs]
    replies = [parse(out.strip().encode()) for out, _ in outs]
    assert len({pid for pid, _, _ in replies}) == 1
    assert worker_pids(workers.directory) == [replies[0][0]]  # and no other worker started
    assert sorted(served for _, served, _ in replies) == list(range(1, n + 1))


def test_a_handler_exception_comes_back_and_the_worker_survives(workers):
    key = workers.key()
    with pytest.raises(WorkerError, match=r"^ValueError: bad request 7$"):
        call(key, b"7", handler=f"{HANDLERS}:fail", parent_pid=os.getpid())
    pid = running(key)
    assert pid is not None
    with pytest.raises(WorkerError, match=r"^ValueError: bad request 8$"):
        call(key, b"8", handler=f"{HANDLERS}:fail", parent_pid=os.getpid())
    assert running(key) == pid
    key = workers.key()
    with pytest.raises(WorkerError, match=r"^TypeError: the handler returned a int, not bytes$"):
        call(key, b"abc", handler=f"{HANDLERS}:not_bytes", parent_pid=os.getpid())
    assert running(key) is not None


def test_the_worker_exits_when_its_parent_dies(workers):
    key, parent = workers.key(), workers.parent()
    pid, _, _ = parse(call(key, b"x", handler=COUNT, parent_pid=parent.pid))
    assert running(key) == pid
    parent.kill()
    parent.wait()
    assert gone(pid)
    assert not worker_paths(key).socket.exists()
    assert not worker_paths(key).pid.exists()
    assert running(key) is None


def test_the_worker_exits_when_idle_and_the_next_call_starts_a_new_one(workers):
    key = workers.key()
    pid, _, _ = parse(call(key, b"x", handler=COUNT, parent_pid=os.getpid(), idle_s=0.2))
    assert gone(pid)
    assert not worker_paths(key).socket.exists()
    assert running(key) is None
    pid2, served, _ = parse(call(key, b"y", handler=COUNT, parent_pid=os.getpid()))
    assert served == 1  # a fresh worker: its state starts over
    assert running(key) == pid2


def test_sigterm_stops_the_worker_and_removes_its_files(workers):
    key = workers.key()
    pid, _, _ = parse(call(key, b"x", handler=COUNT, parent_pid=os.getpid()))
    assert stop(key) == pid
    assert gone(pid)
    assert not worker_paths(key).socket.exists()
    assert not worker_paths(key).pid.exists()
    assert stop(key) is None


def test_a_stale_socket_file_is_replaced(workers):
    key = workers.key()
    path = worker_paths(key).socket
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.fspath(path))  # a socket file nobody listens on (a killed worker's)
    stale.close()
    inode = path.stat().st_ino
    pid, served, _ = parse(call(key, b"x", handler=COUNT, parent_pid=os.getpid()))
    assert served == 1 and running(key) == pid
    assert path.stat().st_ino != inode


def test_a_killed_worker_is_replaced_on_the_next_call(workers):
    key = workers.key()
    pid, _, _ = parse(call(key, b"x", handler=COUNT, parent_pid=os.getpid()))
    os.kill(pid, signal.SIGKILL)  # leaves its socket and PID files behind
    assert gone(pid)
    assert worker_paths(key).socket.exists()
    assert running(key) is None
    pid2, served, _ = parse(call(key, b"y", handler=COUNT, parent_pid=os.getpid()))
    assert served == 1 and running(key) == pid2


@pytest.mark.parametrize(
    "handler, why",
    [
        (f"{HANDLERS}:missing", "AttributeError: module 'tests.flower_worker_handlers' has no"),
        ("no_such_module_radbo:f", "ModuleNotFoundError: No module named 'no_such_module_radbo'"),
    ],
)
def test_a_handler_import_error_is_reported_and_the_worker_exits(workers, handler, why):
    key = workers.key()
    with pytest.raises(WorkerError, match=f"could not import handler '{handler}': {why}"):
        call(key, b"x", handler=handler, parent_pid=os.getpid())
    assert poll(lambda: not worker_pids(workers.directory))
    assert not worker_paths(key).socket.exists()
    assert "cannot import handler" in worker_paths(key).log.read_text()


def test_oversized_requests_are_refused_on_both_sides(workers, monkeypatch):
    key = workers.key()
    pid, _, _ = parse(call(key, b"x", handler=COUNT, parent_pid=os.getpid()))
    # a caller announcing more than the cap gets an error frame; the worker keeps serving
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(os.fspath(worker_paths(key).socket))
        raw.sendall((worker.MAX_FRAME_BYTES + 1).to_bytes(8, "big") + b"\x00")
        status, message = worker.recv_frame(raw)
    assert status == worker.ERROR
    assert message.decode().startswith("the radbo worker refused the request: a frame announced")
    assert parse(call(key, b"y", handler=COUNT, parent_pid=os.getpid()))[:2] == (pid, 2)
    monkeypatch.setattr(worker, "MAX_FRAME_BYTES", 8)
    with pytest.raises(FrameError, match="a request of 9 bytes is over the 8-byte frame cap"):
        call(key, b"123456789", handler=COUNT, parent_pid=os.getpid())


def test_the_worker_imports_through_the_callers_sys_path(workers, monkeypatch, tmp_path):
    # from another directory, `tests` and `radbo` are importable only through sys.path
    monkeypatch.chdir(tmp_path)
    key = workers.key()
    assert call(key, b"payload", handler=f"{HANDLERS}:echo", parent_pid=os.getpid()) == b"payload"


def test_bad_arguments_fail_before_any_worker_starts(workers):
    key = workers.key()
    dead = subprocess.Popen(["true"])
    dead.wait()
    with pytest.raises(ValueError, match=f"parent_pid {dead.pid} is not a running process"):
        call(key, b"x", handler=COUNT, parent_pid=dead.pid)
    with pytest.raises(ValueError, match="handler must be 'module:function', got 'count'"):
        call(key, b"x", handler="count", parent_pid=os.getpid())
    with pytest.raises(ValueError, match="idle_s and start_timeout_s must be positive"):
        call(key, b"x", handler=COUNT, parent_pid=os.getpid(), idle_s=0)
    assert running(key) is None and not worker_pids(workers.directory)
