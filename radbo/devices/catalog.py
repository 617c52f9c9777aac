"""The shipped catalog of real devices (``catalog.toml``), from microcontroller to laptop.

Each entry cites the source of every number in its ``source`` field (vendor data sheets for
memory, published HPL/GEMM benchmark results for compute, Ookla figures for bandwidth) and says
which values are engineering estimates or assumptions.

>>> catalog = load_catalog()
>>> catalog["raspberry_pi_4"].tier
'sbc'
>>> get_device("raspberry_pi_4") == catalog["raspberry_pi_4"]
True
"""

from __future__ import annotations

import difflib
import tomllib
from functools import lru_cache
from importlib import resources

from radbo.devices.profile import DeviceProfile, ProfileError, parse_profile

__all__ = ["get_device", "load_catalog"]

_CATALOG_FILE = "catalog.toml"


@lru_cache(maxsize=1)
def _catalog_items() -> tuple[tuple[str, DeviceProfile], ...]:
    text = resources.files("radbo.devices").joinpath(_CATALOG_FILE).read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:  # a packaging bug, not user input
        raise ProfileError(
            f"device profile error: {_CATALOG_FILE} is not valid TOML: {err}"
        ) from None
    return tuple((key, parse_profile(entry, where=f"{key}.")) for key, entry in data.items())


def load_catalog() -> dict[str, DeviceProfile]:
    """All shipped devices, keyed by short id (``esp32_s3``, ``raspberry_pi_4``, ...).

    The file is read once (packaged with radbo, found via :mod:`importlib.resources`); each call
    returns a fresh dict of the same frozen profiles.
    """
    return dict(_catalog_items())


def unknown_device_message(name: object, known: list[str]) -> str:
    """``unknown device 'x': known devices are a, b, c (did you mean 'y'?)``."""
    message = f"unknown device {name!r}: known devices are {', '.join(sorted(known))}"
    if isinstance(name, str):
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            message += f" (did you mean {close[0]!r}?)"
    return message


def get_device(name: str) -> DeviceProfile:
    """The catalog profile with short id ``name``.

    Raises :class:`ValueError` listing the known ids (and the closest match) when ``name`` is not
    in the catalog.
    """
    catalog = load_catalog()
    try:
        return catalog[name]
    except (KeyError, TypeError):
        raise ValueError(unknown_device_message(name, list(catalog))) from None
