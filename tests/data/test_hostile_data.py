"""Hostile data files, fleet files and traces (issue 28, items 2 and 8): every read is bounded.

What is checked, for every reader radbo has (MNIST IDX plain and ``.gz``, CIFAR-10 batches,
Omniglot PNG folders, LIBSVM text plain / ``.gz`` / ``.bz2``, fleet files, traces, behaviour
traces):

* a special file (FIFO, character device, directory, socket) is refused by name before it is
  opened: opening a FIFO for reading blocks until a writer comes, forever;
* a size a header declares is checked against the file's size before the data is read (a
  sparse 30 GiB file costs a stat), a gzip file is decompressed only as far as its header
  declares plus one byte, never to the gigabytes a bomb expands to;
* what a parser raises on its own (scikit-learn's ``OverflowError`` for a LIBSVM feature index
  of 1e12, an int64 product of IDX dimensions that wraps) and what it silently changes (the
  LIBSVM label 9223372036854775807 read as -2**63) is one line naming the file and the line.

Through ``radbo run CONFIG`` (:func:`radbo.cli.main`) each case is one exact line on stderr and
exit code 2. Cases where a regression would block or take all memory run in a
:class:`Sandbox`: a worker process, started once per test module with torch imported, forks
one child per case under an address-space limit; the child reports its peak RSS (checked
below 1 GiB), and a child that does not answer within the case's timeout is killed (a hang
is a failure, not a stuck test run). Sparse files (``truncate``) cost no disk.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
import socket
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from radbo.data import readers
from radbo.data.readers import (
    CIFAR10_RECORD_BYTES,
    open_regular_file,
    read_at_most,
    read_idx,
    read_libsvm,
    read_omniglot,
    regular_file_size,
    write_idx,
)
from radbo.devices import Fleet
from radbo.devices import fleet as fleet_module
from radbo.devices.profile import ProfileError
from radbo.limits import caps_lifted
from tests.helpers import time_limit
from tests.test_hostile_inputs import _drop_devices, tiny, toml

pytestmark = pytest.mark.skipif(
    not (hasattr(os, "fork") and hasattr(os, "mkfifo")), reason="needs fork and FIFOs (POSIX)"
)

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
#: The end every refusal of a special file has.
SPECIAL = (
    "not a regular file; radbo reads data only from regular files (reading a FIFO or a device "
    "can block forever or never end)."
)
FORMAT = "expected '<label> <index>:<value> ...' lines with 1-based, increasing indices."


# ------------------------------------------------------------------------------- sandbox
#: The worker: reads one JSON request a line on stdin, forks a child per request (torch and
#: radbo already imported, so a case costs a fork, not an interpreter), limits the child's
#: address space, and answers one JSON line: the child's result and its peak RSS, or
#: ``timeout`` (the child was killed) or ``died`` (it ended without answering).
WORKER = r"""
import contextlib, hashlib, importlib, io, json, os, resource, select, signal, sys, time
import traceback

import numpy as np

import PIL.Image  # noqa: F401 - what a run imports, imported once before forking
import PIL.PngImagePlugin  # noqa: F401
import sklearn.datasets  # noqa: F401

import radbo.cli
import radbo.config  # noqa: F401
import radbo.experiment  # noqa: F401
import radbo.experiment.build  # noqa: F401


