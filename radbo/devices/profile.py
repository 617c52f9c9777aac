"""What one client device can do: :class:`DeviceProfile` and its boundary validation.

A profile carries the numbers the simulator needs to turn a client's work into time: sustained
compute (FLOP/s), memory available for training (bytes), uplink and downlink bandwidth (bit/s),
the probability of being available in a round, and optionally energy per FLOP and radio energy
per byte sent and received. Profiles are
validated at the boundary (catalog, fleet files, traces, user dicts) by :func:`parse_profile`,
which turns pydantic's errors into one line per problem::

    device profile error: compute_flops = -1.0: Input should be greater than or equal to 1
    (allowed: a number in [1, 1e21], sustained FP32 training throughput in FLOP/s)

>>> p = parse_profile({"name": "toy", "compute_flops": 1e9, "memory_bytes": 2**20,
...                    "uplink_bps": 1e6, "downlink_bps": 1e7})
>>> (p.compute_flops, p.availability, p.tier)
(1000000000.0, 1.0, '')
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from radbo.errors import Problem, field_path, problem_line, problems, value_text
from radbo.registry import ConfigError

__all__ = [
    "DAY_S",
    "DeviceProfile",
    "ProfileError",
    "format_profile_errors",
    "parse_profile",
    "window_covers",
    "window_share",
]

DAY_S = 86400.0
"""Default ``period_s`` of availability windows: one day, for a daily pattern."""

_PositiveFloat = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]
_Probability = Annotated[StrictFloat, Field(ge=0, le=1, allow_inf_nan=False)]
# Physical ranges: no device trains at under 1 FLOP/s or over 1e21 (a zettaFLOP/s, 10^5 times
# today's largest accelerators), or talks at under 1 bit/s or over 1e15 (a petabit/s); beyond
# them the simulated step and transfer times overflow to inf (or a budget's steps do).
_Flops = Annotated[StrictFloat, Field(ge=1, le=1e21, allow_inf_nan=False)]
_Bandwidth = Annotated[StrictFloat, Field(ge=1, le=1e15, allow_inf_nan=False)]
_Seconds = Annotated[StrictFloat, Field(allow_inf_nan=False)]
Window = tuple[float, float]
"""An availability window ``(start_s, end_s)``: on from ``start_s`` (inclusive) to ``end_s``
(exclusive), in seconds from the start of a period."""


def window_covers(windows: tuple[Window, ...], period_s: float, clock_s: float) -> bool:
    """Whether one of ``windows`` covers the virtual time ``clock_s`` (seconds).

    The windows repeat every ``period_s``: ``clock_s`` is reduced to its phase
    ``clock_s % period_s`` (exact in floating point for ``clock_s >= 0``) and a window
    ``(start, end)`` covers it when ``start <= phase < end``. No windows: always covered.

    >>> night = ((0.0, 21600.0), (79200.0, 86400.0))  # 22:00 to 06:00, daily
    >>> [window_covers(night, 86400.0, t) for t in (3600.0, 43200.0, 86400.0 + 80000.0)]
    [True, False, True]
    """
    if not windows:
        return True
    phase = clock_s % period_s
    return any(start <= phase < end for start, end in windows)


def window_share(windows: tuple[Window, ...], period_s: float) -> float:
    """The share of each period that ``windows`` cover, in [0, 1]; 1.0 without windows.

    >>> window_share(((0.0, 100.0),), 200.0)
    0.5
    """
    if not windows:
        return 1.0
    return math.fsum(end - start for start, end in windows) / period_s


class ProfileError(ConfigError):
    """A device profile (or a fleet/trace file of them) is invalid; the message is user-facing,
    one line per problem: ``device profile error: FIELD = VALUE: what is allowed``. A
    :class:`radbo.config.ConfigError` (and so a ``ValueError``): ``radbo`` reports it as one
    line with exit code 2."""


class DeviceProfile(BaseModel):
    """Capabilities of one client device, in SI units.

    Frozen and strict: floats reject NaN, infinities, strings and bools; ``memory_bytes`` must be
    a true ``int``. Unknown keys are errors. Build one from untrusted data with
    :func:`parse_profile` to get readable errors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[StrictStr, Field(min_length=1)]
    """Human-readable device name (non-empty)."""
    compute_flops: _Flops
    """Sustained FP32 training throughput, FLOP/s (not peak marketing TOPS)."""
    memory_bytes: Annotated[StrictInt, Field(gt=0)]
    """Memory available for training (weights, gradients, optimizer state, activations), bytes."""
    uplink_bps: _Bandwidth
    """Client -> server bandwidth, bit/s."""
    downlink_bps: _Bandwidth
    """Server -> client bandwidth, bit/s."""
    availability: _Probability = 1.0
    """Probability that the device is available in a given round, in [0, 1]."""
    period_s: _PositiveFloat = DAY_S
    """Length of the cycle ``windows`` repeat with, in simulated seconds (default: one day)."""
    windows: tuple[tuple[_Seconds, _Seconds], ...] = ()
    """On/off availability windows ``[[start_s, end_s], ...]`` on the virtual clock: the device
    can be sampled for a round only when a window covers the round's start (reduced modulo
    ``period_s``), and then with probability ``availability``. Each window needs
    ``0 <= start_s < end_s <= period_s``; windows must not overlap (they may touch), and are
    kept sorted by start. Empty (default): always on, only ``availability`` applies. A window
    across the period's end (a night, 22:00 to 06:00) is two windows: ``[[0, 21600],
    [79200, 86400]]``."""
    energy_per_flop: _PositiveFloat | None = None
    """Joules per FLOP, if known (compute energy = FLOPs x this)."""
    energy_per_byte_up: _PositiveFloat | None = None
    """Joules per byte sent (client -> server, radio), if known; given together with
    ``energy_per_byte_down``."""
    energy_per_byte_down: Annotated[_PositiveFloat | None, Field(validate_default=True)] = None
    """Joules per byte received (server -> client, radio), if known; given together with
    ``energy_per_byte_up`` (radio energy = bytes up x J/byte up + bytes down x J/byte down)."""
    tier: StrictStr = ""
    """Free label, e.g. ``mcu``, ``sbc``, ``edge-gpu``, ``phone-mid``, ``laptop``."""
    source: StrictStr = ""
    """Where the numbers come from (URL or paper, and what was measured or assumed)."""

    @field_validator("windows")
    @classmethod
    def _check_windows(
        cls, windows: tuple[Window, ...], info: ValidationInfo
    ) -> tuple[Window, ...]:
        period = info.data.get("period_s")  # absent when period_s itself is invalid
        for start, end in windows:
            if not start < end:
                raise ValueError(
                    f"window [{start!r}, {end!r}] must end after it starts (start_s < end_s)"
                )
            if start < 0 or (period is not None and end > period):
                bound = "period_s" if period is None else repr(period)
                raise ValueError(
                    f"window [{start!r}, {end!r}] lies outside the period [0, {bound}] "
                    "(0 <= start_s < end_s <= period_s)"
                )
        ordered = tuple(sorted(windows))
        for (a, b), (c, d) in zip(ordered, ordered[1:], strict=False):
            if c < b:
                raise ValueError(
                    f"windows [{a!r}, {b!r}] and [{c!r}, {d!r}] overlap (merge them into one)"
                )
        return ordered

    @field_validator("energy_per_byte_down")
    @classmethod
    def _check_radio_pair(cls, down: float | None, info: ValidationInfo) -> float | None:
        # an invalid energy_per_byte_up is absent from info.data and reported on its own
        if "energy_per_byte_up" in info.data and (info.data["energy_per_byte_up"] is None) != (
            down is None
        ):
            raise ValueError(
                "energy_per_byte_up and energy_per_byte_down go together: give both or "
                "leave both out"
            )
        return down

    def available_at(self, clock_s: float) -> bool:
        """Whether a window covers the virtual time ``clock_s`` (:func:`window_covers`); the
        per-round probability ``availability`` is drawn separately, by the engine."""
        return window_covers(self.windows, self.period_s, clock_s)

    @property
    def window_share(self) -> float:
        """The share of time a window is open (:func:`window_share`; 1.0 without windows)."""
        return window_share(self.windows, self.period_s)

    @property
    def available_share(self) -> float:
        """Expected share of rounds the device is available for: window share x
        ``availability`` (rounds starting at uniformly spread times)."""
        return self.window_share * self.availability


