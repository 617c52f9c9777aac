"""Readers for the on-disk formats of the public data sets radbo can load.

Every reader works on files the user already has in a local directory (radbo never
downloads anything), parses them with :func:`numpy.frombuffer` (never ``pickle``)
and validates what it reads: magic numbers, declared sizes against file sizes,
whole records, label ranges. Problems raise :class:`FileNotFoundError` or
:class:`ValueError` with a sentence naming the file and what was expected.

Every read is bounded: only regular files are opened (:func:`open_regular_file`: a FIFO,
device, directory or socket is refused before it is opened); a declared size is checked
against the file's size before the data is read; compressed files are decompressed as they
are read, never beyond what the header declares plus one byte (IDX) or a share of this
machine's memory (LIBSVM); nothing is allocated before its bytes arrive
(:func:`read_at_most`).

The readers return raw ``uint8`` arrays; scaling to ``[0, 1]`` and conversion to
tensors happen in :mod:`radbo.data.datasets`.

Formats
-------
* MNIST IDX (LeCun et al., http://yann.lecun.com/exdb/mnist/): a big-endian header
  ``0x00 0x00 <type code> <ndim>`` followed by ``ndim`` big-endian ``uint32`` sizes
  and the data. Images have magic number 2051 (``0x00000803``: unsigned bytes,
  3 dimensions), labels 2049 (``0x00000801``: unsigned bytes, 1 dimension).
* CIFAR-10 binary version (``cifar-10-binary.tar.gz``, Krizhevsky 2009): records of
  1 label byte followed by 3072 pixel bytes (1024 red, 1024 green, 1024 blue, each
  a 32x32 image in row-major order), i.e. channel-first ``(3, 32, 32)``.
* Omniglot PNG folders (Lake et al. 2015, ``images_background`` /
  ``images_evaluation``): ``root/<alphabet>/<character>/*.png``.
* LIBSVM / SVMlight sparse text (Chang & Lin, LIBSVM, ``libsvmtools/datasets``): one example
  a line, ``<label> <index>:<value> <index>:<value> ...`` with 1-based, strictly increasing
  indices; absent indices are 0, ``#`` starts a comment, blank lines are skipped. Unlike the
  image readers, :func:`read_libsvm` returns ``float64`` features and the labels as written.

:func:`write_idx` writes the IDX format back (used by
:func:`radbo.data.sources.write_digits_as_mnist`).
"""

from __future__ import annotations

import bz2
import gzip
import io
import math
import os
import stat
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from radbo.atomic import atomic_write_bytes

__all__ = [
    "IDX_IMAGES_MAGIC",
    "IDX_LABELS_MAGIC",
    "CIFAR10_RECORD_BYTES",
    "read_idx",
    "read_libsvm",
    "read_mnist",
    "read_cifar10_batch",
    "read_cifar10",
    "read_omniglot",
    "open_regular_file",
    "read_at_most",
    "regular_file_size",
    "write_idx",
]

#: Magic number of an IDX file of unsigned-byte 3-D arrays (MNIST images).
IDX_IMAGES_MAGIC = 2051
#: Magic number of an IDX file of unsigned-byte 1-D arrays (MNIST labels).
IDX_LABELS_MAGIC = 2049
#: Bytes in one CIFAR-10 binary record: 1 label byte + 3 * 32 * 32 pixel bytes.
CIFAR10_RECORD_BYTES = 1 + 3 * 32 * 32

# IDX type codes (third header byte) -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, str] = {
    0x08: "u1",
    0x09: "i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}

_MNIST_SOURCE = "the IDX files from yann.lecun.com/exdb/mnist"

#: Bytes read at a time: a declared size is never allocated before the bytes arrive.
_CHUNK = 1 << 20
#: The most bytes deflate (gzip's compression) can expand one compressed byte to: a block
#: of repeated 258-byte matches codes 258 bytes in about 2 bits (zlib's technical notes).
_DEFLATE_MAX_RATIO = 1032
#: Slack of a gzip file over its stored content: header, file name, comment, trailer. A
#: gzip file of ``n`` content bytes takes at most ``n + n // 8`` bytes besides (an encoder
#: that codes every byte as a 9-bit literal; zlib's stored blocks add 5 bytes per 64 KiB).
_GZIP_SLACK_BYTES = 1 << 16
#: The most zero bytes of padding after a gzip member: padding fills a tape block (512 bytes
#: to tens of KB); more is a damaged file, or a sparse hole of gigabytes.
_GZIP_MAX_PADDING = 1 << 20
#: Bytes of parser state per byte of LIBSVM text, at most: ``"1:1 "`` (4 bytes) becomes a
#: float64 value and an int64 index (16 bytes), in arrays that grow by doubling.
_LIBSVM_BYTES_PER_TEXT_BYTE = 8
#: The largest LIBSVM feature index: scikit-learn's parser holds indices in a C ``int``.
_LIBSVM_MAX_INDEX = 2**31 - 1
#: LIBSVM labels lie strictly below this magnitude: labels are parsed as float64, whose
#: integers are exact below 2**53 (beyond, ``9223372036854775807`` becomes another number,
#: and -2**63 once cast to int64).
_LIBSVM_MAX_LABEL = 2**53
#: The largest Omniglot image radbo decodes, in pixels (4096 x 4096; Omniglot's glyphs are
#: 105 x 105): Pillow refuses only images above 2 x 89 million pixels, which decode to GBs.
_OMNIGLOT_MAX_PIXELS = 4096 * 4096
#: The largest Omniglot PNG file, bytes: more than 4096 x 4096 RGBA pixels stored raw.
_OMNIGLOT_MAX_FILE_BYTES = 128 << 20

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _special_file(path: Path, mode: int, what: str) -> ValueError:
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    return ValueError(
        f"{what} {path} is {kind}, not a regular file; radbo reads data only from regular "
        "files (reading a FIFO or a device can block forever or never end)."
    )


