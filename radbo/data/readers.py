"""Readers for the on-disk formats of the public data sets radbo can load.

Every reader works on files the user already has in a local directory (radbo never
downloads anything), parses them with :func:`numpy.frombuffer` (never ``pickle``)
and validates what it reads: magic numbers, declared sizes against file sizes,
whole records, label ranges. Problems raise :class:`FileNotFoundError` or
:class:`ValueError` with a sentence naming the file and what was expected.

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
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

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


def _read_bytes(path: Path, what: str) -> bytes:
    """Return the content of ``path``, gunzipped when its name ends in ``.gz``."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as handle:
                return handle.read()
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} is missing.") from None
    except (OSError, EOFError, zlib.error) as error:
        raise ValueError(
            f"{what}: {path} could not be read as a gzip file ({error}); expected a complete "
            "gzip-compressed file, re-download or decompress it."
        ) from error


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
    data = _read_bytes(path, "IDX")
    if len(data) < 4:
        raise ValueError(
            f"IDX: {path} holds {len(data)} bytes, fewer than the 4-byte magic number; "
            "expected an IDX file (MNIST format)."
        )
    magic = int.from_bytes(data[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise ValueError(
            f"IDX: {path} has magic number {magic}; expected {expected_magic} "
            f"(0x{expected_magic:08X}). The file is corrupt or is not the IDX file of this kind."
        )
    type_code, ndim = data[2], data[3]
    if data[0] != 0 or data[1] != 0 or type_code not in _IDX_DTYPES:
        raise ValueError(
            f"IDX: {path} has magic number {magic} (0x{magic:08X}), which is not an IDX header; "
            "expected two zero bytes, a type code in {0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E} and "
            "the number of dimensions."
        )
    header_bytes = 4 + 4 * ndim
    if len(data) < header_bytes:
        raise ValueError(
            f"IDX: {path} is truncated: its header declares {ndim} dimensions "
            f"({header_bytes} header bytes) but the file holds only {len(data)} bytes."
        )
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[type_code])
    expected_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual_bytes = len(data) - header_bytes
    if actual_bytes != expected_bytes:
        problem = "truncated" if actual_bytes < expected_bytes else "longer than declared"
        raise ValueError(
            f"IDX: {path} is {problem}: its header declares shape {shape} "
            f"({expected_bytes} data bytes) but {actual_bytes} data bytes follow the header."
        )
    array = np.frombuffer(data, dtype=dtype, offset=header_bytes).reshape(shape)
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
    path.write_bytes(data)
    return path


def _find_mnist_file(root: Path, stem: str) -> Path:
    """Locate ``stem`` (e.g. ``train-images-idx3-ubyte``) in ``root``, plain or gzipped."""
    dotted = stem.replace("-idx", ".idx")  # some mirrors name them train-images.idx3-ubyte
    for folder in (root, root / "MNIST" / "raw"):
        for name in (stem, dotted):
            for suffix in ("", ".gz"):
                candidate = folder / f"{name}{suffix}"
                if candidate.is_file():
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
    if not path.is_file():
        raise FileNotFoundError(
            f"CIFAR-10: {path} is missing; expected the binary version "
            "(cifar-10-binary.tar.gz, extracted)."
        )
    data = path.read_bytes()
    if len(data) == 0 or len(data) % CIFAR10_RECORD_BYTES != 0:
        raise ValueError(
            f"CIFAR-10: {path} holds {len(data)} bytes, not a positive whole number of "
            f"{CIFAR10_RECORD_BYTES}-byte records (1 label byte + 3072 pixel bytes); the file "
            "is truncated or is not from the binary version (cifar-10-binary.tar.gz)."
        )
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
        if not (root / name).is_file():
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
    from PIL import Image, UnidentifiedImageError

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
                try:
                    with Image.open(file) as image:
                        gray = image.convert("L")
                except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as error:
                    raise ValueError(  # a bomb: a PNG declaring far more pixels than a glyph
                        f"Omniglot: {file} could not be decoded as a PNG image ({error})."
                    ) from error
                if gray.size != (image_size, image_size):
                    gray = gray.resize((image_size, image_size), Image.Resampling.LANCZOS)
                images.append(np.asarray(gray, dtype=np.uint8))
                labels.append(label)
    if not class_names:
        raise FileNotFoundError(
            f"Omniglot: {root} holds no character folders; expected <alphabet>/<character>/*.png."
        )
    return np.stack(images), np.asarray(labels, dtype=np.int64), class_names


# -- LIBSVM -----------------------------------------------------------------------------------

_LIBSVM_FORMAT = "'<label> <index>:<value> ...' lines with 1-based, increasing indices"


def _open_text(path: Path) -> io.BufferedIOBase:
    """``path`` opened for reading bytes, decompressed by its suffix as scikit-learn does."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    return path.open("rb")


def _libsvm_lines(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line number, whitespace-separated tokens) of every line that holds an example."""
    with _open_text(path) as handle:
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
        if num_features is not None and index > num_features:
            return f"index {index} exceeds num_features = {num_features}"
        if not np.isfinite(value):
            return f"value {value_text!r} of index {index} is not finite"
        previous = index
    return None


def _libsvm_error(path: Path, num_features: int | None, cause: str) -> ValueError:
    """The first malformed line of ``path`` as a ``ValueError`` naming the file and line."""
    for number, tokens in _libsvm_lines(path):
        problem = _libsvm_line_problem(tokens, num_features)
        if problem is not None:
            return ValueError(
                f"LIBSVM: {path}, line {number}: {problem}; expected {_LIBSVM_FORMAT}."
            )
    return ValueError(f"LIBSVM: {path} could not be parsed ({cause}); expected {_LIBSVM_FORMAT}.")


def read_libsvm(
    path: str | Path, *, num_features: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Read a LIBSVM / SVMlight text file (plain, ``.gz`` or ``.bz2``) into dense arrays.

    Parsing is scikit-learn's :func:`sklearn.datasets.load_svmlight_file` (a well-kept
    parser, and scikit-learn is already a dependency) with 1-based indices. Its errors do not
    say where the problem is, so on any error -- and for what it accepts but radbo does not:
    non-integer labels, non-finite values -- the file is scanned again line by line and the
    first malformed line is reported by number.

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
    from sklearn.datasets import load_svmlight_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"LIBSVM: {path} is missing; expected a LIBSVM text file ({_LIBSVM_FORMAT})."
        )
    try:
        sparse, raw_labels = load_svmlight_file(
            str(path), n_features=num_features, dtype=np.float64, zero_based=False
        )
    except ValueError as error:
        raise _libsvm_error(path, num_features, str(error)) from None
    except (OSError, EOFError, zlib.error) as error:  # damaged .gz / .bz2
        raise ValueError(
            f"LIBSVM: {path} could not be read ({error}); expected a complete file, "
            "compressed by its suffix (.gz, .bz2) or plain text."
        ) from error
    labels = np.asarray(raw_labels, dtype=np.float64)
    if labels.size == 0:
        raise ValueError(f"LIBSVM: {path} holds no examples; expected {_LIBSVM_FORMAT}.")
    if not (np.isfinite(sparse.data).all() and np.isfinite(labels).all()) or not np.array_equal(
        labels, np.round(labels)
    ):
        raise _libsvm_error(path, num_features, "non-integer label or non-finite value")
    rows, columns = sparse.shape
    dense_bytes = 8 * rows * columns
    if dense_bytes > _memory_bytes():
        raise ValueError(
            f"LIBSVM: {path}: {rows} examples x {columns} features as dense float64 would take "
            f"{dense_bytes / 1e9:.3g} GB, more than this machine's {_memory_bytes() / 1e9:.3g} GB "
            "of memory; set a smaller num_features (or check the file's largest index)."
        )
    try:
        return sparse.toarray(), labels.astype(np.int64)
    except MemoryError:
        raise ValueError(
            f"LIBSVM: {path}: {rows} examples x {columns} features as dense float64 "
            f"({dense_bytes / 1e9:.3g} GB) do not fit in the memory free now."
        ) from None


def _memory_bytes() -> int:
    """This machine's physical memory in bytes."""
    import psutil

    return int(psutil.virtual_memory().total)
