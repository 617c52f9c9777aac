"""Strict JSON out: every JSON file radbo writes (``results.json``, ``ledger.json``,
``aggregate.json``, ``report.json``, export manifests) is JSON that strict parsers (``jq``,
JavaScript's ``JSON.parse``, :func:`loads_strict`) accept.

Python's :func:`json.dumps` writes a float NaN or infinity as the bare words ``NaN`` /
``Infinity``, which are not JSON. :func:`dumps` writes them as ``null``; where the meaning of
such a figure matters, the code that computes it says why beside it (the savings fractions'
``reasons``, :func:`radbo.cost.savings`). Readers take ``null`` where a number is undefined.

>>> dumps({"a": float("nan"), "b": [1.5, float("inf")], "c": True})
'{"a": null, "b": [1.5, null], "c": true}'
>>> loads_strict('{"a": NaN}')
Traceback (most recent call last):
...
ValueError: not strict JSON: NaN is not a JSON value
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite", "loads_strict"]


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-infinity) replaced by ``None``, in dicts,
    lists and tuples (as lists) at any depth; other values as they are. ``obj`` is not
    changed: containers are copied where they hold such a float."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """:func:`json.dumps` of ``obj`` (``kw``: its keyword arguments, ``allow_nan`` excepted)
    with non-finite floats written as ``null`` (:func:`finite`): always strict JSON.

    The common case, no such float, costs one encoding pass; ``obj`` is copied only when it
    holds one."""
    if "allow_nan" in kw:
        raise TypeError("radbo.jsonio.dumps writes strict JSON: it takes no allow_nan")
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:  # "Out of range float values are not JSON compliant"
        return json.dumps(finite(obj), allow_nan=False, **kw)


def _refuse(constant: str) -> Any:
    raise ValueError(f"not strict JSON: {constant} is not a JSON value")


def loads_strict(text: str | bytes) -> Any:
    """:func:`json.loads` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (which Python
    accepts and strict parsers do not) with a :class:`ValueError`."""
    return json.loads(text, parse_constant=_refuse)