def regular_file_size(path: str | os.PathLike[str], what: str) -> int:
    """The size in bytes of ``path``, which must be a regular file (symbolic links followed).

    Checked with :func:`os.stat` before the file is opened, because opening is already the
    danger: opening a FIFO for reading blocks until a writer comes (forever), a character
    device such as ``/dev/zero`` never ends, a directory or socket cannot be read as data.
    The size lets readers check what a header declares before reading anything.

    Args:
        path: the file.
        what: how messages start, e.g. ``"IDX:"`` or ``"fleet file"``.

    Raises:
        FileNotFoundError: ``path`` does not exist (a dangling link included).
        ValueError: ``path`` is not a regular file, or cannot be examined (a NUL in the name,
            a name too long, a link loop, a folder without permission), in one line.
    """
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist.") from None
    except (OSError, ValueError) as error:  # ValueError: an embedded NUL character
        reason = getattr(error, "strerror", None) or str(error)
        raise ValueError(f"{what} {str(path)!r} cannot be read ({reason}).") from None
    if not stat.S_ISREG(info.st_mode):
        raise _special_file(path, info.st_mode, what)
    return info.st_size


def open_regular_file(path: str | os.PathLike[str], what: str) -> tuple[BinaryIO, int]:
    """``path`` opened for reading bytes, and its size; only a regular file is opened.

    :func:`regular_file_size` refuses a special file before it is opened; the file is then
    opened without blocking (``O_NONBLOCK``: a FIFO put in its place in between does not
    block the open) and checked again on the open descriptor (:func:`os.fstat`), so what is
    read is the regular file that was checked. Raises as :func:`regular_file_size` does.
    """
    path = Path(path)
    regular_file_size(path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist.") from None
    except OSError as error:
        raise ValueError(f"{what} {path} cannot be read ({error.strerror or error}).") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _special_file(path, info.st_mode, what)
    return os.fdopen(fd, "rb"), info.st_size


class _Readable(Protocol):
    """A stream of bytes: a file, or a decompressing reader (``read`` may return fewer bytes
    than asked, ``b""`` or ``None`` at the end)."""

    def read(self, size: int, /) -> bytes | None: ...

    def close(self) -> None: ...


def read_at_most(handle: _Readable, count: int) -> bytearray:
    """The next ``count`` bytes of ``handle`` (fewer at its end), read a chunk at a time.

    ``handle.read(count)`` would allocate ``count`` bytes before reading one: a header that
    declares 2**96 bytes must cost what the file holds, not what it claims.
    """
    data = bytearray()
    while len(data) < count:
        chunk = handle.read(min(_CHUNK, count - len(data)))
        if not chunk:
            break
        data += chunk
    return data


class _Inflated(io.RawIOBase):
    """The content of a gzip file, decompressed as it is read (:mod:`zlib`, which checks each
    member's CRC-32 and length), with the compressed bytes bounded.

    Members follow one another as in :mod:`gzip`; zero bytes between or after them are
    padding, as gzip allows, up to :data:`_GZIP_MAX_PADDING` bytes at a time (an
    ``OSError`` beyond: :class:`gzip.GzipFile` skips padding a byte at a time, so a file
    padded with a sparse hole of 30 GiB kept it busy for hours). At most ``limit``
    decompressed bytes are produced: one more raises :class:`_TooLong`.
    """

    def __init__(self, raw: BinaryIO, limit: int) -> None:
        super().__init__()
        self._raw, self._limit, self._produced = raw, limit, 0
        self._inflater: zlib._Decompress | None = None
        self._pending = b""  # compressed bytes not yet fed to the inflater
        self._members = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()
        super().close()

    def _input(self) -> bool:
        """Fill ``_pending`` from the file; ``False`` at the file's end."""
        if not self._pending:
            self._pending = self._raw.read(_CHUNK)
        return bool(self._pending)

    def readinto(self, buffer: Any) -> int:
        if not len(buffer):
            return 0
        while not self._done:
            if self._inflater is None:  # before a member, or after one: skip zero padding
                padding = 0
                while self._input() and self._members:
                    stripped = self._pending.lstrip(b"\x00")
                    padding += len(self._pending) - len(stripped)
                    if padding > _GZIP_MAX_PADDING:
                        raise OSError(
                            f"more than {_GZIP_MAX_PADDING} zero bytes of padding after a gzip "
                            "member"
                        )
                    if stripped:
                        self._pending = stripped
                        break
                    self._pending = b""
                if not self._pending:
                    self._done = True
                    break
                self._inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._members += 1
            if not self._input():
                raise EOFError("the file ends inside a gzip member (truncated)")
            wanted = min(len(buffer), _CHUNK, self._limit + 1 - self._produced)
            out = self._inflater.decompress(self._pending, max(wanted, 1))
            self._pending = self._inflater.unconsumed_tail or self._inflater.unused_data
            if self._inflater.eof:
                self._pending = self._inflater.unused_data
                self._inflater = None
            if out:
                self._produced += len(out)
                if self._produced > self._limit:
                    raise _TooLong(self._limit)
                buffer[: len(out)] = out
                return len(out)
        return 0


class _TooLong(Exception):
    """More decompressed bytes than a reader allows (:class:`_Inflated`, :class:`_Capped`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} bytes once decompressed")
        self.limit = limit


class _Capped(io.RawIOBase):
    """``stream`` (a decompressing reader), raising :class:`_TooLong` past ``limit`` bytes."""

    def __init__(self, stream: _Readable, limit: int) -> None:
        super().__init__()
        self._stream, self._limit, self._produced = stream, limit, 0

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._stream.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        data = self._stream.read(min(len(buffer), self._limit + 1 - self._produced)) or b""
        self._produced += len(data)
        if self._produced > self._limit:
            raise _TooLong(self._limit)
        buffer[: len(data)] = data
        return len(data)


def _gzip_error(path: Path, what: str, error: BaseException) -> ValueError:
    return ValueError(
        f"{what}: {path} could not be read as a gzip file ({error}); expected a complete "
        "gzip-compressed file, re-download or decompress it."
    )


def read_idx(path: str | Path, *, expected_magic: int | None = None) -> np.ndarray:
    """Read one IDX file (plain or ``.gz``) into a native-endian numpy array.

    Args:
        path: the IDX file.
        expected_magic: when given, the header's magic number must equal it
            (2051 for MNIST images, 2049 for MNIST labels).

    Returns:
        An array whose shape is the one declared in the header.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: bad magic number, unknown type code, or a data section whose
            length differs from what the header declares (truncated or padded file).
    """
    path = Path(path)
    handle, size = open_regular_file(path, "IDX:")
    gz = path.suffix == ".gz"
    with handle:
        # the gzip stream's limit only backs up the reads below, each bounded by the header
        stream = _Inflated(handle, _DEFLATE_MAX_RATIO * size + _CHUNK) if gz else handle
        try:
            return _read_idx_stream(path, stream, size, gz, expected_magic)
        except (OSError, EOFError, zlib.error, _TooLong) as error:
            if gz:
                raise _gzip_error(path, "IDX", error) from None
            raise ValueError(f"IDX: {path} could not be read ({error}).") from None
        except MemoryError:
            raise ValueError(
                f"IDX: {path}: its data does not fit in the memory free now."
            ) from None


def _idx_length_error(
    path: Path, shape: tuple[int, ...], expected: int, actual: int | None
) -> ValueError:
    """The data after the header is not what it declares; ``actual`` ``None``: more than
    declared, how much more unknown (a compressed stream is read one byte past it only)."""
    problem = "truncated" if actual is not None and actual < expected else "longer than declared"
    follow = f"more than {expected}" if actual is None else str(actual)
    return ValueError(
        f"IDX: {path} is {problem}: its header declares shape {shape} "
        f"({expected} data bytes) but {follow} data bytes follow the header."
    )


def _read_idx_stream(
    path: Path, stream: _Readable, size: int, gz: bool, expected_magic: int | None
) -> np.ndarray:
    """:func:`read_idx` on an open stream of ``size`` bytes in the file (compressed when
    ``gz``): the header first, then exactly the data it declares and one byte more, so that
    nothing is read (or decompressed) beyond what the header declares plus one byte.

    Guards: the declared size is a Python integer (dimensions up to 2**32 - 1 each multiply
    exactly; int64 would wrap and let a forged header match the file's length); it must
    equal the file's length for a plain file before any data is read, and for a gzip file
    lie within what its compressed size can expand to (at most 1032-fold) and can store (a
    file far longer than its content is padding: gigabytes of zeros); it must fit in this
    machine's memory.
    """
    head = read_at_most(stream, 4)
    if len(head) < 4:
        raise ValueError(
            f"IDX: {path} holds {len(head)} bytes, fewer than the 4-byte magic number; "
            "expected an IDX file (MNIST format)."
        )
    magic = int.from_bytes(head, "big")
    if expected_magic is not None and magic != expected_magic:
        raise ValueError(
            f"IDX: {path} has magic number {magic}; expected {expected_magic} "
            f"(0x{expected_magic:08X}). The file is corrupt or is not the IDX file of this kind."
        )
    type_code, ndim = head[2], head[3]
    if head[0] != 0 or head[1] != 0 or type_code not in _IDX_DTYPES:
        raise ValueError(
            f"IDX: {path} has magic number {magic} (0x{magic:08X}), which is not an IDX header; "
            "expected two zero bytes, a type code in {0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E} and "
            "the number of dimensions."
        )
    header_bytes = 4 + 4 * ndim
    dims = read_at_most(stream, 4 * ndim)
    if len(dims) < 4 * ndim:
        raise ValueError(
            f"IDX: {path} is truncated: its header declares {ndim} dimensions "
            f"({header_bytes} header bytes) but the file holds only {4 + len(dims)} bytes."
        )
    shape = tuple(int.from_bytes(dims[i : i + 4], "big") for i in range(0, 4 * ndim, 4))
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected = math.prod(shape) * dtype.itemsize
    if not gz:
        if size - header_bytes != expected:
            raise _idx_length_error(path, shape, expected, size - header_bytes)
    elif expected > _DEFLATE_MAX_RATIO * size:
        raise ValueError(
            f"IDX: {path} cannot hold what its header declares: shape {shape} ({expected} data "
            f"bytes) from {size} gzip-compressed bytes, more than the {_DEFLATE_MAX_RATIO}-fold "
            "that deflate expands to at most; the header is corrupt."
        )
    elif size > expected + expected // 8 + _GZIP_SLACK_BYTES:
        raise ValueError(
            f"IDX: {path} is longer than declared: its header declares shape {shape} "
            f"({expected} data bytes) but the gzip file holds {size} bytes, more than any "
            "gzip encoder needs for them; the header is corrupt or the file is padded."
        )
    if math.prod(d for d in shape if d) * dtype.itemsize > np.iinfo(np.intp).max:
        raise ValueError(
            f"IDX: {path} declares shape {shape}, whose sizes multiply beyond the largest "
            "array; the header is corrupt."
        )
    if expected > _memory_bytes():
        raise ValueError(
            f"IDX: {path}: its header declares shape {shape}, {expected / 1e9:.3g} GB of data, "
            f"more than this machine's {_memory_bytes() / 1e9:.3g} GB of memory."
        )
    data = read_at_most(stream, expected + 1)
    if len(data) != expected:
        raise _idx_length_error(path, shape, expected, None if len(data) > expected else len(data))
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | Path, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file (gzipped when the name ends in ``.gz``): the inverse of
    :func:`read_idx`, so ``read_idx(write_idx(p, a))`` equals ``a``.

    The type code follows the array's dtype (``uint8`` is 0x08, ``int8`` 0x09, ``int16``
    0x0B, ``int32`` 0x0C, ``float32`` 0x0D, ``float64`` 0x0E); sizes and data are written
    big-endian. A 3-D ``uint8`` array gets magic number 2051 and a 1-D one 2049 (MNIST's).

    Raises:
        ValueError: the dtype has no IDX type code, or the array has 0 or more than 255
            dimensions.
    """
    path = Path(path)
    array = np.asarray(array)
    code = next(
        (
            c
            for c, name in _IDX_DTYPES.items()
            if np.dtype(name).kind == array.dtype.kind
            and np.dtype(name).itemsize == array.dtype.itemsize
        ),
        None,
    )
    if code is None or not 1 <= array.ndim <= 255:
        raise ValueError(
            f"IDX: cannot write an array of dtype {array.dtype} and {array.ndim} dimensions to "
            f"{path}; expected uint8, int8, int16, int32, float32 or float64 and 1 to 255 "
            "dimensions."
        )
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    data = header + array.astype(np.dtype(_IDX_DTYPES[code]), copy=False).tobytes()
    if path.suffix == ".gz":
        # mtime=0: the same array gives the same bytes (no time stamp in the gzip header)
        data = gzip.compress(data, mtime=0)
    atomic_write_bytes(path, data)
    return path


def _find_mnist_file(root: Path, stem: str) -> Path:
    """Locate ``stem`` (e.g. ``train-images-idx3-ubyte``) in ``root``, plain or gzipped."""
    dotted = stem.replace("-idx", ".idx")  # some mirrors name them train-images.idx3-ubyte
    for folder in (root, root / "MNIST" / "raw"):
        for name in (stem, dotted):
            for suffix in ("", ".gz"):
                candidate = folder / f"{name}{suffix}"
                # not is_file(): a FIFO or device of this name is refused by read_idx, by
                # name, instead of being passed over and reported missing
                if candidate.exists() and not candidate.is_dir():
                    return candidate
    raise FileNotFoundError(
        f"MNIST: {root / stem} is missing; expected {_MNIST_SOURCE} ({stem} or {stem}.gz) "
        f"in {root}."
    )


def read_mnist(root: str | Path, *, train: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Read the MNIST images and labels of one split from a local directory.

    Looks for ``train-images-idx3-ubyte`` / ``train-labels-idx1-ubyte`` (``train=True``)
    or ``t10k-images-idx3-ubyte`` / ``t10k-labels-idx1-ubyte``, each optionally
    ``.gz``, in ``root`` (or torchvision's ``root/MNIST/raw``).

    Returns:
        ``(images, labels)``: ``uint8`` arrays of shapes ``(N, rows, cols)`` and ``(N,)``.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"MNIST: directory {root} does not exist; expected a folder holding {_MNIST_SOURCE}."
        )
    prefix = "train" if train else "t10k"
    images_path = _find_mnist_file(root, f"{prefix}-images-idx3-ubyte")
    labels_path = _find_mnist_file(root, f"{prefix}-labels-idx1-ubyte")
    images = read_idx(images_path, expected_magic=IDX_IMAGES_MAGIC)
    labels = read_idx(labels_path, expected_magic=IDX_LABELS_MAGIC)
    count, rows, columns = images.shape
    if count == 0 or rows == 0 or columns == 0:  # an empty split, or images without pixels
        raise ValueError(
            f"MNIST: {images_path} holds {count} images of {rows}x{columns} pixels; expected "
            "at least one image of at least 1x1 pixels."
        )
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"MNIST: {images_path} holds {images.shape[0]} images but {labels_path} holds "
            f"{labels.shape[0]} labels; expected the same number (files from different splits?)."
        )
    if labels.size and int(labels.max()) > 9:
        raise ValueError(
            f"MNIST: {labels_path} contains label {int(labels.max())}; expected digits 0-9."
        )
    return images, labels


def _check_cifar_length(path: Path, size: int) -> None:
    """Refuse a batch that is not a positive whole number of records (truncated, padded)."""
    if size == 0 or size % CIFAR10_RECORD_BYTES != 0:
        raise ValueError(
            f"CIFAR-10: {path} holds {size} bytes, not a positive whole number of "
            f"{CIFAR10_RECORD_BYTES}-byte records (1 label byte + 3072 pixel bytes); the file "
            "is truncated or is not from the binary version (cifar-10-binary.tar.gz)."
        )


def read_cifar10_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR-10 binary batch file (e.g. ``data_batch_1.bin``).

    Returns:
        ``(images, labels)``: ``uint8`` arrays of shapes ``(N, 3, 32, 32)`` and ``(N,)``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is empty, is not a whole number of 3073-byte records,
            or holds a label outside 0-9.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"CIFAR-10: {path} is missing; expected the binary version "
            "(cifar-10-binary.tar.gz, extracted)."
        )
    handle, size = open_regular_file(path, "CIFAR-10:")  # a FIFO or device: refused
    with handle:
        # the length is checked from the file's size before anything is read: a sparse
        # 30 GiB file of the wrong length costs a stat, not 30 GiB of memory
        _check_cifar_length(path, size)
        if size > _memory_bytes():
            raise ValueError(
                f"CIFAR-10: {path} holds {size / 1e9:.3g} GB, more than this machine's "
                f"{_memory_bytes() / 1e9:.3g} GB of memory; a CIFAR-10 batch holds 30.7 MB."
            )
        try:
            data = read_at_most(handle, size + 1)
        except OSError as error:
            raise ValueError(f"CIFAR-10: {path} could not be read ({error}).") from None
        except MemoryError:
            raise ValueError(
                f"CIFAR-10: {path}: its {size} bytes do not fit in the memory free now."
            ) from None
    _check_cifar_length(path, len(data))  # the file changed while it was read
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, CIFAR10_RECORD_BYTES)
    labels = records[:, 0].copy()
    if int(labels.max()) > 9:
        raise ValueError(
            f"CIFAR-10: {path} contains label {int(labels.max())}; expected 0-9 in the first byte "
            "of every record (is this the CIFAR-100 binary version?)."
        )
    images = records[:, 1:].reshape(-1, 3, 32, 32).copy()
    return images, labels


