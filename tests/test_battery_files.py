"""A hypothesis battery of damaged data files, fleet files and traces (issue 28, item 8).

Each property takes a small valid file radbo reads -- MNIST IDX (plain and gzip), a CIFAR-10
batch, a LIBSVM text (plain, gzip, bzip2), an Omniglot PNG folder, a fleet file (TOML, JSON),
a trace -- and damages it knowing its structure: header fields set to hostile values
(dimensions, magic numbers, lengths, PNG width and height, gzip flags, CRCs), truncation,
appended bytes, flipped bits, deleted or repeated ranges, tokens replaced, and the file
replaced by a FIFO, a folder, a link to ``/dev/zero`` or a sparse file of 30 GiB. The reader
then runs in a :class:`~tests.data.test_hostile_data.Sandbox` child (peak RSS below 1 GiB, a
30-second timeout: a read that blocks or takes all memory fails the test) and must either

* read the file correctly: the arrays (or profiles) equal what an independent reading of the
  damaged bytes by the format's specification gives (the oracles below), or
* refuse it with radbo's error type for the file (``ValueError`` / ``FileNotFoundError`` from
  the data readers, which ``radbo run`` reports as one line; ``ProfileError`` lines from fleet
  files and traces), one line per problem, naming the file.

Where the oracle says a damaged file cannot be read (a length that no longer matches, a label
out of range, a special file), the refusal is required; where it can be read exactly, reading
it is required (IDX, CIFAR-10, LIBSVM, fleet files). Any other exception fails the test. The
default suite draws a few derandomized examples per property (seconds); ``pytest -m slow``
runs many more, freshly random.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import os
import re
import struct
import tempfile
import tomllib
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from radbo.devices import Fleet
from radbo.devices.profile import ProfileError, parse_profile
from tests.data.test_hostile_data import (
    SPECIAL,
    GiB,
    Sandbox,
    fifo,
    png,
    sparse,
    write_cifar,
    write_mnist,
    write_omniglot,
)

pytestmark = pytest.mark.skipif(
    not (hasattr(os, "fork") and hasattr(os, "mkfifo")), reason="needs fork and FIFOs (POSIX)"
)

#: Errors the data readers raise for a file they refuse (``radbo run`` makes them one line).
DATA_ERRORS = {"builtins.ValueError", "builtins.FileNotFoundError"}
PROFILE_ERROR = f"{ProfileError.__module__}.{ProfileError.__qualname__}"


def fast(examples: int) -> Callable[[Any], Any]:
    """The default suite's settings: few derandomized examples, no deadline (a case is bounded
    by the sandbox's timeout instead)."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


SLOW = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


