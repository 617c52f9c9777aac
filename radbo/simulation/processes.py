"""Running clients in parallel worker processes: :class:`ProcessBackend`.

radbo's client work is thousands of tiny tensor operations, where torch's intra-op threads
only add synchronisation (see :class:`radbo.config.RuntimeConfig`). The cores are used instead
by running *clients* in parallel: :class:`ProcessBackend` implements the engine's
:class:`~radbo.client.Backend` protocol with a pool of single-threaded worker processes.

**How work reaches the workers.** The workers are forked from the process that runs the
simulation, so they inherit the read-only :class:`~radbo.client.ClientRuntime` (problem, data,
model) and the algorithm's client work without pickling either (a runtime holds modules and
closures that do not pickle). The backend keeps a catalog of the ``(work, runtime)`` pairs it
has been given -- a phase's :class:`~radbo.client.ClientWork` compares equal from round to
round -- and forks the pool with the catalog known at that moment. A later pair (in round 0:
the other phases' work) is sent to the workers pickled -- a ClientWork of an algorithm's
bound methods pickles the algorithm's settings, a few hundred bytes -- when they hold its
runtime; a work that does not pickle, or a new runtime, restarts the pool so that new
workers inherit it. Afterwards only each :class:`~radbo.client.ClientTask` (received tensors,
index set, data indices, seed, budget) and the catalog entry's number travel to a worker, and
its :class:`~radbo.client.ClientResult` comes back. Their tensors' bytes are copied into
shared memory that the worker inherited (:class:`_Arena`: two slots each way, written in turn),
and only a pickled header -- the tensors' places, shapes, strides and dtypes, and the rest of
the task or result -- crosses the pipe: a 4 MB tensor costs two copies in memory instead of
some twenty trips through a pipe that holds a few hundred kB (``benchmarks/pipe_transfer.py``).
Tensors that do not fit in a slot (:data:`_SLOT_BYTES`), and every message where shared memory
could not be mapped, travel in the pipe, pickled with their exact bytes, shape and strides.
Tasks go out to whichever worker is free, biggest first (by received numbers x
local steps), so unequal clients balance across the workers; each worker holds the next task
while it runs one, so it does not wait for this process in between.

**Equality with the sequential backend.** A worker runs ``work(runtime, task)`` -- what
:class:`~radbo.simulation.SequentialBackend` runs -- with one intra-op thread, on the same
inherited tensors, in the same dtype, so each result is bitwise the sequential one when that
runs with one thread too (``[runtime] threads = 1``, the default). FLOPs are charged in this
process through :func:`~radbo.client.run_measured` with the worker's result, in task order,
so the FLOP meter, the ledger and ``results.json`` are exactly the sequential run's.

**Lifetime.** The pool starts on the first :meth:`ProcessBackend.run` and stops on
:meth:`ProcessBackend.close` (also the context manager's exit; :func:`radbo.run` closes the
backend when a run ends, fails or is interrupted). Workers ignore SIGINT so that Ctrl-C
reaches only this process, which then shuts them down; a worker also exits when this process
disappears (its pipe closes). A worker that dies mid-phase raises
:class:`ClientWorkerError` naming the client and phase, and an exception in client work is
re-raised here with the worker's traceback as a note.

Needs the ``fork`` start method (Linux; not Windows). Fork from a process that runs one
thread: radbo's runs do (``[runtime] threads = 1``).
"""

from __future__ import annotations

import copyreg
import io
import mmap
import multiprocessing
import os
import pickle
import queue
import selectors
import signal
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, ClassVar

import torch
from torch import Tensor

from radbo.client import ClientResult, ClientRuntime, ClientTask, run_measured
from radbo.cost import FlopMeter
from radbo.simulation.backends import BACKENDS

__all__ = ["ClientWorkerError", "ProcessBackend", "usable_cpus"]

Work = Callable[[ClientRuntime, ClientTask], ClientResult]
Catalog = list[tuple[Work, ClientRuntime]]