def address_space() -> int:  # this process's virtual size (Linux); 0 without /proc
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def summary(value):
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value).tobytes()
        return {"shape": list(value.shape), "dtype": str(value.dtype),
                "sha256": hashlib.sha256(data).hexdigest()}
    if hasattr(value, "features") and hasattr(value, "labels"):  # a Dataset
        return {"name": value.name, "classes": value.num_classes,
                "features": summary(value.features.numpy()),
                "labels": summary(value.labels.numpy())}
    if hasattr(value, "profiles"):  # a Fleet
        return [p.model_dump(mode="json") for p in value.profiles]
    if isinstance(value, (tuple, list)):
        return [summary(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def run(request):
    if request["op"] == "cli":
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = radbo.cli.main(request["argv"])
        return {"code": code, "out": out.getvalue(), "err": err.getvalue()}
    module, _, name = request["function"].partition(":")
    function = importlib.import_module(module)
    for part in name.split("."):
        function = getattr(function, part)
    try:
        value = function(*request["args"], **request["kwargs"])
    except Exception as error:  # the test decides which types are allowed
        kind = type(error)
        return {"raised": f"{kind.__module__}.{kind.__qualname__}", "message": str(error),
                "traceback": "".join(traceback.format_exception(error))}
    return {"value": summary(value)}


def child(request, fd):
    size = address_space()
    if size:  # torch already takes most of a GiB of address space: the limit is on top
        limit = size + request["memory"]
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        result = run(request)
    except BaseException as error:
        result = {"crashed": "".join(traceback.format_exception(error))}
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes there, KiB on Linux
    result["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    data = json.dumps(result).encode()
    while data:
        data = data[os.write(fd, data):]
    os._exit(0)


for line in sys.stdin:
    request = json.loads(line)
    start = time.monotonic()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child(request, w)
    os.close(w)
    chunks, timed_out = [], False
    deadline = start + request["timeout"]
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        data = os.read(r, 1 << 16)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        result = {"timeout": request["timeout"]}
    elif not chunks:
        result = {"died": status}
    else:
        result = json.loads(b"".join(chunks))
    result["wall_s"] = time.monotonic() - start
    print(json.dumps(result), flush=True)
"""


class Sandbox:
    """Runs cases in forked children of one worker process (see :data:`WORKER`), each with at
    most ``memory`` bytes of address space beyond what the worker holds and ``timeout``
    seconds; :meth:`bounded` checks a result: answered in time, no crash, peak RSS < 1 GiB."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            text=True,
        )

    def request(self, request: dict[str, Any], timeout: float, memory: int) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({**request, "timeout": timeout, "memory": memory}))
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()  # the worker keeps the timeout itself
        assert line, "the sandbox worker ended"
        return json.loads(line)

    def cli(self, argv: list[str], *, timeout: float = 60, memory: int = GiB) -> dict[str, Any]:
        """``radbo.cli.main(argv)`` in a child: ``code``, ``out``, ``err``."""
        return self.bounded(self.request({"op": "cli", "argv": argv}, timeout, memory))

    def call(
        self,
        function: str,
        *args: Any,
        timeout: float = 60,
        memory: int = GiB,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``module:function(*args, **kwargs)`` in a child: ``value`` (a summary: arrays as
        shape, dtype and SHA-256) or ``raised`` (the exception's type) and ``message``."""
        request = {"op": "call", "function": function, "args": args, "kwargs": kwargs}
        return self.bounded(self.request(request, timeout, memory))

    @staticmethod
    def bounded(result: dict[str, Any]) -> dict[str, Any]:
        assert "timeout" not in result, (
            f"no answer within {result['timeout']} s: the read blocks or never ends"
        )
        assert "died" not in result, f"the case's process died (wait status {result['died']})"
        assert "crashed" not in result, result["crashed"]
        assert result["maxrss_bytes"] < GiB, (
            f"peak RSS {result['maxrss_bytes'] / 2**20:.0f} MiB, more than 1 GiB"
        )
        return result

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    box = Sandbox()
    yield box
    box.close()


# ------------------------------------------------------------------------- valid files
def write_mnist(root: Path, *, gz: bool = False, train: int = 6, test: int = 3) -> Path:
    """The four MNIST IDX files of ``train`` and ``test`` random 28x28 images in ``root``."""
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte{suffix}", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{suffix}", np.arange(n, dtype=np.uint8) % 10)
    return root


CIFAR_BATCHES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def write_cifar(root: Path, records: int = 2) -> Path:
    """The six CIFAR-10 binary batches of ``records`` random records each in ``root``."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for name in CIFAR_BATCHES:
        data = rng.integers(0, 256, size=(records, CIFAR10_RECORD_BYTES), dtype=np.uint8)
        data[:, 0] = np.arange(records) % 10
        (root / name).write_bytes(data.tobytes())
    return root


def png(size: tuple[int, int] = (10, 10), shade: int = 200) -> bytes:
    """A small grayscale PNG."""
    from io import BytesIO

    from PIL import Image

    out = BytesIO()
    Image.new("L", size, shade).save(out, format="PNG")
    return out.getvalue()


def write_omniglot(root: Path) -> Path:
    """``images_background`` and ``images_evaluation``, each with 2 characters of 2 PNGs."""
    for split in ("images_background", "images_evaluation"):
        for c, character in enumerate(("char1", "char2")):
            folder = root / split / "alpha" / character
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(2):
                (folder / f"{i}.png").write_bytes(png(shade=60 * c + 20 * i))
    return root


def fifo(path: Path) -> Path:
    """``path`` replaced by a FIFO (named pipe): opening it for reading blocks forever."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def sparse(path: Path, size: int = 30 * GiB, head: bytes = b"") -> Path:
    """``path`` of ``size`` bytes, ``head`` then a hole: sparse, it takes no disk."""
    with path.open("wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def gzip_bomb(path: Path, head: bytes, zeros: int, member: int = 16 << 20) -> Path:
    """``head`` then ``zeros`` zero bytes as gzip: one member compressed once and repeated
    (gzip files may hold several), so gigabytes cost a few MB and milliseconds to write."""
    block = gzip.compress(b"\0" * member, compresslevel=9, mtime=0)
    with path.open("wb") as f:
        f.write(gzip.compress(head, mtime=0))
        for _ in range(zeros // member):
            f.write(block)
    return path


def idx_header(magic: int, *dims: int) -> bytes:
    return struct.pack(f">I{len(dims)}I", magic, *dims)


# ----------------------------------------------------------------- configs for radbo run
def with_data(tmp: Path, section: dict[str, Any]) -> dict[str, Any]:
    data = tiny()
    data["data"] = section
    return data


def with_fleet(tmp: Path, **fleet: Any) -> dict[str, Any]:
    data = tiny()
    _drop_devices(data)
    data["fleet"].update(fleet)
    return data


def trace_section(path: Path, behavior: Path | None = None) -> dict[str, Any]:
    section: dict[str, Any] = {"path": str(path), "flops_per_sample": 1e6, "memory_bytes": GiB}
    if behavior is not None:
        section["behavior"] = str(behavior)
    return section


def valid_trace(path: Path, clients: int = 4) -> Path:
    path.write_text(
        json.dumps({str(i): {"computation": 50.0, "communication": 1000.0} for i in range(clients)})
    )
    return path


# Each case builds its files under tmp and returns (config, expected stderr with {tmp}).
Case = Callable[[Path], tuple[dict[str, Any], str]]
ROOT_ERROR = "config error: data.root = '{tmp}/{name}': "
LIBSVM_ERROR = "config error: data.name = 'libsvm': "


def omniglot_fifo(tmp: Path) -> tuple[dict[str, Any], str]:
    root = write_omniglot(tmp / "omniglot")
    fifo(root / "images_background" / "alpha" / "char1" / "0.png")
    return with_data(tmp, {"name": "omniglot", "root": str(root)}), (
        ROOT_ERROR.format(tmp="{tmp}", name="omniglot")
        + "Omniglot: {tmp}/omniglot/images_background/alpha/char1/0.png is a FIFO (named pipe), "
        + SPECIAL
    )


def mnist_fifo(tmp: Path) -> tuple[dict[str, Any], str]:
    root = write_mnist(tmp / "mnist")
    fifo(root / "train-images-idx3-ubyte")
    return with_data(tmp, {"name": "mnist", "root": str(root)}), (
        ROOT_ERROR.format(tmp="{tmp}", name="mnist")
        + "IDX: {tmp}/mnist/train-images-idx3-ubyte is a FIFO (named pipe), "
        + SPECIAL
    )


def mnist_gzip_bomb(tmp: Path) -> tuple[dict[str, Any], str]:
    # the case: a few MB of gzip whose header claims 10 images, 4.5 GB once expanded
    root = write_mnist(tmp / "mnist", gz=True)
    path = gzip_bomb(
        root / "train-images-idx3-ubyte.gz", idx_header(2051, 10, 28, 28), 4_500_000_000
    )
    return with_data(tmp, {"name": "mnist", "root": str(root)}), (
        ROOT_ERROR.format(tmp="{tmp}", name="mnist")
        + "IDX: {tmp}/mnist/train-images-idx3-ubyte.gz is longer than declared: its header "
        + "declares shape (10, 28, 28) (7840 data bytes) but the gzip file holds "
        + f"{path.stat().st_size} bytes, more than any gzip encoder needs for them; the header "
        + "is corrupt or the file is padded."
    )


def mnist_small_gzip_bomb(tmp: Path) -> tuple[dict[str, Any], str]:
    # under 64 KiB of gzip (a size the header could need): decompressed only to 7841 bytes
    root = write_mnist(tmp / "mnist", gz=True)
    path = gzip_bomb(
        root / "train-images-idx3-ubyte.gz", idx_header(2051, 10, 28, 28), 48 << 20, member=48 << 20
    )
    assert path.stat().st_size < 1 << 16
    return with_data(tmp, {"name": "mnist", "root": str(root)}), (
        ROOT_ERROR.format(tmp="{tmp}", name="mnist")
        + "IDX: {tmp}/mnist/train-images-idx3-ubyte.gz is longer than declared: its header "
        + "declares shape (10, 28, 28) (7840 data bytes) but more than 7840 data bytes follow "
        + "the header."
    )


def mnist_dims_wrap_int64(tmp: Path) -> tuple[dict[str, Any], str]:
    # 2**31 * 2**31 * 4 = 2**64: an int64 product wraps to 0 and matched the empty data
    root = write_mnist(tmp / "mnist")
    (root / "train-images-idx3-ubyte").write_bytes(idx_header(2051, 2**31, 2**31, 4))
    return with_data(tmp, {"name": "mnist", "root": str(root)}), (
        ROOT_ERROR.format(tmp="{tmp}", name="mnist")
        + "IDX: {tmp}/mnist/train-images-idx3-ubyte is truncated: its header declares shape "
        + "(2147483648, 2147483648, 4) (18446744073709551616 data bytes) but 0 data bytes "
        + "follow the header."
    )


def mnist_dims_beyond_int64(tmp: Path) -> tuple[dict[str, Any], str]:
    root = write_mnist(tmp / "mnist", gz=True)
    big = 2**32 - 1
    (root / "train-images-idx3-ubyte.gz").write_bytes(
        gzip.compress(idx_header(2051, big, big, big) + bytes(7840), mtime=0)
    )
    size = (root / "train-images-idx3-ubyte.gz").stat().st_size
    return with_data(tmp, {"name": "mnist", "root": str(root)}), (
        ROOT_ERROR.format(tmp="{tmp}", name="mnist")
        + "IDX: {tmp}/mnist/train-images-idx3-ubyte.gz cannot hold what its header declares: "
        + f"shape ({big}, {big}, {big}) ({big**3} data bytes) from {size} gzip-compressed "
        + "bytes, more than the 1032-fold that deflate expands to at most; the header is corrupt."
    )


def cifar_sparse_30_gib(tmp: Path) -> tuple[dict[str, Any], str]:
    root = write_cifar(tmp / "cifar")
    sparse(root / "data_batch_1.bin")
    return with_data(tmp, {"name": "cifar10", "root": str(root)}), (
        ROOT_ERROR.format(tmp="{tmp}", name="cifar")
        + "CIFAR-10: {tmp}/cifar/data_batch_1.bin holds 32212254720 bytes, not a positive whole "
        + "number of 3073-byte records (1 label byte + 3072 pixel bytes); the file is truncated "
        + "or is not from the binary version (cifar-10-binary.tar.gz)."
    )


def cifar_fifo(tmp: Path) -> tuple[dict[str, Any], str]:
    root = write_cifar(tmp / "cifar")
    fifo(root / "data_batch_3.bin")
    return with_data(tmp, {"name": "cifar10", "root": str(root)}), (
        ROOT_ERROR.format(tmp="{tmp}", name="cifar")
        + "CIFAR-10: {tmp}/cifar/data_batch_3.bin is a FIFO (named pipe), "
        + SPECIAL
    )


def libsvm_case(text: str | None, line: int, problem: str) -> Case:
    def case(tmp: Path) -> tuple[dict[str, Any], str]:
        path = tmp / "data.svm"
        if text is not None:
            path.write_text(text)
        return with_data(tmp, {"name": "libsvm", "path": str(path)}), (
            LIBSVM_ERROR + f"LIBSVM: {{tmp}}/data.svm, line {line}: {problem}; {FORMAT}"
        )

    return case


def libsvm_special(make: Callable[[Path], object], kind: str) -> Case:
    def case(tmp: Path) -> tuple[dict[str, Any], str]:
        path = tmp / "data.svm"
        make(path)
        return with_data(tmp, {"name": "libsvm", "path": str(path)}), (
            LIBSVM_ERROR + f"LIBSVM: {{tmp}}/data.svm is {kind}, " + SPECIAL
        )

    return case


def fleet_file_case(make: Callable[[Path], object], problem: str) -> Case:
    def case(tmp: Path) -> tuple[dict[str, Any], str]:
        path = tmp / "fleet.json"
        make(path)
        return with_fleet(tmp, file=str(path)), (
            "config error: fleet.file: device profile error: fleet file {tmp}/fleet.json " + problem
        )

    return case


def trace_case(make: Callable[[Path], object], problem: str, *, behavior: bool = False) -> Case:
    def case(tmp: Path) -> tuple[dict[str, Any], str]:
        path = tmp / "trace.json"
        if behavior:
            valid_trace(path)
            make(tmp / "behavior.json")
            section = trace_section(path, tmp / "behavior.json")
            what = "behavior trace {tmp}/behavior.json"
        else:
            make(path)
            section = trace_section(path)
            what = "trace {tmp}/trace.json"
        return with_fleet(tmp, trace=section), (
            f"config error: fleet.trace: device profile error: {what} {problem}"
        )

    return case


def dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


CAP = (
    "holds 32212254720 bytes, more than the 268435456 a {what} may hold (about 190,000 device "
    "profiles or 4 million trace clients); radbo run --force lifts this cap"
)
NAMED: list[tuple[str, Case]] = [
    ("omniglot 0.png is a FIFO", omniglot_fifo),
    ("mnist images are a FIFO", mnist_fifo),
    ("mnist gzip bomb claiming 10 images", mnist_gzip_bomb),
    ("mnist gzip bomb under 64 KiB", mnist_small_gzip_bomb),
    ("mnist dimensions whose int64 product wraps", mnist_dims_wrap_int64),
    ("mnist dimensions beyond int64, gzip", mnist_dims_beyond_int64),
    ("cifar batch sparse 30 GiB", cifar_sparse_30_gib),
    ("cifar batch is a FIFO", cifar_fifo),
    (
        "libsvm feature index 1e12",
        libsvm_case(
            "1 1:0.5\n-1 1000000000000:1\n",
            2,
            "index 1000000000000 is above 2147483647, the largest feature index",
        ),
    ),
    (
        "libsvm label 2**63 - 1",
        libsvm_case(
            "1 1:0.5\n9223372036854775807 2:1\n-1 1:1\n",
            2,
            "label '9223372036854775807' is outside (-2**53, 2**53), where labels read as "
            "float64 are exact integers",
        ),
    ),
    (
        "libsvm label 2**53 + 1 (rounds to 2**53)",
        libsvm_case(
            "1 1:0.5\n-1 2:1\n9007199254740993 1:1\n",
            3,
            "label '9007199254740993' is outside (-2**53, 2**53), where labels read as float64 "
            "are exact integers",
        ),
    ),
    ("libsvm path is a FIFO", libsvm_special(fifo, "a FIFO (named pipe)")),
    ("libsvm path is a directory", libsvm_special(lambda p: p.mkdir(), "a directory")),
    ("libsvm path is /dev/zero", libsvm_special(dev_zero, "a character device")),
    ("fleet file is a FIFO", fleet_file_case(fifo, "is a FIFO (named pipe), " + SPECIAL)),
    ("fleet file is /dev/zero", fleet_file_case(dev_zero, "is a character device, " + SPECIAL)),
    ("fleet file sparse 30 GiB", fleet_file_case(sparse, CAP.format(what="fleet file"))),
    ("trace is a FIFO", trace_case(fifo, "is a FIFO (named pipe), " + SPECIAL)),
    ("trace sparse 30 GiB", trace_case(sparse, CAP.format(what="trace"))),
    (
        "behavior trace is a FIFO",
        trace_case(fifo, "is a FIFO (named pipe), " + SPECIAL, behavior=True),
    ),
    (
        "behavior trace sparse 30 GiB",
        trace_case(sparse, CAP.format(what="behavior trace"), behavior=True),
    ),
]


def radbo_run(sandbox: Sandbox, tmp: Path, config: dict[str, Any]) -> dict[str, Any]:
    path = tmp / "run.toml"
    path.write_text(toml(config))
    return sandbox.cli(["run", str(path), "--quiet", "--output-dir", str(tmp / "out")])


@pytest.mark.parametrize("case", [c[1] for c in NAMED], ids=[c[0] for c in NAMED])
def test_named_case_is_one_line_and_exit_code_2(sandbox: Sandbox, tmp_path: Path, case: Case):
    config, expected = case(tmp_path)

    result = radbo_run(sandbox, tmp_path, config)

    assert (result["code"], result["err"]) == (2, expected.format(tmp=tmp_path) + "\n")
    assert result["wall_s"] < 30


def test_the_sandbox_reports_a_hang_and_bounds_memory(sandbox: Sandbox, tmp_path: Path):
    # what a regression would look like: a read that blocks, an allocation past the limit
    path = fifo(tmp_path / "pipe")

    request = {"op": "call", "function": "os:open", "args": [str(path), os.O_RDONLY]}
    hang = sandbox.request({**request, "kwargs": {}}, timeout=2, memory=GiB)
    grab = sandbox.call("builtins:bytearray", 2 * GiB)

    assert hang["timeout"] == 2 and hang["wall_s"] < 10
    assert (grab["raised"], grab["message"]) == ("builtins.MemoryError", "")


# ------------------------------------------------------------------ the shared helpers
def test_special_files_are_refused_before_opening(tmp_path: Path):
    pipe = fifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    (tmp_path / "to-pipe").symlink_to(pipe)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "regular").write_bytes(b"12345")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(tmp_path / "sock"))
        kinds = {
            "pipe": "a FIFO (named pipe)",
            "to-pipe": "a FIFO (named pipe)",  # links are followed
            "folder": "a directory",
            "sock": "a socket",
        }
        for name, kind in kinds.items():
            with pytest.raises(ValueError) as err:
                regular_file_size(tmp_path / name, "IDX:")
            assert str(err.value) == f"IDX: {tmp_path / name} is {kind}, " + SPECIAL
    finally:
        server.close()
    with pytest.raises(ValueError) as err:
        regular_file_size("/dev/null", "trace")
    assert str(err.value) == "trace /dev/null is a character device, " + SPECIAL
    with pytest.raises(FileNotFoundError) as missing:
        regular_file_size(tmp_path / "dangling", "IDX:")
    assert str(missing.value) == f"IDX: {tmp_path / 'dangling'} does not exist."
    with pytest.raises(ValueError) as nul:
        regular_file_size("a\0b", "IDX:")
    assert str(nul.value) == "IDX: 'a\\x00b' cannot be read (embedded null byte)."
    assert regular_file_size(tmp_path / "regular", "IDX:") == 5


def test_a_fifo_put_in_place_after_the_check_is_refused_without_blocking(tmp_path, monkeypatch):
    # the check before opening passed (a regular file then); the open must not block and
    # the open descriptor is checked again
    pipe = fifo(tmp_path / "pipe")
    monkeypatch.setattr(readers, "regular_file_size", lambda path, what: 0)
    with time_limit(10), pytest.raises(ValueError) as err:
        open_regular_file(pipe, "CIFAR-10:")

    assert str(err.value) == f"CIFAR-10: {pipe} is a FIFO (named pipe), " + SPECIAL


class _Recording:
    """A stream of ``size`` zero bytes that records the sizes it is asked for."""

    def __init__(self, size: int) -> None:
        self.left, self.asked = size, []

    def read(self, n: int) -> bytes:
        self.asked.append(n)
        n = min(n, self.left)
        self.left -= n
        return bytes(n)


def test_read_at_most_never_asks_for_what_a_header_declares():
    stream = _Recording(3 << 20)

    data = read_at_most(stream, 2**96)  # type: ignore[arg-type]

    assert len(data) == 3 << 20
    assert stream.asked == [1 << 20] * 4  # the last read finds the end


# ------------------------------------------------------------------------------ gzip
def test_gzip_members_and_padding_read_as_gzip_reads_them(tmp_path: Path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    whole = write_idx(tmp_path / "plain.idx", array).read_bytes()
    cut = 7
    members = gzip.compress(whole[:cut], mtime=0) + gzip.compress(whole[cut:], mtime=0)
    padded = gzip.compress(whole, mtime=0) + bytes(5000)
    for name, content in (("members.idx.gz", members), ("padded.idx.gz", padded)):
        assert gzip.decompress(content) == whole  # gzip's own reading
        (tmp_path / name).write_bytes(content)

        assert np.array_equal(read_idx(tmp_path / name), array)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda g: g + b"garbage!", "Error -3 while decompressing data: incorrect header check"),
        (lambda g: bytes(3) + g, "Error -3 while decompressing data: incorrect header check"),
        (
            lambda g: g[:-8] + bytes([g[-8] ^ 1]) + g[-7:],
            "Error -3 while decompressing data: incorrect data check",
        ),
        (lambda g: g[:-4], "the file ends inside a gzip member (truncated)"),
    ],
    ids=["trailing garbage", "leading zeros", "CRC flipped", "truncated trailer"],
)
def test_damaged_gzip_is_one_line(tmp_path: Path, damage, reason):
    good = gzip.compress(idx_header(2049, 3) + bytes([1, 2, 3]), mtime=0)
    path = tmp_path / "labels.gz"
    path.write_bytes(damage(good))

    with pytest.raises(ValueError) as err:
        read_idx(path)

    assert str(err.value) == (
        f"IDX: {path} could not be read as a gzip file ({reason}); expected a complete "
        "gzip-compressed file, re-download or decompress it."
    )