class CountingSandbox(Sandbox):
    """A :class:`Sandbox` that records each outcome as a hypothesis event (``pytest
    --hypothesis-show-statistics`` shows how many damaged files were read, how many refused)."""

    def call(self, function: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        result = super().call(function, *args, **kwargs)
        if currently_in_test_context():
            event("read" if "value" in result else f"refused: {result.get('raised')}")
        return result


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    box = CountingSandbox()
    yield box
    box.close()


@contextmanager
def scratch() -> Iterator[Path]:
    """A fresh folder per example (``tmp_path`` is one per test)."""
    with tempfile.TemporaryDirectory(prefix="radbo-battery-") as folder:
        yield Path(folder)


# ------------------------------------------------------------------------- mutations
#: What replaces a file instead of bytes: a special file, or a sparse 30 GiB file that starts
#: with the valid content.
SPECIALS = ["fifo", "folder", "dev-zero", "sparse"]

Mutation = tuple[Any, ...]


def apply(data: bytes, mutations: list[Mutation]) -> bytes:
    """``data`` with each mutation applied in turn; offsets wrap around the current length.

    ``("set", offset, width, value)``: a big-endian field set to ``value``;
    ``("cut", n)``: truncated to ``n`` bytes; ``("append", bytes)``; ``("flip", offset,
    mask)``: one byte xor-ed; ``("delete", start, length)``; ``("repeat", start, length)``:
    a range doubled; ``("insert", offset, bytes)``.
    """
    for mutation in mutations:
        kind, n = mutation[0], max(len(data), 1)
        if kind == "set":
            _, offset, width, value = mutation
            if offset + width <= len(data):
                field = (value % 2 ** (8 * width)).to_bytes(width, "big")
                data = data[:offset] + field + data[offset + width :]
        elif kind == "cut":
            data = data[: mutation[1] % n]
        elif kind == "append":
            data = data + mutation[1]
        elif kind == "flip":
            at = mutation[1] % n
            if data:
                data = data[:at] + bytes([data[at] ^ mutation[2]]) + data[at + 1 :]
        elif kind == "delete":
            at = mutation[1] % n
            data = data[:at] + data[at + mutation[2] :]
        elif kind == "repeat":
            at = mutation[1] % n
            data = data[: at + mutation[2]] + data[at:]
        elif kind == "insert":
            at = mutation[1] % n
            data = data[:at] + mutation[2] + data[at:]
    return data


def place(path: Path, content: bytes | str) -> None:
    """Write ``content`` to ``path``, or put the special file :data:`SPECIALS` names there."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "fifo":
        fifo(path)
    elif content == "folder":
        path.mkdir()
    elif content == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        raise ValueError(content)


INTERESTING = [0, 1, 2, 3, 9, 10, 255, 256, 2049, 2051, 3073, 2**31 - 1, 2**31, 2**32 - 1]


def field_values(valid: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from([*INTERESTING, valid - 1, valid + 1, valid * 2]),
        st.integers(0, 2**32 - 1),
    )


def byte_mutations(
    fields: list[tuple[int, int, int]], header: int, *, max_size: int = 3
) -> st.SearchStrategy[list[Mutation]]:
    """1 to ``max_size`` mutations of a file whose header fields are ``(offset, width,
    valid value)``; flips favour the first ``header`` bytes."""
    one = st.one_of(
        st.sampled_from(fields).flatmap(
            lambda f: field_values(f[2]).map(lambda v: ("set", f[0], f[1], v))
        ),
        st.tuples(st.just("cut"), st.integers(0, 2**16)),
        st.tuples(
            st.just("append"),
            st.binary(min_size=1, max_size=64) | st.sampled_from([b"\0", bytes(3073), b"\0" * 7]),
        ),
        st.tuples(st.just("flip"), st.integers(0, header - 1), st.integers(1, 255)),
        st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(1, 255)),
        st.tuples(st.just("delete"), st.integers(0, 2**16), st.integers(1, 64)),
        st.tuples(st.just("repeat"), st.integers(0, 2**16), st.integers(1, 64)),
    )
    return st.lists(one, min_size=1, max_size=max_size)


def check_refusal(result: dict[str, Any], errors: set[str], *names: Path) -> str:
    """``result`` is a refusal of one of ``errors``; each line of its message names one of
    ``names`` (data readers) and the message has one line (data) or lines that each start
    as a profile error does."""
    assert "raised" in result, f"accepted: {result.get('value')!r}"
    assert result["raised"] in errors, result["traceback"]
    message = result["message"]
    if result["raised"] == PROFILE_ERROR:
        assert all(line.startswith("device profile error: ") for line in message.splitlines())
    else:
        assert "\n" not in message, message
        assert any(str(name) in message for name in names), (message, names)
    return message


def digest(array: np.ndarray) -> dict[str, Any]:
    """What the sandbox reports for an array."""
    data = np.ascontiguousarray(array).tobytes()
    return {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


# ----------------------------------------------------------------- oracle: gzip and IDX
def gunzip(data: bytes) -> bytes | None:
    """The content of a gzip file by RFC 1952, or ``None``: members one after another, each
    checked by zlib (header, CRC-32, length), zero bytes after a member skipped as padding
    (up to 1 MiB at a time); no bytes at all is an empty file."""
    out, members = [], 0
    while data:
        if members:
            stripped = data.lstrip(b"\0")
            if len(data) - len(stripped) > 1 << 20:  # radbo allows 1 MiB of padding
                return None
            data = stripped
            if not data:
                break
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out.append(inflater.decompress(data))
        except zlib.error:
            return None
        if not inflater.eof:
            return None
        data, members = inflater.unused_data, members + 1
    return b"".join(out)


def idx_array(content: bytes, magic: int) -> np.ndarray | None:
    """An IDX file of unsigned bytes with ``magic`` by its specification, or ``None``: the
    4-byte magic, one 4-byte big-endian size per dimension, exactly the declared data."""
    if len(content) < 4 or int.from_bytes(content[:4], "big") != magic:
        return None
    ndim = content[3]
    if len(content) < 4 + 4 * ndim:
        return None
    shape = struct.unpack(f">{ndim}I", content[4 : 4 + 4 * ndim])
    if len(content) - 4 - 4 * ndim != int(np.prod(shape, dtype=object)):
        return None
    if int(np.prod([d for d in shape if d] or [1], dtype=object)) > np.iinfo(np.intp).max:
        return None
    return np.frombuffer(content, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def mnist_expected(images: bytes, labels: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """What reading the MNIST pair gives, or ``None`` where it must be refused."""
    x, y = idx_array(images, 2051), idx_array(labels, 2049)
    if x is None or y is None or 0 in x.shape or x.shape[0] != y.shape[0]:
        return None
    if y.size and int(y.max()) > 9:
        return None
    return x, y


IDX_IMAGE_FIELDS = [(0, 4, 2051), (2, 1, 8), (3, 1, 3), (4, 4, 6), (8, 4, 28), (12, 4, 28)]
IDX_LABEL_FIELDS = [(0, 4, 2049), (2, 1, 8), (3, 1, 1), (4, 4, 6)]
# gzip: magic, method, flags, mtime, extra flags, OS; the trailer (CRC-32, length) by offset
GZIP_FIELDS = [(0, 2, 0x1F8B), (2, 1, 8), (3, 1, 0), (4, 4, 0), (8, 1, 2), (9, 1, 255)]

mnist_cases = st.fixed_dictionaries(
    {
        "which": st.sampled_from(["images", "labels"]),
        "gz": st.booleans(),
        "inner": byte_mutations(IDX_IMAGE_FIELDS + IDX_LABEL_FIELDS, 16) | st.just([]),
        "outer": byte_mutations(GZIP_FIELDS, 10, max_size=2) | st.just([]),
        "special": st.sampled_from([None] * 6 + SPECIALS),
    }
)


def check_mnist(sandbox: Sandbox, case: dict[str, Any]) -> None:
    with scratch() as folder:
        root = write_mnist(folder / "mnist", gz=case["gz"])
        suffix = ".gz" if case["gz"] else ""
        stem = "train-images-idx3-ubyte" if case["which"] == "images" else "train-labels-idx1-ubyte"
        path = root / f"{stem}{suffix}"
        files = {
            name: (root / f"{name}{suffix}").read_bytes()
            for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
        }
        stored = path.read_bytes()
        content = gzip.decompress(stored) if case["gz"] else stored
        damaged = apply(content, case["inner"])
        if case["gz"]:
            damaged = apply(gzip.compress(damaged, mtime=0), case["outer"])
        path.unlink()
        if case["special"] == "sparse":
            sparse(path, 30 * GiB, damaged)
        else:
            place(path, case["special"] or damaged)
        files[stem] = damaged

        result = sandbox.call("radbo.data.readers:read_mnist", str(root), timeout=30)

        if case["special"] is not None:  # a folder is passed over: the file is missing
            check_refusal(result, DATA_ERRORS, path, root)
            return
        plain = {k: gunzip(v) if case["gz"] else v for k, v in files.items()}
        images, labels = plain["train-images-idx3-ubyte"], plain["train-labels-idx1-ubyte"]
        expected = None if images is None or labels is None else mnist_expected(images, labels)
        if expected is None:
            check_refusal(result, DATA_ERRORS, path, root)
        else:
            assert "value" in result, result.get("traceback")
            assert result["value"] == [digest(expected[0]), digest(expected[1])]


@fast(12)
@given(mnist_cases)
def test_damaged_mnist_is_read_exactly_or_refused(sandbox, case):
    check_mnist(sandbox, case)


@pytest.mark.slow
@SLOW
@given(mnist_cases)
def test_damaged_mnist_is_read_exactly_or_refused_many(sandbox, case):
    check_mnist(sandbox, case)


# ------------------------------------------------------------------------- CIFAR-10
RECORDS = 3
CIFAR_FIELDS = [(r * 3073, 1, r % 10) for r in range(RECORDS)]
cifar_cases = st.fixed_dictionaries(
    {
        "mutations": byte_mutations(CIFAR_FIELDS, 3073 * RECORDS),
        "special": st.sampled_from([None] * 6 + SPECIALS),
    }
)


def check_cifar(sandbox: Sandbox, case: dict[str, Any]) -> None:
    with scratch() as folder:
        root = write_cifar(folder / "cifar", records=RECORDS)
        path = root / "test_batch.bin"
        damaged = apply(path.read_bytes(), case["mutations"])
        path.unlink()
        if case["special"] == "sparse":
            sparse(path, 30 * GiB, damaged)
        else:
            place(path, case["special"] or damaged)

        result = sandbox.call("radbo.data.readers:read_cifar10", str(root), train=False)

        whole = len(damaged) and len(damaged) % 3073 == 0
        records = np.frombuffer(damaged, dtype=np.uint8).reshape(-1, 3073) if whole else None
        if case["special"] is not None or records is None or int(records[:, 0].max()) > 9:
            check_refusal(result, DATA_ERRORS, path)
        else:
            assert "value" in result, result.get("traceback")
            images = records[:, 1:].reshape(-1, 3, 32, 32)
            assert result["value"] == [digest(images), digest(records[:, 0].copy())]


@fast(10)
@given(cifar_cases)
def test_damaged_cifar_is_read_exactly_or_refused(sandbox, case):
    check_cifar(sandbox, case)


@pytest.mark.slow
@SLOW
@given(cifar_cases)
def test_damaged_cifar_is_read_exactly_or_refused_many(sandbox, case):
    check_cifar(sandbox, case)


# --------------------------------------------------------------------------- LIBSVM
LIBSVM_TEXT = (
    b"# a9a-like\n+1 1:0.5 3:1 7:-2.25\n-1 2:1e-3 3:4\n\n2 qid:4 1:1 9:0.125 # a comment\n0 4:8\n"
)
LABELS = [
    b"9223372036854775807",
    b"-9223372036854775808",
    b"9007199254740993",
    b"9007199254740991",
    b"1e12",
    b"1e400",
    b"nan",
    b"inf",
    b"-0",
    b"+1",
    b"1.5",
    b"1.0",
    b"0x1",
    b"1_0",
    b"",
    b"qid:3",
    b"1:1",
]
INDEXES = [
    b"0",
    b"-1",
    b"1e12",
    b"1000000000000",
    b"2147483647",
    b"2147483648",
    b"18446744073709551616",
    b"01",
    b"1_0",
    b"a",
    b"",
    b"\xff",
]
VALUES = [b"nan", b"inf", b"-inf", b"1e400", b"1e-400", b"-0", b"0x1p3", b"1:2", b"", b"1e308"]
PAIRS = [b"1", b"::", b":1", b"1:", b"qid:1", b"qid", b"#", b"\x00", b"1:1\r", b"\xff:1", b"\x0b"]

numbers = st.integers(-20, 10_000).map(lambda i: str(i).encode())
token_edits = st.one_of(
    st.tuples(st.just("label"), st.integers(0, 9), st.sampled_from(LABELS) | numbers),
    st.tuples(
        st.just("index"), st.integers(0, 9), st.integers(0, 9), st.sampled_from(INDEXES) | numbers
    ),
    st.tuples(
        st.just("value"),
        st.integers(0, 9),
        st.integers(0, 9),
        st.sampled_from(VALUES) | st.floats().map(lambda f: repr(f).encode()),
    ),
    st.tuples(st.just("pair"), st.integers(0, 9), st.integers(0, 9), st.sampled_from(PAIRS)),
    st.tuples(st.just("dup"), st.integers(0, 9), st.integers(0, 9)),
    st.tuples(st.just("swap"), st.integers(0, 9)),
    st.tuples(st.just("line"), st.integers(0, 9), st.sampled_from(["copy", "drop", "blank"])),
)
text_mutations = st.lists(
    st.one_of(
        st.tuples(st.just("cut"), st.integers(0, 2**16)),
        st.tuples(st.just("append"), st.binary(min_size=1, max_size=32)),
        st.tuples(st.just("flip"), st.integers(0, 2**16), st.integers(1, 255)),
    ),
    max_size=2,
)
libsvm_cases = st.fixed_dictionaries(
    {
        "edits": st.lists(token_edits, min_size=1, max_size=3),
        "bytes": text_mutations,
        "compression": st.sampled_from(["", ".gz", ".bz2"]),
        "outer": byte_mutations(GZIP_FIELDS, 10, max_size=2) | st.just([]),
        "special": st.sampled_from([None] * 8 + SPECIALS),
    }
)


def edit_libsvm(text: bytes, edits: list[Mutation]) -> bytes:
    """``text`` with token edits: a line's label, a pair's index or value or the whole pair
    replaced, a pair repeated, two pairs swapped, a line copied, dropped or blanked."""
    lines = [line.split(b" ") for line in text.split(b"\n")]
    examples = [i for i, line in enumerate(lines) if line[0] and not line[0].startswith(b"#")]
    for edit in edits:
        kind, tokens = edit[0], lines[examples[edit[1] % len(examples)]]
        pairs = [i for i, t in enumerate(tokens) if b":" in t and not t.startswith(b"qid")]
        paired = kind in ("index", "value", "pair", "dup")
        at = pairs[edit[2] % len(pairs)] if pairs and paired else None
        if kind == "label":
            tokens[0] = edit[2]
        elif kind == "index" and at is not None:
            tokens[at] = edit[3] + b":" + tokens[at].split(b":", 1)[1]
        elif kind == "value" and at is not None:
            tokens[at] = tokens[at].split(b":", 1)[0] + b":" + edit[3]
        elif kind == "pair" and at is not None:
            tokens[at] = edit[3]
        elif kind == "dup" and at is not None:
            tokens.insert(at, tokens[at])
        elif kind == "swap" and len(pairs) > 1:
            tokens[pairs[0]], tokens[pairs[1]] = tokens[pairs[1]], tokens[pairs[0]]
        elif kind == "line":
            where = examples[edit[1] % len(examples)]
            if edit[2] == "copy":
                lines.insert(where, list(tokens))
            elif edit[2] == "drop":
                lines[where] = [b""]
            else:
                lines[where] = [b"  \t "]
    return b"\n".join(b" ".join(tokens) for tokens in lines)


def libsvm_expected(text: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """What reading LIBSVM ``text`` gives, or ``None`` where it must be refused: lines split
    at ``\\n``; ``#`` starts a comment (looked for before a NUL byte only, as the parser's C
    ``strchr`` does); tokens split at ASCII whitespace; an integer label within (-2**53,
    2**53); an optional first token ``qid...:...``; ``index:value`` pairs, indices 1-based,
    strictly increasing, at most 2**31 - 1, values finite (``-0`` is read as 0). Width: the
    largest index (1 without any); a dense array beyond 1 GiB must be refused (the sandbox's
    limit)."""
    rows: list[tuple[float, list[tuple[int, float]]]] = []
    for line in text.split(b"\n"):
        nul = line.find(b"\0")
        comment = line.find(b"#", 0, len(line) if nul < 0 else nul)
        parts = (line if comment < 0 else line[:comment]).split()
        if not parts:
            continue
        try:
            label = float(parts[0])
        except ValueError:
            return None
        features = parts[1:]
        if features and features[0].startswith(b"qid"):
            if b":" not in features[0]:
                return None
            features = features[1:]
        previous, pairs = 0, []
        for token in features:
            if b":" not in token:
                return None
            index_text, value_text = token.split(b":", 1)
            try:
                index, value = int(index_text), float(value_text)
            except ValueError:
                return None
            if not (previous < index <= 2**31 - 1) or not np.isfinite(value):
                return None
            pairs.append((index, value))
            previous = index
        if not np.isfinite(label) or label != int(label) or abs(label) >= 2**53:
            return None
        rows.append((label, pairs))
    width = max((i for _, pairs in rows for i, _ in pairs), default=1)
    if not rows or 8 * len(rows) * width > GiB:
        return None
    features_array = np.zeros((len(rows), width))
    for r, (_, pairs) in enumerate(rows):
        for index, value in pairs:
            features_array[r, index - 1] += value  # summed into zeros, as scipy does: -0 is 0
    return features_array, np.array([label for label, _ in rows], dtype=np.int64)


def check_libsvm(sandbox: Sandbox, case: dict[str, Any]) -> None:
    text = apply(edit_libsvm(LIBSVM_TEXT, case["edits"]), case["bytes"])
    compress = {"": bytes, ".gz": lambda t: gzip.compress(t, mtime=0), ".bz2": bz2.compress}
    stored = apply(compress[case["compression"]](text), case["outer"])
    with scratch() as folder:
        path = folder / f"data.svm{case['compression']}"
        if case["special"] == "sparse":
            sparse(path, 30 * GiB, stored)
        else:
            place(path, case["special"] or stored)

        result = sandbox.call("radbo.data.readers:read_libsvm", str(path), timeout=30)

        if case["special"] is not None:
            check_refusal(result, DATA_ERRORS, path)
            return
        if case["compression"] == ".gz":
            content = gunzip(stored)
        elif case["compression"] == ".bz2":
            try:
                content = bz2.decompress(stored)
            except (OSError, ValueError, EOFError):
                content = None
        else:
            content = stored
        expected = None if content is None else libsvm_expected(content)
        if expected is None:
            check_refusal(result, DATA_ERRORS, path)
        else:
            assert "value" in result, (result.get("message"), content)
            assert result["value"] == [digest(expected[0]), digest(expected[1])]


@fast(15)
@given(libsvm_cases)
def test_damaged_libsvm_is_read_exactly_or_refused(sandbox, case):
    check_libsvm(sandbox, case)


@pytest.mark.slow
@SLOW
@given(libsvm_cases)
def test_damaged_libsvm_is_read_exactly_or_refused_many(sandbox, case):
    check_libsvm(sandbox, case)


# ------------------------------------------------------------------------- Omniglot
# IHDR: width, height, bit depth, colour type, compression, filter, interlace; then the
# IDAT chunk's length
PNG_FIELDS = [
    (16, 4, 10),
    (20, 4, 10),
    (24, 1, 8),
    (25, 1, 0),
    (26, 1, 0),
    (27, 1, 0),
    (28, 1, 0),
    (33, 4, 17),
]
omniglot_cases = st.fixed_dictionaries(
    {
        "glyph": st.sampled_from(["char1/0.png", "char2/1.png"]),
        "mutations": byte_mutations(PNG_FIELDS, 41),
        "recrc": st.booleans(),  # checksums made right again, so the fields themselves count
        "special": st.sampled_from([None] * 6 + SPECIALS),
    }
)


def recrc(data: bytes) -> bytes:
    """``data`` with the CRC of every PNG chunk that is still whole recomputed."""
    out, at = bytearray(data[:8]), 8
    while at + 12 <= len(data):
        length = int.from_bytes(data[at : at + 4], "big")
        end = at + 8 + length
        if end + 4 > len(data):
            break
        out += data[at:end] + struct.pack(">I", zlib.crc32(data[at + 4 : end]))
        at = end + 4
    return bytes(out + data[at:])


def png_declares(data: bytes) -> int:
    """The pixels a PNG's IHDR declares (0 when there is no IHDR)."""
    if len(data) < 24 or data[12:16] != b"IHDR":
        return 0
    return int.from_bytes(data[16:20], "big") * int.from_bytes(data[20:24], "big")