# What each field allows, appended to pydantic's message so the line says how to fix it.
_ALLOWED: dict[str, str] = {
    "name": "a non-empty string",
    "compute_flops": "a number in [1, 1e21], sustained FP32 training throughput in FLOP/s",
    "memory_bytes": "an integer > 0, memory available for training in bytes",
    "uplink_bps": "a number in [1, 1e15], uplink bandwidth in bit/s",
    "downlink_bps": "a number in [1, 1e15], downlink bandwidth in bit/s",
    "availability": "a finite number in [0, 1], probability of being available in a round",
    "period_s": "a finite number > 0, seconds after which the windows repeat (default 86400)",
    "windows": "a list of [start_s, end_s] with 0 <= start_s < end_s <= period_s, finite and "
    "not overlapping, or leave it out",
    "energy_per_flop": "a finite number > 0 in joules per FLOP, or leave it out",
    "energy_per_byte_up": "a finite number > 0 in joules per byte sent, together with "
    "energy_per_byte_down, or leave both out",
    "energy_per_byte_down": "a finite number > 0 in joules per byte received, together with "
    "energy_per_byte_up, or leave both out",
    "tier": "a string label, e.g. 'phone-mid'",
    "source": "a string naming where the numbers come from",
}


def format_profile_errors(error: ValidationError, where: str = "") -> str:
    """One line per problem: ``device profile error: WHERE FIELD = VALUE: message (allowed: ...)``.

    ``where`` prefixes the field location, e.g. ``"device[3]."`` for the fourth client of a fleet
    file, so the line names both the client and the field.
    """
    return "\n".join(_problem_line(p, where) for p in problems(error))