def test_gzip_padded_with_gigabytes_of_zeros_is_refused_in_seconds(
    sandbox: Sandbox, tmp_path: Path
):
    # gzip allows zero padding after a member, and gzip.GzipFile skips it a byte at a time:
    # a sparse hole of 1 GiB kept it busy for an hour. radbo's reader allows 1 MiB of it.
    # LIBSVM text has no declared size, nor has an IDX file before its header is read
    text = "1 1:0.5 3:2\n-1 2:1\n"
    path = tmp_path / "padded.svm.gz"
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    with path.open("ab") as f:
        f.truncate(path.stat().st_size + GiB)
    empty = tmp_path / "train-labels-idx1-ubyte.gz"
    empty.write_bytes(gzip.compress(b"", mtime=0))
    with empty.open("ab") as f:
        f.truncate(30 * GiB)
    fine = tmp_path / "fine.svm.gz"
    fine.write_bytes(gzip.compress(text.encode(), mtime=0) + bytes(1 << 20))

    padded = sandbox.call("radbo.data.readers:read_libsvm", str(path), timeout=30)
    idx = sandbox.call("radbo.data.readers:read_idx", str(empty), timeout=30)
    accepted = sandbox.call("radbo.data.readers:read_libsvm", str(fine))

    assert (padded["raised"], padded["message"]) == (
        "builtins.ValueError",
        f"LIBSVM: {path} could not be read (more than 1048576 zero bytes of padding after a "
        "gzip member); expected a complete file, compressed by its suffix (.gz, .bz2) or plain "
        "text.",
    )
    assert (idx["raised"], idx["message"]) == (
        "builtins.ValueError",
        f"IDX: {empty} could not be read as a gzip file (more than 1048576 zero bytes of "
        "padding after a gzip member); expected a complete gzip-compressed file, re-download "
        "or decompress it.",
    )
    assert padded["wall_s"] < 10 and idx["wall_s"] < 10
    assert accepted["value"][0]["shape"] == [2, 3]