def omniglot_expected(root: Path) -> list[Any]:
    """What reading ``root`` gives, decoded here by Pillow as radbo specifies: 8-bit gray,
    Lanczos-resized to 28 x 28, classes in sorted folder order."""
    from PIL import Image

    images, labels, names = [], [], []
    for c, character in enumerate(sorted((root / "alpha").iterdir())):
        names.append(f"alpha/{character.name}")
        for file in sorted(character.iterdir()):
            with Image.open(file) as image:
                gray = image.convert("L")
            if gray.size != (28, 28):
                gray = gray.resize((28, 28), Image.Resampling.LANCZOS)
            images.append(np.asarray(gray, dtype=np.uint8))
            labels.append(c)
    return [digest(np.stack(images)), digest(np.asarray(labels, dtype=np.int64)), names]


def check_omniglot(sandbox: Sandbox, case: dict[str, Any]) -> None:
    with scratch() as folder:
        root = write_omniglot(folder / "omniglot") / "images_background"
        path = root / "alpha" / case["glyph"]
        damaged = apply(png(), case["mutations"])
        if case["recrc"]:
            damaged = recrc(damaged)
        path.unlink()
        if case["special"] == "sparse":
            sparse(path, 30 * GiB, damaged)
        else:
            place(path, case["special"] or damaged)

        result = sandbox.call("radbo.data.readers:read_omniglot", str(root), timeout=30)

        if case["special"] is not None or png_declares(damaged) > 4096 * 4096:
            check_refusal(result, DATA_ERRORS, path)
        elif "raised" in result:  # whether Pillow decodes a damaged PNG is Pillow's call
            check_refusal(result, DATA_ERRORS, path)
        else:
            assert result["value"] == omniglot_expected(root)