def read_cifar10(root: str | Path, *, train: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Read the CIFAR-10 binary training (5 batches) or test split from ``root``.

    ``root`` may be the extracted ``cifar-10-batches-bin`` folder or its parent.

    Returns:
        ``(images, labels)``: ``uint8`` arrays of shapes ``(N, 3, 32, 32)`` and ``(N,)``.
    """
    root = Path(root)
    if (root / "cifar-10-batches-bin").is_dir():
        root = root / "cifar-10-batches-bin"
    if not root.is_dir():
        raise FileNotFoundError(
            f"CIFAR-10: directory {root} does not exist; expected the extracted binary version "
            "(cifar-10-batches-bin with data_batch_1.bin ... data_batch_5.bin, test_batch.bin)."
        )
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if train else ["test_batch.bin"]
    for name in names:
        if not (root / name).exists():  # a FIFO or device: refused by read_cifar10_batch
            raise FileNotFoundError(
                f"CIFAR-10: {root / name} is missing; expected the binary version's files "
                f"{', '.join(names)} in {root}."
            )
    batches = [read_cifar10_batch(root / name) for name in names]
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    return images, labels


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def read_omniglot(
    root: str | Path, *, image_size: int = 28
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Read Omniglot characters from ``root/<alphabet>/<character>/*.png``.

    Each character folder is one class; classes are numbered in sorted path order
    (alphabets sorted, then characters within an alphabet), images within a class
    in sorted file-name order. Images are converted to 8-bit grayscale (Pillow mode
    ``"L"``; Omniglot draws dark strokes on a white background, which is kept) and,
    when their size differs, resized to ``image_size x image_size`` with Lanczos
    resampling (as in MAML's Omniglot preprocessing, Finn et al. 2017).

    Returns:
        ``(images, labels, class_names)``: ``uint8`` array ``(N, s, s)``, ``int64``
        array ``(N,)`` and the ``"<alphabet>/<character>"`` name of every class.

    Raises:
        FileNotFoundError: ``root`` does not exist or holds no alphabet folders.
        ValueError: a character folder holds no PNG, or a PNG cannot be decoded.
    """
    from PIL import Image

    if image_size < 1:
        raise ValueError(f"Omniglot: image_size must be a positive integer, got {image_size}.")
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"Omniglot: directory {root} does not exist; expected the extracted "
            "images_background (or images_evaluation) folder with <alphabet>/<character>/*.png."
        )
    alphabets = _visible_dirs(root)
    if not alphabets:
        raise FileNotFoundError(
            f"Omniglot: {root} holds no alphabet folders; expected <alphabet>/<character>/*.png "
            "below it (point root at images_background or images_evaluation)."
        )
    images: list[np.ndarray] = []
    labels: list[int] = []
    class_names: list[str] = []
    for alphabet in alphabets:
        for character in _visible_dirs(alphabet):
            files = sorted(p for p in character.iterdir() if p.suffix.lower() == ".png")
            if not files:
                raise ValueError(
                    f"Omniglot: character folder {character} holds no .png files; expected at "
                    "least one image per character (remove the empty folder)."
                )
            label = len(class_names)
            class_names.append(f"{alphabet.name}/{character.name}")
            for file in files:
                # a FIFO named 0.png would block Image.open forever: refused before opening
                handle, size = open_regular_file(file, "Omniglot:")
                with handle:
                    if size > _OMNIGLOT_MAX_FILE_BYTES:
                        raise ValueError(
                            f"Omniglot: {file} holds {size} bytes, more than the "
                            f"{_OMNIGLOT_MAX_FILE_BYTES} an image may take (Omniglot's PNGs "
                            "take about 1 kB each)."
                        )
                    gray = _decode_glyph(file, handle)
                if gray.size != (image_size, image_size):
                    gray = gray.resize((image_size, image_size), Image.Resampling.LANCZOS)
                images.append(np.asarray(gray, dtype=np.uint8))
                labels.append(label)
    if not class_names:
        raise FileNotFoundError(
            f"Omniglot: {root} holds no character folders; expected <alphabet>/<character>/*.png."
        )
    return np.stack(images), np.asarray(labels, dtype=np.int64), class_names