_STOP = b""  # the message that asks a worker to exit
_GRACE_S = 5.0  # how long close() waits for idle workers before terminating them
_QUEUE = 2  # tasks a worker holds at most: the one it runs and the next
#: bytes of one shared-memory slot (:class:`_Arena`): a message's tensors beyond it go through
#: the pipe. Pages are only committed where a message has written, so this is address space.
_SLOT_BYTES = 64 << 20
_ALIGN = 64  # each tensor's bytes start at a multiple of this in a slot


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the CPU count without one).

    >>> usable_cpus() >= 1
    True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


class ClientWorkerError(RuntimeError):
    """A worker process of a :class:`ProcessBackend` died or sent no usable answer."""


# ---------------------------------------------------------------------------- the wire
def _tensor(raw: Any, dtype: torch.dtype, size: tuple, stride: tuple, offset: int) -> Tensor:
    """A tensor over the bytes ``raw`` (a uint8 array) with the given geometry."""
    storage = torch.from_numpy(raw).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


def _plain(t: Tensor) -> bool:
    """Whether ``t`` crosses as its bytes (a dense CPU tensor without autograd, conjugate or
    negative bits); anything else is pickled as torch pickles it."""
    return (
        t.layout == torch.strided
        and t.device.type == "cpu"
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
    )


def _span(t: Tensor) -> Tensor:
    """The bytes (uint8) that ``t``'s elements span in its storage, from its first element: a
    view sends its span, not its whole storage, and comes back with the same strides."""
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8)
    steps = zip(t.shape, t.stride(), strict=True)
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * k for n, k in steps)
    start, size = t.storage_offset() * t.element_size(), span * t.element_size()
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())[start : start + size]


def _reduce_tensor(t: Tensor) -> tuple[Any, ...]:
    """Pickles a plain CPU tensor as the bytes its elements span in its storage, with its
    size and stride (the same values, shape and strides back; several times faster than
    torch's own reduction, and a view sends its span, not its whole storage); anything else
    (a tensor that requires grad, a sparse or non-CPU one) as torch pickles it."""
    if not _plain(t):
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _tensor, (_span(t).numpy(), t.dtype, tuple(t.shape), t.stride(), 0)


_DISPATCH = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}