@fast(12)
@given(omniglot_cases)
def test_damaged_omniglot_is_read_exactly_or_refused(sandbox, case):
    check_omniglot(sandbox, case)


@pytest.mark.slow
@SLOW
@given(omniglot_cases)
def test_damaged_omniglot_is_read_exactly_or_refused_many(sandbox, case):
    check_omniglot(sandbox, case)


# ---------------------------------------------------------------- fleet files, traces
NUMBER = re.compile(rb"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")
HOSTILE_TOKENS = [
    b"1e999",
    b"-1",
    b"0",
    b"nan",
    b"NaN",
    b"inf",
    b"9" * 5000,
    b"1e-400",
    b"0x10",
    b"true",
    b'"x"',
    b"[]",
    b"{}",
    b"null",
    b"1_000",
    b"[[[[1]]]]",
    b'"\\ud800"',
]
document_edits = st.lists(
    st.one_of(
        st.tuples(st.just("number"), st.integers(0, 99), st.sampled_from(HOSTILE_TOKENS)),
        st.tuples(st.just("line"), st.integers(0, 99), st.sampled_from(["copy", "drop"])),
        st.tuples(st.just("crlf")),
        st.tuples(st.just("bom")),
        st.tuples(st.just("insert"), st.integers(0, 2**16), st.sampled_from([b"\0", b"\xff"])),
    ),
    max_size=3,
)