def _decode_glyph(file: Path, handle: BinaryIO) -> Any:
    """The image in ``handle`` (the open ``file``) as 8-bit grayscale, a Pillow image.

    The pixel count its header declares is checked before the pixels are decoded: Pillow
    itself refuses only images above twice its ``MAX_IMAGE_PIXELS`` (2 x 89 million pixels,
    a decompression bomb) and decodes smaller ones whole, hundreds of MB for one glyph. What
    Pillow raises on a damaged file (``OSError`` for a truncated one, ``SyntaxError`` for a
    broken chunk, ...) is one line naming the file.
    """
    from PIL import Image

    try:
        image = Image.open(handle)
    except _PILLOW_ERRORS + (Image.DecompressionBombError,) as error:
        raise _undecodable(file, error) from None
    with image:
        width, height = image.size
        if width * height > _OMNIGLOT_MAX_PIXELS:
            raise ValueError(
                f"Omniglot: {file} declares {width}x{height} pixels, more than the "
                f"{_OMNIGLOT_MAX_PIXELS} (4096x4096) radbo decodes; Omniglot's glyphs are "
                "105x105."
            )
        try:
            return image.convert("L")
        except _PILLOW_ERRORS as error:
            raise _undecodable(file, error) from None
        except MemoryError:
            raise ValueError(
                f"Omniglot: {file}: its pixels do not fit in the memory free now."
            ) from None