def _dumps(value: object) -> bytes:
    """``value`` pickled with the fast tensor reduction (:func:`_reduce_tensor`)."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(value)
    return out.getvalue()


class _Arena:
    """Shared memory for the tensors of one direction of one worker's pipe: :data:`_QUEUE`
    slots of ``slot_bytes``, message ``n`` written into slot ``n % _QUEUE``.

    Mapped anonymously and shared before the worker is forked, so both processes see the same
    pages. Written by hand because the standard library's shared memory needs named segments
    (``/dev/shm``, often 64 MB in containers, and left behind by a killed process) and torch's
    ``share_memory_`` a file descriptor per tensor; here one mapping serves every message.

    **Why a slot is free when it is written.** A worker holds at most :data:`_QUEUE` tasks
    (:meth:`_Pool.run`), and answers them in order. When the parent sends task ``n``, at most
    one earlier task is unanswered, so task ``n - 2``'s result has come back -- and the worker
    read task ``n - 2`` out of its slot before running it. Task ``n`` is sent only after the
    parent has read (copied out) the result of task ``n - 2``, so when the worker writes result
    ``n`` into that result's slot, nobody reads it any more. Every reader copies a message's
    tensors out of the slot before it goes on (:class:`_Unpickler`).
    """

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.buffer = mmap.mmap(-1, _QUEUE * slot_bytes)  # MAP_SHARED | MAP_ANONYMOUS
        self.written = 0  # messages written (by the one process that writes this arena)

    @classmethod
    def pair(cls, slot_bytes: int) -> tuple[_Arena, _Arena] | None:
        """An arena for each direction, or ``None`` (pipe only) where none can be mapped."""
        if slot_bytes <= 0:
            return None
        try:
            return cls(slot_bytes), cls(slot_bytes)
        except (OSError, ValueError, OverflowError):  # no shared mapping of this size here
            return None


class _Pickler(pickle.Pickler):
    """Pickles a message, its plain tensors' bytes into slot ``arena.written % _QUEUE`` while
    they fit (as persistent ids: place, dtype, shape, strides), the rest with
    :func:`_reduce_tensor`. A tensor met twice is placed once and comes back as one object,
    as the pickler's memo does for the rest."""

    def __init__(self, out: io.BytesIO, arena: _Arena) -> None:
        super().__init__(out, pickle.HIGHEST_PROTOCOL)
        self.dispatch_table = _DISPATCH
        self.arena = arena
        self.start = (arena.written % _QUEUE) * arena.slot_bytes
        self.used = 0
        self.placed: dict[int, tuple[Tensor, tuple[Any, ...]]] = {}  # id -> (tensor, its id)

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not Tensor or not _plain(obj):  # a Parameter pickles as one
            return None
        if id(obj) in self.placed:
            return self.placed[id(obj)][1]
        raw = _span(obj)
        at = -(-self.used // _ALIGN) * _ALIGN
        if raw.numel() == 0 or at + raw.numel() > self.arena.slot_bytes:
            return None  # nothing to place, or no room left: in the pipe
        offset = self.start + at
        place = torch.frombuffer(
            self.arena.buffer, dtype=torch.uint8, count=raw.numel(), offset=offset
        )
        place.copy_(raw)
        self.used = at + raw.numel()
        pid = (offset, raw.numel(), obj.dtype, tuple(obj.shape), obj.stride())
        self.placed[id(obj)] = (obj, pid)  # holding obj keeps its id from being reused
        return pid


class _Unpickler(pickle.Unpickler):
    """Reads a message written by :class:`_Pickler`, copying each tensor out of the arena."""

    def __init__(self, message: bytes, arena: _Arena | None) -> None:
        super().__init__(io.BytesIO(message))
        self.arena = arena
        self.loaded: dict[int, Tensor] = {}  # offset -> the tensor read from there

    def persistent_load(self, pid: Any) -> Tensor:
        if self.arena is None:
            raise pickle.UnpicklingError("a message refers to shared memory this pipe lacks")
        offset, count, dtype, size, stride = pid
        if offset not in self.loaded:
            raw = torch.frombuffer(self.arena.buffer, dtype=torch.uint8, count=count, offset=offset)
            self.loaded[offset] = _tensor(raw.clone().numpy(), dtype, size, stride, 0)
        return self.loaded[offset]


def _pack(value: object, arena: _Arena | None) -> bytes:
    """``value`` pickled, its tensors in ``arena``'s next slot where they fit (:class:`_Pickler`),
    or all in the message without an arena (:func:`_dumps`)."""
    if arena is None:
        return _dumps(value)
    out = io.BytesIO()
    _Pickler(out, arena).dump(value)
    arena.written += 1
    return out.getvalue()


def _unpack(message: bytes, arena: _Arena | None) -> Any:
    """What :func:`_pack` packed, with ``arena`` the sender's."""
    return _Unpickler(message, arena).load()


# ---------------------------------------------------------------------------- the worker
def _serve(
    conn: Connection,
    catalog: Catalog,
    inherited: Sequence[Connection],
    arenas: tuple[_Arena, _Arena] | None,
) -> None:
    """A worker's loop: run ``catalog[entry]`` on each task received and send back the result;
    learn new catalog entries (a pickled work over an inherited runtime) on the way. Tasks'
    tensors come through ``arenas[0]``, results' go through ``arenas[1]`` (:class:`_Arena`)."""
    tasks_in, results_out = arenas if arenas is not None else (None, None)
    known = dict(enumerate(catalog))
    for other in inherited:  # this process's copies of the pool's ends of the pipes
        other.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(1)
    inbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    threading.Thread(target=_receive, args=(conn, inbox), name="radbo-inbox", daemon=True).start()
    while True:
        message = inbox.get()
        if message == _STOP:
            return
        kind, entry, *payload = _unpack(message, tasks_in)
        if kind == "work":  # (work, the entry whose runtime it runs on); no answer
            known[entry] = (payload[0], known[payload[1]][1])
            continue
        work, runtime = known[entry]
        try:
            answer = _pack((True, work(runtime, payload[0])), results_out)
        except Exception as err:  # noqa: BLE001 - every failure goes back to the parent
            answer = _failure(err, traceback.format_exc())
        conn.send_bytes(answer)


def _receive(conn: Connection, inbox: queue.SimpleQueue[bytes]) -> None:
    """A worker's reader: every message from the parent into ``inbox`` as it arrives, and
    :data:`_STOP` when the parent asks to stop or is gone.

    A pipe holds a few hundred kB (a Unix socket's buffer). A worker that read only between
    tasks would, while sending a large result, leave the parent blocked in sending it the next
    task (:data:`_QUEUE`): each side waiting for the other to read, for ever. Reading on a
    thread of its own, a worker takes every message in while it computes or sends, so the
    parent's sends always finish and it goes on to read the result: messages of any size."""
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            message = _STOP
        inbox.put(message)
        if message == _STOP:
            return


def _failure(err: Exception, trace: str) -> bytes:
    """``(False, exception, traceback)`` pickled; the exception as text if it will not pickle."""
    try:
        return _dumps((False, err, trace))
    except Exception:  # noqa: BLE001 - an unpicklable exception still gets reported
        return pickle.dumps((False, RuntimeError(f"{type(err).__name__}: {err}"), trace))


# ---------------------------------------------------------------------------- the pool
def _size(task: ClientTask) -> int:
    """A task's expected work, to hand out big tasks first: received numbers x local steps."""
    return sum(t.numel() for t in task.params.values()) * task.budget.local_steps


def _stop(processes: list[BaseProcess], conns: list[Connection], grace_s: float) -> None:
    """Ask the workers to exit, wait up to ``grace_s``, then terminate and kill stragglers."""
    for conn in conns:
        try:
            conn.send_bytes(_STOP)
        except (OSError, ValueError):  # the worker is gone or the pipe is closed already
            pass
        conn.close()
    for proc in processes:
        proc.join(grace_s)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
    processes.clear()
    conns.clear()


class _Pool:
    """``size`` forked workers that inherited ``catalog``, each behind its own pipe and, where
    shared memory can be mapped, a pair of :class:`_Arena` of ``slot_bytes`` slots (tasks out,
    results back; 0: none, every message in the pipe)."""

    def __init__(self, size: int, catalog: Catalog, slot_bytes: int = _SLOT_BYTES) -> None:
        context = multiprocessing.get_context("fork")
        self.catalog = catalog
        self.processes: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self.arenas: list[tuple[_Arena, _Arena] | None] = []
        # stops the workers if the backend is dropped without close() (and at exit)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns, 0.0)
        for k in range(size):
            mine, theirs = context.Pipe(duplex=True)
            arenas = _Arena.pair(slot_bytes)
            proc = context.Process(
                target=_serve,
                args=(theirs, catalog, [*self.conns, mine], arenas),
                name=f"radbo-client-worker-{k}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self.processes.append(proc)
            self.conns.append(mine)
            self.arenas.append(arenas)
        # what run() waits for: an answer on a pipe, or a worker's end (its sentinel)
        self.events = selectors.DefaultSelector()
        for k, (worker, conn) in enumerate(zip(self.processes, self.conns, strict=True)):
            self.events.register(conn, selectors.EVENT_READ, (k, conn))
            self.events.register(worker.sentinel, selectors.EVENT_READ, (k, None))

    def teach(self, entry: int, work: Work, runtime: ClientRuntime) -> bool:
        """Send the workers ``work`` as catalog entry ``entry``, if they hold ``runtime`` (it
        cannot travel) and ``work`` pickles; ``False`` when they could not be taught."""
        found = [i for i, (_, known) in enumerate(self.catalog) if known is runtime]
        if not found:
            return False
        try:
            message = _dumps(("work", entry, work, found[0]))
        except Exception:  # noqa: BLE001 - any object may refuse to pickle: fork anew instead
            return False
        try:
            for conn in self.conns:
                conn.send_bytes(message)
        except OSError:  # a worker is gone: fork anew
            return False
        return True

    def close(self, grace_s: float) -> None:
        self._finalizer.detach()
        self.events.close()
        _stop(self.processes, self.conns, grace_s)

    def run(self, entry: int, tasks: Sequence[ClientTask]) -> list[ClientResult]:
        """The results of ``catalog[entry]`` on ``tasks``, in task order.

        Tasks are handed out biggest first (:func:`_size`) to whichever worker is free; while
        more tasks wait than there are workers, each worker also holds the next one in its
        pipe (:data:`_QUEUE`), so that it does not wait for this process between tasks. When a
        task fails, only tasks before it (in task order) are still handed out; once those are
        back, the failure of the earliest task is raised (the one a sequential run raises).
        """
        results: list[ClientResult | None] = [None] * len(tasks)
        failures: dict[int, tuple[BaseException, str]] = {}
        pending = sorted(range(len(tasks)), key=lambda i: -_size(tasks[i]))
        queued: list[deque[int]] = [deque() for _ in self.conns]  # sent, not answered yet

        def hand_out(k: int, depth: int = _QUEUE) -> None:
            if failures:  # only what a sequential run would still have run
                pending[:] = [i for i in pending if i < min(failures)]
            while pending and (
                not queued[k] or (len(queued[k]) < depth and len(pending) >= len(self.conns))
            ):
                i = pending.pop(0)
                try:
                    arenas = self.arenas[k]
                    tasks_out = None if arenas is None else arenas[0]
                    self.conns[k].send_bytes(_pack(("task", entry, tasks[i]), tasks_out))
                except OSError:  # the worker is gone
                    raise self._died(k, tasks, i) from None
                queued[k].append(i)

        for depth in (1, _QUEUE):  # every worker starts on a task before any gets a second
            for k in range(len(self.conns)):
                hand_out(k, depth)
        while any(queued):
            for key, _ in self.events.select():
                k, ready = key.data
                if ready is None:  # a worker's process ended
                    if not queued[k] or not self.conns[k].poll():
                        raise self._died(k, tasks, queued[k][0] if queued[k] else None)
                    continue
                if not queued[k]:  # a worker spoke out of turn
                    raise self._died(k, tasks, None)
                i = queued[k][0]
                arenas = self.arenas[k]
                results_in = None if arenas is None else arenas[1]
                try:
                    answer = _unpack(ready.recv_bytes(), results_in)
                except (EOFError, OSError):
                    raise self._died(k, tasks, i) from None
                queued[k].popleft()
                if answer[0]:
                    results[i] = answer[1]
                else:
                    failures[i] = (answer[1], answer[2])
                hand_out(k)
        if failures:
            first = min(failures)
            err, trace = failures[first]
            task = tasks[first]
            err.add_note(
                f"raised in a client worker process running client {task.client}'s "
                f"{task.phase!r} task of round {task.round}; the worker's traceback:\n{trace}"
            )
            raise err
        return [r for r in results if r is not None]

    def _died(self, k: int, tasks: Sequence[ClientTask], i: int | None) -> ClientWorkerError:
        proc = self.processes[k]
        proc.join(1.0)
        doing = "while idle"
        if i is not None:
            task = tasks[i]
            doing = (
                f"while running client {task.client}'s {task.phase!r} task of round {task.round}"
            )
        return ClientWorkerError(
            f"client worker {k} (pid {proc.pid}) died with exit code {proc.exitcode} {doing}; "
            "the process backend was shut down (exit code -9 is often the out-of-memory "
            "killer: use fewer [runtime] workers)"
        )


# ---------------------------------------------------------------------------- the backend
@BACKENDS.register("processes")
class ProcessBackend:
    """Runs a phase's clients in parallel worker processes, each with one intra-op thread;
    results bitwise equal to :class:`~radbo.simulation.SequentialBackend` with one thread (see
    the module docstring).

    Args:
        workers: worker processes (default: :func:`usable_cpus`). With 1, clients run in this
            process, as the sequential backend runs them.
        shared_memory: whether tasks' and results' tensors cross in shared memory (the
            default, where it can be mapped) or, with ``False``, in the pipe with the rest of
            each message (as ``benchmarks/workers.py --wires`` compares). Results are the same.

    Use it as a context manager, or call :meth:`close`, to stop the workers::

        with ProcessBackend(2) as backend:
            sim = Simulation(..., backend=backend)
            ...
    """

    #: why ``[runtime] device = "cuda"`` refuses this backend (:func:`radbo.simulation.gpu_refusal`)
    gpu_refusal: ClassVar[str] = "forked worker processes cannot share a GPU context"

    def __init__(self, workers: int | None = None, *, shared_memory: bool = True) -> None:
        if workers is None:
            workers = usable_cpus()
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"ProcessBackend.workers must be an integer >= 1, got {workers!r}")
        if workers > 1 and "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError(
                "ProcessBackend needs the 'fork' start method, which this platform lacks; "
                "use [runtime] backend = 'sequential' or workers = 1"
            )
        self.workers = workers
        self.shared_memory = bool(shared_memory)
        self._catalog: Catalog = []
        self._pool: _Pool | None = None

    @classmethod
    def from_runtime(cls, runtime: Any) -> ProcessBackend:
        """``runtime.workers`` worker processes (``None``: :func:`usable_cpus`)."""
        return cls(runtime.workers)

    def __repr__(self) -> str:
        return f"ProcessBackend(workers={self.workers})"

    @property
    def server_threads(self) -> int:
        """Intra-op threads the server's aggregation may use (:class:`~radbo.simulation.
        backends.ParallelBackend`): the workers' CPUs, idle while the server works (no more
        than :func:`usable_cpus`)."""
        return max(1, min(self.workers, usable_cpus()))

    @property
    def running(self) -> bool:
        """Whether worker processes are up."""
        return self._pool is not None

    def pids(self) -> list[int]:
        """Process ids of the running workers (empty when none are up)."""
        if self._pool is None:
            return []
        return [p.pid for p in self._pool.processes if p.pid is not None]

    def run(
        self,
        work: Work,
        runtime: ClientRuntime,
        meter: FlopMeter | None,
        tasks: Sequence[ClientTask],
    ) -> list[ClientResult]:
        if self.workers == 1 or not tasks:
            return [run_measured(work, runtime, meter, task) for task in tasks]
        entry = self._entry(work, runtime)
        if self._pool is None:
            slot_bytes = _SLOT_BYTES if self.shared_memory else 0
            self._pool = _Pool(self.workers, list(self._catalog), slot_bytes)
        try:
            results = self._pool.run(entry, tasks)
        except BaseException:
            self._shutdown(grace_s=0.0)  # tasks may be in flight: do not wait for them
            raise
        return [
            run_measured(work, runtime, meter, task, result)
            for task, result in zip(tasks, results, strict=True)
        ]

    def _entry(self, work: Work, runtime: ClientRuntime) -> int:
        """The catalog number of ``(work, runtime)``. A new pair is sent to the running workers
        when they can take it (:meth:`_Pool.teach`); otherwise the pool is stopped, so that the
        next one is forked with it."""
        for i, (known, where) in enumerate(self._catalog):
            if where is runtime and known == work:
                return i
        self._catalog.append((work, runtime))
        entry = len(self._catalog) - 1
        if self._pool is not None and not self._pool.teach(entry, work, runtime):
            self._shutdown(grace_s=_GRACE_S)
        return entry

    def _shutdown(self, grace_s: float) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(grace_s)

    def close(self) -> None:
        """Stop the workers (idempotent; a later :meth:`run` starts a fresh pool)."""
        self._shutdown(grace_s=_GRACE_S)
        self._catalog.clear()

    def __enter__(self) -> ProcessBackend:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
