"""Reading a TOML file into a dict, with every failure as one :class:`ConfigError` line.

Kept free of PyTorch (and of radbo's config classes, which sit beside torch code) so that the
command line reports a missing, unreadable or malformed config file before it imports them:
within a tenth of a second instead of the seconds importing torch takes."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from radbo.registry import ConfigError

__all__ = ["read_toml"]


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML document at ``path``; :class:`ConfigError` (one line naming ``path``) when it
    is missing, not a file, unreadable, not UTF-8 or not valid TOML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config error: {path} does not exist or is not a file")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:  # TOMLDecodeError, UnicodeDecodeError, an integer of 4300+ digits
        raise ConfigError(f"config error: {path} is not valid TOML: {err}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays or tables
        raise ConfigError(
            f"config error: {path} is not valid TOML: arrays or tables nested too deeply"
        ) from None
    except OSError as err:
        raise ConfigError(f"config error: {path} cannot be read: {err.strerror or err}") from None