#: What Pillow raises on a damaged image file (UnidentifiedImageError is an OSError; a
#: truncated file an OSError; a broken PNG chunk a SyntaxError; a bad header field a
#: ValueError, struct.error or IndexError).
_PILLOW_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    EOFError,
    SyntaxError,
    ValueError,
    struct.error,
    IndexError,
)


def _undecodable(file: Path, error: BaseException) -> ValueError:
    from PIL import UnidentifiedImageError

    # Pillow names the open handle ("<_io.BufferedReader name=3>"), not the file
    unknown = isinstance(error, UnidentifiedImageError)
    reason = "not an image format Pillow knows" if unknown else " ".join(str(error).split())
    return ValueError(f"Omniglot: {file} could not be decoded as a PNG image ({reason}).")


# -- LIBSVM -----------------------------------------------------------------------------------

_LIBSVM_FORMAT = "'<label> <index>:<value> ...' lines with 1-based, increasing indices"


def _open_text(path: Path, limit: int) -> io.BufferedReader:
    """``path`` (a regular file: a FIFO or device is refused before it is opened) opened for
    reading bytes, decompressed by its suffix as scikit-learn does (``.gz``, ``.bz2``). At
    most ``limit`` bytes of text come out; one more raises :class:`_TooLong`, so that a
    compressed file of a few MB cannot expand to more text than memory can parse."""
    handle, _ = open_regular_file(path, "LIBSVM:")
    raw: io.RawIOBase
    if path.suffix == ".gz":
        raw = _Inflated(handle, limit)
    elif path.suffix == ".bz2":
        raw = _Capped(bz2.BZ2File(handle), limit)
    else:
        raw = _Capped(handle, limit)  # a file that grows while it is read
    return io.BufferedReader(raw, _CHUNK)


