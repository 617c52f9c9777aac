"""Strict field types for the JSON radbo writes and reads back (checkpoints): each component
declares the schema of its own saved state with them, beside the code that writes it (the
ledger row beside :class:`radbo.cost.LedgerEntry`, a coverage round beside
:class:`radbo.masks.coverage_report.RoundCoverage`, ...), and :mod:`radbo.checkpoint` validates
a file against the schemas its caller hands it.

A number radbo writes as a float must come back as a float (``0`` for ``0.0`` is an edit, which
a resumed run would turn into another JSON number than the uninterrupted run's), counts are
integers >= 0, and amounts (seconds, FLOPs' prices, joules) are finite and not negative.

>>> from pydantic import TypeAdapter
>>> TypeAdapter(Amount).validate_python(1.5)
1.5
>>> TypeAdapter(Amount).validate_python(0)
Traceback (most recent call last):
...
pydantic_core._pydantic_core.ValidationError: 1 validation error for function-before[...]
  Value error, 0 is an integer, where radbo writes a float ...
"""

from __future__ import annotations

import math
from typing import Annotated, Any, TypeGuard

from pydantic import BeforeValidator, Field, Strict, StrictInt

__all__ = [
    "Amount",
    "Count",
    "Fraction",
    "Joules",
    "is_count",
    "is_finite",
    "is_number",
    "short",
]


def _written_as_float(value: Any) -> Any:
    """Refuse an integer where radbo writes a float."""
    if isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(f"{value!r} is an integer, where radbo writes a float")
    return value


_Float = BeforeValidator(_written_as_float)
#: an integer >= 0 (not a boolean, not a float)
Count = Annotated[StrictInt, Field(ge=0)]
#: seconds and the like: a finite float >= 0
Amount = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False), _Float]
#: a finite float in [0, 1]
Fraction = Annotated[float, Strict(), Field(ge=0, le=1, allow_inf_nan=False), _Float]
#: joules: a finite float >= 0, or None when the device gave no figure
Joules = Annotated[float | None, Strict(), Field(ge=0, allow_inf_nan=False), _Float]


def is_number(value: Any) -> TypeGuard[int | float]:
    """An int or a float, not a boolean."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite(value: Any) -> TypeGuard[int | float]:
    """A finite number (an int of any size is finite; a JSON float is at most 1.8e308)."""
    return is_number(value) and (isinstance(value, int) or math.isfinite(value))


def is_count(value: Any) -> TypeGuard[int]:
    """An integer >= 0, not a boolean."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def short(value: Any, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters for a one-line message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
