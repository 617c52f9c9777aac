"""Validation errors as sentences: radbo's one reading of a pydantic ``ValidationError``.

Configs (:mod:`radbo.config`), device profiles and fleet files
(:mod:`radbo.devices.profile`) and checkpoints (:mod:`radbo.checkpoint`) are validated by
pydantic models, and each reports a refusal as lines ``PREFIX: FIELD = VALUE: what is
allowed``. What those lines share is here: :func:`problems` reads the error's entries once
(location, kind, the refused value, the validator's own sentence without pydantic's
``"Value error, "``), :func:`value_text` shows a value (tables as ``{...}``, long values
cut), :func:`field_path` names a nested field (``windows[0][1]``), :func:`problem_line`
writes one line and :func:`problem_lines` caps their number (``PREFIX: and K more
problems``). What differs -- how a config names its union members, a profile's hints of the
allowed values, a checkpoint's first problem only -- stays with each caller.

Kept free of every other radbo module (lowest import layer) so that any module may use it.
"""

from __future__ import annotations

import itertools
import re
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

__all__ = [
    "Problem",
    "field_path",
    "more_problems",
    "problem_line",
    "problem_lines",
    "problems",
    "value_text",
]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Problem:
    """One entry of a pydantic ``ValidationError``, as radbo's messages use it."""

    #: where: field names and list positions, outermost first (pydantic's ``loc``)
    loc: tuple[int | str, ...]
    #: pydantic's error type: ``"missing"``, ``"extra_forbidden"``, ``"value_error"``, ...
    type: str
    #: the value refused (for a missing field, the table it is missing from)
    value: Any
    #: what is wrong, in pydantic's words or the validator's sentence (no ``"Value error, "``)
    message: str


def problems(error: ValidationError) -> list[Problem]:
    """The entries of ``error``, in pydantic's order.

    >>> from pydantic import BaseModel
    >>> class M(BaseModel):
    ...     n: int
    >>> try:
    ...     M.model_validate({"n": "x"})
    ... except ValidationError as err:
    ...     problems(err)[0].loc, problems(err)[0].type
    (('n',), 'int_parsing')
    """
    return [
        Problem(
            loc=tuple(e["loc"]),
            type=e["type"],
            value=e.get("input"),
            message=e["msg"].removeprefix("Value error, "),
        )
        for e in error.errors(include_url=False, include_context=False)
    ]


def value_text(value: Any, limit: int = 100) -> str:
    """``value`` as a message shows it: a table as ``{...}``, anything else as its ``repr``,
    cut to ``limit`` characters (the last three ``...``).

    >>> value_text({"a": 1}), value_text("x" * 200, limit=10)
    ('{...}', "'xxxxxx...")
    """
    if isinstance(value, Mapping):
        return "{...}"
    try:
        text = repr(value)
    except RecursionError:  # a list nested thousands deep (possible from Python, not TOML)
        text = reprlib.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_path(loc: Iterable[int | str]) -> str:
    """A nested field's name: positions as ``[i]``, names joined by dots, a name that is no
    identifier quoted in brackets.

    >>> field_path(("windows", 0, 1)), field_path(("rows", 2, "a b"))
    ('windows[0][1]', "rows[2]['a b']")
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _IDENTIFIER.fullmatch(str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{str(part)!r}]"
    return out


def problem_line(prefix: str, where: str, value: str, message: str) -> str:
    """One problem as one line: ``PREFIX: WHERE = VALUE: MESSAGE``."""
    return f"{prefix}: {where} = {value}: {message}"


def more_problems(count: int) -> str:
    """``and K more problem(s)``, the words for problems left out.

    >>> more_problems(1), more_problems(1234)
    ('and 1 more problem', 'and 1,234 more problems')
    """
    return f"and {count:,} more problem{'s' if count > 1 else ''}"


def problem_lines(lines: Iterable[str], count: int, *, prefix: str, max_lines: int | None) -> str:
    """The first ``max_lines`` of the ``count`` ``lines`` (``None``: all), then one line
    ``PREFIX: and K more problems`` for the rest. Lines past the cap are never made, so
    ``lines`` may be a generator that builds each line only when it is shown."""
    if max_lines is None or count <= max_lines:
        return "\n".join(lines)
    shown = list(itertools.islice(lines, max_lines))
    return "\n".join([*shown, f"{prefix}: {more_problems(count - max_lines)}"])
