"""radbo's one atomic write (radbo.atomic) and one TOML writer (radbo.tomlfile.toml_value)."""

from __future__ import annotations

import errno
import math
import tomllib
from pathlib import Path

import pytest

from radbo.atomic import atomic_write, atomic_write_bytes, atomic_write_text
from radbo.tomlfile import toml_lines, toml_string, toml_value


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "a.bin"
    atomic_write_bytes(path, b"old")
    atomic_write_text(path, "néw\n")
    assert path.read_bytes() == "néw\n".encode()
    assert list(path.parent.iterdir()) == [path]


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    atomic_write_text(path, "{}")

    def full_disk(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, full_disk)
    assert path.read_text() == "{}"
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize(
    "text", ['a "b" \\ c', "tab\there\nnew line", "\x00\x01\x1f\x7f\r\b\f", "é ü 中 🙂", ""]
)
def test_a_toml_string_reads_back_as_written(text: str) -> None:
    assert tomllib.loads(f"v = {toml_string(text)}")["v"] == text


def test_toml_values_read_back_as_written() -> None:
    values = {
        "flag": True,
        "count": -3,
        "lr": 0.1,
        "tiny": 5e-324,
        "name": 'x "y"',
        "windows": [[0.0, 1.5], [2.0, 3.0]],
        "dotted.key": {"a b": 1, "c": ["d"]},
    }
    assert tomllib.loads("\n".join(toml_lines(values))) == values
    read = tomllib.loads(f"a = {toml_value(math.nan)}\nb = {toml_value(-math.inf)}")
    assert math.isnan(read["a"]) and read["b"] == -math.inf
    with pytest.raises(TypeError, match="cannot write NoneType"):
        toml_value(None)
