"""Reading a TOML file into a dict, with every failure as one :class:`ConfigError` line.

Kept free of PyTorch (and of radbo's config classes, which sit beside torch code) so that the
command line reports a missing, unreadable or malformed config file before it imports them:
within a tenth of a second instead of the seconds importing torch takes."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from radbo.limits import MAX_CONFIG_BYTES
from radbo.registry import ConfigError

__all__ = ["read_toml"]


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