def _libsvm_lines(path: Path, limit: int) -> Iterator[tuple[int, list[str]]]:
    """(line number, whitespace-separated tokens) of every line that holds an example."""
    with _open_text(path, limit) as handle:
        for number, raw in enumerate(handle, start=1):
            text = raw.decode("utf-8", errors="replace").split("#", 1)[0]
            tokens = text.split()
            if tokens:
                yield number, tokens


def _libsvm_line_problem(tokens: list[str], num_features: int | None) -> str | None:
    """What is wrong with one example line, or ``None``."""
    try:
        label = float(tokens[0])
    except ValueError:
        return f"label {tokens[0]!r} is not a number"
    if not np.isfinite(label) or label != int(label):
        return f"label {tokens[0]!r} is not an integer class label"
    if abs(label) >= _LIBSVM_MAX_LABEL:  # int64 would take 9223372036854775807 as -2**63
        return (
            f"label {tokens[0]!r} is outside (-2**53, 2**53), where labels read as float64 "
            "are exact integers"
        )
    pairs = tokens[1:]
    if pairs and pairs[0].startswith("qid:"):  # SVMlight's query id, ignored (as sklearn does)
        pairs = pairs[1:]
    previous = 0
    for pair in pairs:
        index_text, colon, value_text = pair.partition(":")
        if not colon:
            return f"{pair!r} is not <index>:<value> (no ':')"
        try:
            index, value = int(index_text), float(value_text)
        except ValueError:
            return f"{pair!r} is not <index>:<value> (an integer and a number)"
        if index < 1:
            return f"index {index} in {pair!r} is below 1 (LIBSVM indices are 1-based)"
        if index <= previous:
            return f"index {index} follows index {previous} (indices must increase strictly)"
        if index > _LIBSVM_MAX_INDEX:  # scikit-learn's parser raises OverflowError
            return f"index {index} is above {_LIBSVM_MAX_INDEX}, the largest feature index"
        if num_features is not None and index > num_features:
            return f"index {index} exceeds num_features = {num_features}"
        if not np.isfinite(value):
            return f"value {value_text!r} of index {index} is not finite"
        previous = index
    return None