def edit_document(text: bytes, edits: list[Mutation]) -> bytes:
    """``text`` (JSON or TOML) with a number replaced by a hostile token, a line copied (a
    duplicate key) or dropped, newlines made CRLF, a BOM put first, a NUL or an invalid
    UTF-8 byte inserted."""
    for edit in edits:
        kind = edit[0]
        if kind == "number":
            found = list(NUMBER.finditer(text))
            if found:
                m = found[edit[1] % len(found)]
                text = text[: m.start()] + edit[2] + text[m.end() :]
        elif kind == "line":
            lines = text.split(b"\n")
            at = edit[1] % len(lines)
            lines[at : at + 1] = [lines[at]] * 2 if edit[2] == "copy" else []
            text = b"\n".join(lines)
        elif kind == "crlf":
            text = text.replace(b"\n", b"\r\n")
        elif kind == "bom":
            text = b"\xef\xbb\xbf" + text
        else:
            text = apply(text, [edit])
    return text


def parse_document(data: bytes, suffix: str) -> Any:
    """``data`` as radbo reads a JSON or TOML table file: UTF-8, newlines translated, JSON
    without duplicate keys; ``None`` where it cannot be parsed."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({k for k, _ in pairs}) != len(pairs):
            raise ValueError("duplicate key")
        return dict(pairs)

    try:
        text = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=unique)
        return tomllib.loads(text)
    except (ValueError, RecursionError):
        return None


def fleet_expected(data: bytes, suffix: str) -> list[dict[str, Any]] | None:
    """The profiles a fleet file holds by its specification (``Fleet.from_file``'s
    docstring), or ``None`` where it must be refused."""
    doc = parse_document(data, suffix)
    if not isinstance(doc, dict) or set(doc) - {"format", "version", "device"}:
        return None
    if doc.get("format", "radbo-fleet") != "radbo-fleet" or doc.get("version", 1) != 1:
        return None
    devices = doc.get("device")
    if not isinstance(devices, list) or not devices:
        return None
    try:
        return [parse_profile(d).model_dump(mode="json") for d in devices]
    except ProfileError:
        return None


SPECIAL_LINES = {
    "fifo": "is a FIFO (named pipe), " + SPECIAL,
    "folder": "is a directory, " + SPECIAL,
    "dev-zero": "is a character device, " + SPECIAL,
    "sparse": (
        "holds 32212254720 bytes, more than the 268435456 a {what} may hold (about 190,000 "
        "device profiles or 4 million trace clients); radbo run --force lifts this cap"
    ),
}


def place_table(path: Path, data: bytes, special: str | None) -> None:
    if special == "sparse":
        sparse(path, 30 * GiB, data)
    else:
        place(path, special or data)


fleet_cases = st.fixed_dictionaries(
    {
        "suffix": st.sampled_from([".toml", ".json"]),
        "edits": document_edits,
        "bytes": text_mutations,
        "special": st.sampled_from([None] * 8 + SPECIALS),
    }
)
FLEET = Fleet.from_tiers({"phone_low": 1.0, "laptop_cpu": 1.0}, 2, seed=0)


def check_fleet(sandbox: Sandbox, case: dict[str, Any]) -> None:
    with scratch() as folder:
        path = folder / f"fleet{case['suffix']}"
        FLEET.to_file(path)
        data = apply(edit_document(path.read_bytes(), case["edits"]), case["bytes"])
        path.unlink()
        place_table(path, data, case["special"])

        result = sandbox.call("radbo.devices:Fleet.from_file", str(path), timeout=30)

        if case["special"] is not None:
            line = SPECIAL_LINES[case["special"]].format(what="fleet file")
            assert result.get("message") == f"device profile error: fleet file {path} {line}"
            assert result["raised"] == PROFILE_ERROR
            return
        expected = fleet_expected(data, case["suffix"])
        if expected is None:
            check_refusal(result, {PROFILE_ERROR}, path)
        else:
            assert result.get("value") == expected, result.get("message")


@fast(12)
@given(fleet_cases)
def test_damaged_fleet_files_are_read_exactly_or_refused(sandbox, case):
    check_fleet(sandbox, case)


@pytest.mark.slow
@SLOW
@given(fleet_cases)
def test_damaged_fleet_files_are_read_exactly_or_refused_many(sandbox, case):
    check_fleet(sandbox, case)


TRACE = {str(i): {"computation": 40.0 + i, "communication": 900.0 + 10 * i} for i in range(3)}
BEHAVIOR = {
    str(i): {"active": [0.0, 500.0], "inactive": [100.0, 900.0], "finish_time": 1000.0}
    for i in range(3)
}
trace_cases = st.fixed_dictionaries(
    {
        "suffix": st.sampled_from([".toml", ".json"]),
        "which": st.sampled_from(["trace", "behavior trace"]),
        "edits": document_edits,
        "bytes": text_mutations,
        "special": st.sampled_from([None] * 8 + SPECIALS),
    }
)


def table_text(doc: dict[str, Any], suffix: str) -> bytes:
    if suffix == ".json":
        return json.dumps(doc, indent=1).encode()
    lines = []
    for key, entry in doc.items():
        lines.append(f'["{key}"]')
        lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items()]
    return ("\n".join(lines) + "\n").encode()


def check_trace(sandbox: Sandbox, case: dict[str, Any]) -> None:
    suffix = case["suffix"]
    with scratch() as folder:
        trace, behavior = folder / f"trace{suffix}", folder / f"behavior{suffix}"
        trace.write_bytes(table_text(TRACE, suffix))
        behavior.write_bytes(table_text(BEHAVIOR, suffix))
        path = trace if case["which"] == "trace" else behavior
        data = apply(edit_document(path.read_bytes(), case["edits"]), case["bytes"])
        path.unlink()
        place_table(path, data, case["special"])

        result = sandbox.call(
            "radbo.devices:Fleet.from_trace",
            str(trace),
            flops_per_sample=1e6,
            memory_bytes=GiB,
            behavior=str(behavior),
            timeout=30,
        )

        if case["special"] is not None:
            line = SPECIAL_LINES[case["special"]].format(what=case["which"])
            expected = f"device profile error: {case['which']} {path} {line}"
            assert (result.get("raised"), result.get("message")) == (PROFILE_ERROR, expected)
            return
        doc = parse_document(data, suffix)
        if not isinstance(doc, dict) or not doc:
            check_refusal(result, {PROFILE_ERROR}, path)
        elif "raised" in result:  # a field's value: the profile validation's call
            check_refusal(result, {PROFILE_ERROR}, path)
        elif case["which"] == "trace":  # one client per id, in numeric order
            ids = sorted(int(k.strip()) for k in doc)
            computation = [float(doc[k]["computation"]) for k in sorted(doc, key=int)]
            assert [p["name"] for p in result["value"]] == [f"client {i}" for i in ids]
            assert [p["compute_flops"] for p in result["value"]] == [
                1e6 * 1000.0 / c for c in computation
            ]
        else:  # each client's period is its entry's finish_time (ids as integers)
            entries = {int(str(key).strip()): entry for key, entry in doc.items()}
            assert [p["period_s"] for p in result["value"]] == [
                float(entries[i]["finish_time"]) for i in range(3)
            ]


@fast(12)
@given(trace_cases)
def test_damaged_traces_are_read_exactly_or_refused(sandbox, case):
    check_trace(sandbox, case)


@pytest.mark.slow
@SLOW
@given(trace_cases)
def test_damaged_traces_are_read_exactly_or_refused_many(sandbox, case):
    check_trace(sandbox, case)


def test_the_valid_files_are_read_as_the_oracles_read_them(sandbox: Sandbox, tmp_path: Path):
    # the baseline every damaged file starts from: read, and equal to the oracles' reading
    mnist = write_mnist(tmp_path / "mnist", gz=True)
    cifar = write_cifar(tmp_path / "cifar", records=RECORDS)
    libsvm = tmp_path / "data.svm.bz2"
    libsvm.write_bytes(bz2.compress(LIBSVM_TEXT))
    omniglot = write_omniglot(tmp_path / "omniglot") / "images_background"
    FLEET.to_file(tmp_path / "fleet.json")
    (tmp_path / "trace.toml").write_bytes(table_text(TRACE, ".toml"))
    (tmp_path / "behavior.json").write_bytes(table_text(BEHAVIOR, ".json"))
    images, labels = (
        gunzip((mnist / f"train-{kind}.gz").read_bytes())
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte")
    )
    records = np.frombuffer((cifar / "test_batch.bin").read_bytes(), np.uint8).reshape(-1, 3073)

    assert images is not None and labels is not None
    expected_mnist = mnist_expected(images, labels)
    assert expected_mnist is not None
    assert sandbox.call("radbo.data.readers:read_mnist", str(mnist))["value"] == [
        digest(expected_mnist[0]),
        digest(expected_mnist[1]),
    ]
    assert sandbox.call("radbo.data.readers:read_cifar10", str(cifar), train=False)["value"] == [
        digest(records[:, 1:].reshape(-1, 3, 32, 32)),
        digest(records[:, 0].copy()),
    ]
    expected_libsvm = libsvm_expected(LIBSVM_TEXT)
    assert expected_libsvm is not None and expected_libsvm[0].shape == (4, 9)
    assert sandbox.call("radbo.data.readers:read_libsvm", str(libsvm))["value"] == [
        digest(expected_libsvm[0]),
        digest(expected_libsvm[1]),
    ]
    assert sandbox.call("radbo.data.readers:read_omniglot", str(omniglot))[
        "value"
    ] == omniglot_expected(omniglot)
    fleet = sandbox.call("radbo.devices:Fleet.from_file", str(tmp_path / "fleet.json"))
    assert fleet["value"] == fleet_expected((tmp_path / "fleet.json").read_bytes(), ".json")
    trace = sandbox.call(
        "radbo.devices:Fleet.from_trace",
        str(tmp_path / "trace.toml"),
        flops_per_sample=1e6,
        memory_bytes=GiB,
        behavior=str(tmp_path / "behavior.json"),
    )
    assert [p["period_s"] for p in trace["value"]] == [1000.0] * 3