def _problem_line(problem: Problem, where: str) -> str:
    """One problem of a profile as one line, with the allowed values of its field."""
    loc = problem.loc
    window = len(loc) > 1 and problem.type in ("missing", "too_long")  # of 1 or 3 numbers
    if window:
        loc = loc[:2]
    field = field_path(loc)  # nested items as field[i][j], e.g. windows[0][1]
    location = f"{where}{field}" if field else (where.rstrip(".") or "<profile>")
    value = "<missing>" if problem.type == "missing" and not window else _value_text(problem.value)
    if window:
        msg = "expected a pair [start_s, end_s]"
    elif problem.type == "missing":
        msg = "Field required"
    elif problem.type == "extra_forbidden":
        msg = "unknown field (check the spelling; allowed fields: " + ", ".join(_ALLOWED) + ")"
    elif problem.type == "tuple_type":
        msg = "Input should be a list"
    else:  # pydantic's words, or a validator's sentence without pydantic's prefix
        msg = problem.message
    hint = _ALLOWED.get(str(loc[0])) if loc else None
    if hint and problem.type != "extra_forbidden":
        msg = f"{msg} (allowed: {hint})"
    return problem_line("device profile error", location, value, msg)


def _value_text(value: Any) -> str:
    """A value as a profile error shows it (:func:`radbo.errors.value_text`, 80 characters)."""
    return value_text(value, limit=80)


def parse_profile(data: Mapping[str, Any], *, where: str = "") -> DeviceProfile:
    """Validate a mapping into a :class:`DeviceProfile`.

    Raises :class:`ProfileError` with one line per problem, naming the field (prefixed by
    ``where``, e.g. ``"device[3]."``), the bad value and what is allowed. Never raises another
    exception type for bad content.
    """
    if not isinstance(data, Mapping):
        location = where.rstrip(".") or "<profile>"
        raise ProfileError(
            f"device profile error: {location} = {_value_text(data)}: expected a table of "
            f"fields ({', '.join(_ALLOWED)})"
        )
    try:
        return DeviceProfile.model_validate(dict(data))
    except ValidationError as err:
        raise ProfileError(format_profile_errors(err, where)) from None