# -------------------------------------------------------------------- sizes and memory
def test_sizes_beyond_memory_are_refused_from_the_file_size(sandbox: Sandbox, tmp_path: Path):
    import psutil

    memory = psutil.virtual_memory().total
    records = memory // CIFAR10_RECORD_BYTES + 1  # a whole number of records, beyond memory
    batch = sparse(tmp_path / "data_batch_1.bin", records * CIFAR10_RECORD_BYTES)
    images = memory // 2**20 + 1  # 1024 x 1024 images, one MiB each
    idx = sparse(tmp_path / "images.idx", 16 + images * 2**20, idx_header(2051, images, 1024, 1024))

    cifar = sandbox.call("radbo.data.readers:read_cifar10_batch", str(batch))
    mnist = sandbox.call("radbo.data.readers:read_idx", str(idx))

    size = records * CIFAR10_RECORD_BYTES
    assert (cifar["raised"], cifar["message"]) == (
        "builtins.ValueError",
        f"CIFAR-10: {batch} holds {size / 1e9:.3g} GB, more than this machine's "
        f"{memory / 1e9:.3g} GB of memory; a CIFAR-10 batch holds 30.7 MB.",
    )
    assert (mnist["raised"], mnist["message"]) == (
        "builtins.ValueError",
        f"IDX: {idx}: its header declares shape ({images}, 1024, 1024), "
        f"{images * 2**20 / 1e9:.3g} GB of data, more than this machine's {memory / 1e9:.3g} GB "
        "of memory.",
    )


