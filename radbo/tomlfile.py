"""Reading a TOML file into a dict, with every failure as one :class:`ConfigError` line; and
radbo's one TOML writer (:func:`toml_value`, :func:`toml_lines`), for the files radbo writes
(fleet files, Flower run, node and connection configs) and the values the README shows.

Kept free of PyTorch (and of radbo's config classes, which sit beside torch code) so that the
command line reports a missing, unreadable or malformed config file before it imports them:
within a tenth of a second instead of the seconds importing torch takes."""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from radbo.limits import MAX_CONFIG_BYTES
from radbo.registry import ConfigError

__all__ = ["read_toml", "toml_key", "toml_lines", "toml_string", "toml_value"]

#: A key TOML takes without quotes.
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def read_toml(path: str | Path, *, max_bytes: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """The TOML document at ``path``; :class:`ConfigError` (one line naming ``path``) when it
    is missing, not a regular file (a folder, a FIFO, a device), larger than ``max_bytes``
    (:data:`radbo.limits.MAX_CONFIG_BYTES`: checked from its size before it is read, and no
    more than that is ever read), unreadable, not UTF-8 or not valid TOML."""
    path = Path(path)
    too_large = (
        f"config error: {path} is larger than {max_bytes:,} bytes, the most a config file may have"
    )
    try:
        if not path.is_file():
            raise ConfigError(f"config error: {path} does not exist or is not a file")
        if path.stat().st_size > max_bytes:
            raise ConfigError(too_large)
        with path.open("rb") as file:
            raw = file.read(max_bytes + 1)  # bounded even if the file grew since the stat
    except OSError as err:  # unreadable, or a name too long for the file system
        raise ConfigError(f"config error: {path} cannot be read: {err.strerror or err}") from None
    if len(raw) > max_bytes:
        raise ConfigError(too_large)
    try:
        # newlines translated as text mode would (Path.read_text): \r\n and \r become \n
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        return tomllib.loads(text)
    except ValueError as err:  # TOMLDecodeError, UnicodeDecodeError, an integer of 4300+ digits
        raise ConfigError(f"config error: {path} is not valid TOML: {err}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays or tables
        raise ConfigError(
            f"config error: {path} is not valid TOML: arrays or tables nested too deeply"
        ) from None


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: ``"`` and ``\\`` escaped, newline and tab as ``\\n``
    and ``\\t``, every other control character (and DEL) as ``\\uXXXX``, everything else
    (non-ASCII included) as it is.

    >>> print(toml_string('a "b" \\\\ \u00e9\\n'))
    "a \\"b\\" \\\\ \u00e9\\n"
    """
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def toml_key(key: str) -> str:
    """``key`` bare when TOML allows it (letters, digits, ``_`` and ``-``), else quoted."""
    return key if _BARE_KEY.match(key) else toml_string(key)


def toml_value(value: object) -> str:
    """``value`` as a TOML value: booleans, integers, floats (the shortest ``repr``, which
    reads back exactly; ``nan``, ``inf``, ``-inf``), strings (:func:`toml_string`), lists and
    tuples as arrays, mappings as inline tables. :class:`TypeError` for anything else (TOML
    has no null).

    >>> toml_value({"a": [1, 0.5, True], "b c": "x"})
    '{a = [1, 0.5, true], "b c" = "x"}'
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as a TOML value")


def toml_lines(values: Mapping[str, object]) -> list[str]:
    """One ``key = value`` line per item of ``values`` (the body of a TOML table).

    >>> toml_lines({"partition-id": 3, "data.root": "/d"})
    ['partition-id = 3', '"data.root" = "/d"']
    """
    return [f"{toml_key(key)} = {toml_value(value)}" for key, value in values.items()]