def _libsvm_error(path: Path, num_features: int | None, cause: str, limit: int) -> ValueError:
    """The first malformed line of ``path`` as a ``ValueError`` naming the file and line; when
    no line is found malformed (or the file cannot be read again to its end), ``cause``."""
    try:
        for number, tokens in _libsvm_lines(path, limit):
            problem = _libsvm_line_problem(tokens, num_features)
            if problem is not None:
                return ValueError(
                    f"LIBSVM: {path}, line {number}: {problem}; expected {_LIBSVM_FORMAT}."
                )
    except (OSError, EOFError, zlib.error, _TooLong):
        pass  # the file's end is damaged: the parser's own words below
    cause = " ".join(cause.split())  # one line
    return ValueError(f"LIBSVM: {path} could not be parsed ({cause}); expected {_LIBSVM_FORMAT}.")


def read_libsvm(
    path: str | Path, *, num_features: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Read a LIBSVM / SVMlight text file (plain, ``.gz`` or ``.bz2``) into dense arrays.

    Parsing is scikit-learn's :func:`sklearn.datasets.load_svmlight_file` (a well-kept
    parser, and scikit-learn is already a dependency) with 1-based indices. Its errors do not
    say where the problem is, so on any error -- its ``OverflowError`` for a feature index
    above 2**31 - 1 included -- and for what it accepts but radbo does not (non-integer
    labels, labels beyond 2**53 that float64 would change and int64 wrap, non-finite values)
    the file is scanned again line by line and the first malformed line is reported by number.

    Bounded: only a regular file is opened (a FIFO or device is refused before); the text,
    decompressed or not, may take at most 1/8 of this machine's memory (the parser's arrays
    take up to 8 bytes per byte of text), checked from the file's size before parsing and
    counted while decompressing (a gzip bomb stops there); the dense array must fit in memory.

    Args:
        path: the file.
        num_features: the number of features (columns); indices above it are an error.
            Default: the largest index in the file.

    Returns:
        ``(features, labels)``: a ``float64`` array ``(N, D)`` (absent entries 0) and the
        labels as written, an ``int64`` array ``(N,)`` (e.g. -1/+1; not yet numbered 0..C-1).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a malformed line (naming the file and line number), an undecodable
            compressed file, or a file without examples.
    """
    path = Path(path)
    if not path.exists():  # exists(), not is_file(): a FIFO is refused by name below
        raise FileNotFoundError(
            f"LIBSVM: {path} is missing; expected a LIBSVM text file ({_LIBSVM_FORMAT})."
        )
    size = regular_file_size(path, "LIBSVM:")
    limit = _memory_bytes() // _LIBSVM_BYTES_PER_TEXT_BYTE
    too_much = (
        f"more than the {limit} bytes of text this machine's {_memory_bytes() / 1e9:.3g} GB of "
        f"memory can parse (the parser keeps up to {_LIBSVM_BYTES_PER_TEXT_BYTE} bytes per "
        "byte of text)"
    )
    if size > limit:
        raise ValueError(f"LIBSVM: {path} holds {size} bytes, {too_much}.")
    sparse, labels = _parse_libsvm(path, num_features, limit, too_much)
    if labels.size == 0:
        raise ValueError(f"LIBSVM: {path} holds no examples; expected {_LIBSVM_FORMAT}.")
    if (
        not (np.isfinite(sparse.data).all() and np.isfinite(labels).all())
        or not np.array_equal(labels, np.round(labels))
        or bool((np.abs(labels) >= _LIBSVM_MAX_LABEL).any())
    ):
        raise _libsvm_error(path, num_features, "non-integer label or non-finite value", limit)
    return _dense(path, sparse), labels.astype(np.int64)


def _parse_libsvm(
    path: Path, num_features: int | None, limit: int, too_much: str
) -> tuple[Any, np.ndarray]:
    """The sparse features (a SciPy CSR matrix) and the ``float64`` labels scikit-learn's
    parser reads from ``path`` (at most ``limit`` bytes of text, decompressed; ``too_much``
    says why more is refused); every failure is one :class:`ValueError` naming the file
    (a malformed line by its number, :func:`_libsvm_error`)."""
    from sklearn.datasets import load_svmlight_file

    stream = _open_text(path, limit)
    try:
        with stream:
            sparse, raw_labels = load_svmlight_file(
                stream, n_features=num_features, dtype=np.float64, zero_based=False
            )
    except _TooLong:
        raise ValueError(f"LIBSVM: {path} decompresses to {too_much}.") from None
    except (ValueError, OverflowError) as error:
        raise _libsvm_error(path, num_features, str(error), limit) from None
    except (OSError, EOFError, zlib.error) as error:  # damaged .gz / .bz2
        raise ValueError(
            f"LIBSVM: {path} could not be read ({error}); expected a complete file, "
            "compressed by its suffix (.gz, .bz2) or plain text."
        ) from error
    except MemoryError:
        raise ValueError(
            f"LIBSVM: {path}: parsing it takes more memory than is free now."
        ) from None
    return sparse, np.asarray(raw_labels, dtype=np.float64)


def _dense(path: Path, sparse: Any) -> np.ndarray:
    """The sparse features of ``path`` as a dense ``float64`` array; :class:`ValueError` when
    it would not fit in this machine's memory, or does not in the memory free now."""
    rows, columns = sparse.shape
    dense_bytes = 8 * rows * columns
    if dense_bytes > _memory_bytes():
        raise ValueError(
            f"LIBSVM: {path}: {rows} examples x {columns} features as dense float64 would take "
            f"{dense_bytes / 1e9:.3g} GB, more than this machine's {_memory_bytes() / 1e9:.3g} GB "
            "of memory; set a smaller num_features (or check the file's largest index)."
        )
    try:
        return sparse.toarray()
    except MemoryError:
        raise ValueError(
            f"LIBSVM: {path}: {rows} examples x {columns} features as dense float64 "
            f"({dense_bytes / 1e9:.3g} GB) do not fit in the memory free now."
        ) from None


def _memory_bytes() -> int:
    """This machine's physical memory in bytes."""
    import psutil

    return int(psutil.virtual_memory().total)