def test_libsvm_text_is_capped_at_an_eighth_of_memory(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(readers, "_memory_bytes", lambda: 8 << 20)  # 1 MiB of text
    text = ("1 1:0.5 2:0.25\n-1 3:1\n" * 60_000).encode()  # 1.3 MB
    plain = tmp_path / "big.svm"
    plain.write_bytes(text)
    packed = tmp_path / "big.svm.gz"
    packed.write_bytes(gzip.compress(text, mtime=0))
    squeezed = tmp_path / "big.svm.bz2"
    squeezed.write_bytes(bz2.compress(text))
    cap = (
        "more than the 1048576 bytes of text this machine's 0.00839 GB of memory can parse "
        "(the parser keeps up to 8 bytes per byte of text)."
    )

    for path, expected in (
        (plain, f"LIBSVM: {plain} holds {len(text)} bytes, {cap}"),
        (packed, f"LIBSVM: {packed} decompresses to {cap}"),
        (squeezed, f"LIBSVM: {squeezed} decompresses to {cap}"),
    ):
        with pytest.raises(ValueError) as err:
            read_libsvm(path)
        assert str(err.value) == expected
    monkeypatch.setattr(readers, "_memory_bytes", lambda: 16 << 20)
    features, labels = read_libsvm(packed)
    assert features.shape == (120_000, 3) and labels.tolist()[:2] == [1, -1]


def test_libsvm_parser_errors_name_the_line(tmp_path: Path):
    cases = {
        "1 1:1\n-1 2147483648:1\n": (
            2,
            "index 2147483648 is above 2147483647, the largest feature index",
        ),
        "1 1:1\n-9007199254740992 2:1\n": (
            2,
            "label '-9007199254740992' is outside (-2**53, 2**53), where labels read as "
            "float64 are exact integers",
        ),
        "1 1:1\n1e300 2:1\n": (
            2,
            "label '1e300' is outside (-2**53, 2**53), where labels read as float64 are exact "
            "integers",
        ),
    }
    for text, (line, problem) in cases.items():
        path = tmp_path / "bad.svm"
        path.write_text(text)
        with pytest.raises(ValueError) as err:
            read_libsvm(path)
        assert str(err.value) == f"LIBSVM: {path}, line {line}: {problem}; {FORMAT}"
    path.write_text("1 1:1\n-1 2147483647:1\n-9007199254740991 1:1\n")  # the largest allowed
    with pytest.raises(ValueError, match=r"2147483647 features as dense float64 would take"):
        read_libsvm(path)
    path.write_text("1 1:1\n-9007199254740991 2:1\n")
    features, labels = read_libsvm(path)
    assert labels.tolist() == [1, -9007199254740991]


# ------------------------------------------------------------------------------ MNIST
def test_mnist_without_images_or_pixels_is_refused(tmp_path: Path):
    for name, dims in (("empty", (0, 28, 28)), ("no rows", (4, 0, 28)), ("no columns", (4, 28, 0))):
        root = write_mnist(tmp_path / name.replace(" ", "-"))
        images = np.zeros(dims, dtype=np.uint8)
        (root / "train-images-idx3-ubyte").write_bytes(idx_header(2051, *dims) + images.tobytes())
        with pytest.raises(ValueError) as err:
            readers.read_mnist(root)
        assert str(err.value) == (
            f"MNIST: {root / 'train-images-idx3-ubyte'} holds {dims[0]} images of "
            f"{dims[1]}x{dims[2]} pixels; expected at least one image of at least 1x1 pixels."
        )


def test_mnist_splits_of_different_shapes_are_one_line(tmp_path: Path):
    from radbo.config import parse_config
    from radbo.experiment.build import load_data
    from radbo.registry import ConfigError

    root = write_mnist(tmp_path / "mnist")
    write_idx(root / "t10k-images-idx3-ubyte", np.zeros((3, 14, 14), dtype=np.uint8))

    with pytest.raises(ConfigError) as err:
        load_data(parse_config({"data": {"name": "mnist", "root": str(root)}}))

    assert str(err.value) == (
        f"config error: data.root = '{root}': mnist/train holds examples of shape (784,) but "
        "mnist/test of shape (196,); expected the same shape in both splits"
    )


def test_a_folder_named_like_an_mnist_file_is_passed_over(tmp_path: Path):
    # some archives unpack train-images-idx3-ubyte/ as a folder; torchvision's layout is used
    root = tmp_path / "root"
    write_mnist(root / "MNIST" / "raw")
    (root / "train-images-idx3-ubyte").mkdir()

    images, labels = readers.read_mnist(root)

    assert images.shape == (6, 28, 28) and labels.tolist() == [0, 1, 2, 3, 4, 5]


# --------------------------------------------------------------------------- Omniglot
def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` gray pixels and holds none."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def test_omniglot_images_are_bounded_before_decoding(tmp_path: Path):
    root = write_omniglot(tmp_path / "omniglot") / "images_background"
    glyph = root / "alpha" / "char1" / "0.png"
    # 5000 x 5000: below Pillow's own bomb limit (2 x 89 million pixels), decoded whole
    glyph.write_bytes(_png_header(5000, 5000))
    with pytest.raises(ValueError) as err:
        read_omniglot(root)
    assert str(err.value) == (
        f"Omniglot: {glyph} declares 5000x5000 pixels, more than the 16777216 (4096x4096) "
        "radbo decodes; Omniglot's glyphs are 105x105."
    )
    sparse(glyph, 200 << 20, png())
    with pytest.raises(ValueError) as err:
        read_omniglot(root)
    assert str(err.value) == (
        f"Omniglot: {glyph} holds 209715200 bytes, more than the 134217728 an image may take "
        "(Omniglot's PNGs take about 1 kB each)."
    )
    glyph.unlink()
    glyph.mkdir()
    with pytest.raises(ValueError) as err:
        read_omniglot(root)
    assert str(err.value) == f"Omniglot: {glyph} is a directory, " + SPECIAL


@pytest.mark.parametrize(
    ("offset", "reason"),
    [(37, "not an image format Pillow knows"), (45, "broken data stream when reading image file")],
    ids=["IDAT chunk type", "IDAT data"],
)
def test_a_broken_png_chunk_is_one_line(tmp_path: Path, offset: int, reason: str):
    root = write_omniglot(tmp_path / "omniglot") / "images_background"
    glyph = root / "alpha" / "char1" / "0.png"
    good = png()
    assert good[37:41] == b"IDAT"
    glyph.write_bytes(good[:offset] + bytes([good[offset] ^ 0xFF]) + good[offset + 1 :])

    with pytest.raises(ValueError) as err:
        read_omniglot(root)

    assert str(err.value) == f"Omniglot: {glyph} could not be decoded as a PNG image ({reason})."


# ------------------------------------------------------------------ fleet files, traces
def test_the_fleet_file_cap_is_lifted_by_force(tmp_path: Path, monkeypatch):
    path = tmp_path / "fleet.toml"
    Fleet.from_tiers({"phone_low": 1.0}, 2, seed=0).to_file(path)
    size = path.stat().st_size
    monkeypatch.setattr(fleet_module, "MAX_TABLE_FILE_BYTES", 100)

    with pytest.raises(ProfileError) as err:
        Fleet.from_file(path)
    with caps_lifted():
        fleet = Fleet.from_file(path)

    assert str(err.value) == (
        f"device profile error: fleet file {path} holds {size} bytes, more than the 100 a "
        "fleet file may hold (about 190,000 device profiles or 4 million trace clients); "
        "radbo run --force lifts this cap"
    )
    assert fleet == Fleet.from_tiers({"phone_low": 1.0}, 2, seed=0)


def test_fleet_files_with_crlf_newlines_read_as_before(tmp_path: Path):
    # the bytes are decoded and newlines translated as Path.read_text did
    path = tmp_path / "fleet.toml"
    fleet = Fleet.from_tiers({"phone_low": 1.0, "laptop_cpu": 1.0}, 3, seed=1)
    fleet.to_file(path)
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))

    assert Fleet.from_file(path) == fleet
