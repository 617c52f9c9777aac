"""What one client device can do: :class:`DeviceProfile` and its boundary validation.

A profile carries the numbers the simulator needs to turn a client's work into time: sustained
compute (FLOP/s), memory available for training (bytes), uplink and downlink bandwidth (bit/s),
the probability of being available in a round, and optionally energy per FLOP. Profiles are
validated at the boundary (catalog, fleet files, traces, user dicts) by :func:`parse_profile`,
which turns pydantic's errors into one line per problem::

    device profile error: compute_flops = -1.0: Input should be greater than 0
    (allowed: a finite number > 0, sustained FP32 training throughput in FLOP/s)

>>> p = parse_profile({"name": "toy", "compute_flops": 1e9, "memory_bytes": 2**20,
...                    "uplink_bps": 1e6, "downlink_bps": 1e7})
>>> (p.compute_flops, p.availability, p.tier)
(1000000000.0, 1.0, '')
"""

from __future__ import annotations

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
)

__all__ = ["DeviceProfile", "ProfileError", "format_profile_errors", "parse_profile"]

_PositiveFloat = Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)]
_Probability = Annotated[StrictFloat, Field(ge=0, le=1, allow_inf_nan=False)]


class ProfileError(ValueError):
    """A device profile (or a fleet/trace file of them) is invalid; the message is user-facing,
    one line per problem: ``device profile error: FIELD = VALUE: what is allowed``."""


class DeviceProfile(BaseModel):
    """Capabilities of one client device, in SI units.

    Frozen and strict: floats reject NaN, infinities, strings and bools; ``memory_bytes`` must be
    a true ``int``. Unknown keys are errors. Build one from untrusted data with
    :func:`parse_profile` to get readable errors.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[StrictStr, Field(min_length=1)]
    """Human-readable device name (non-empty)."""
    compute_flops: _PositiveFloat
    """Sustained FP32 training throughput, FLOP/s (not peak marketing TOPS)."""
    memory_bytes: Annotated[StrictInt, Field(gt=0)]
    """Memory available for training (weights, gradients, optimizer state, activations), bytes."""
    uplink_bps: _PositiveFloat
    """Client -> server bandwidth, bit/s."""
    downlink_bps: _PositiveFloat
    """Server -> client bandwidth, bit/s."""
    availability: _Probability = 1.0
    """Probability that the device is available in a given round, in [0, 1]."""
    energy_per_flop: _PositiveFloat | None = None
    """Joules per FLOP, if known."""
    tier: StrictStr = ""
    """Free label, e.g. ``mcu``, ``sbc``, ``edge-gpu``, ``phone-mid``, ``laptop``."""
    source: StrictStr = ""
    """Where the numbers come from (URL or paper, and what was measured or assumed)."""


# What each field allows, appended to pydantic's message so the line says how to fix it.
_ALLOWED: dict[str, str] = {
    "name": "a non-empty string",
    "compute_flops": "a finite number > 0, sustained FP32 training throughput in FLOP/s",
    "memory_bytes": "an integer > 0, memory available for training in bytes",
    "uplink_bps": "a finite number > 0, uplink bandwidth in bit/s",
    "downlink_bps": "a finite number > 0, downlink bandwidth in bit/s",
    "availability": "a finite number in [0, 1], probability of being available in a round",
    "energy_per_flop": "a finite number > 0 in joules per FLOP, or leave it out",
    "tier": "a string label, e.g. 'phone-mid'",
    "source": "a string naming where the numbers come from",
}


def _value_text(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{...}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def format_profile_errors(error: ValidationError, where: str = "") -> str:
    """One line per problem: ``device profile error: WHERE FIELD = VALUE: message (allowed: ...)``.

    ``where`` prefixes the field location, e.g. ``"device[3]."`` for the fourth client of a fleet
    file, so the line names both the client and the field.
    """
    lines = []
    for e in error.errors():
        field = ".".join(str(p) for p in e["loc"])
        location = f"{where}{field}" if field else (where.rstrip(".") or "<profile>")
        if e["type"] == "missing":
            value_text = "<missing>"
            msg = "Field required"
        elif e["type"] == "extra_forbidden":
            value_text = _value_text(e.get("input"))
            msg = "unknown field (check the spelling; allowed fields: " + ", ".join(_ALLOWED) + ")"
        else:
            value_text = _value_text(e.get("input"))
            msg = e["msg"]
        hint = _ALLOWED.get(field)
        if hint and e["type"] != "extra_forbidden":
            msg = f"{msg} (allowed: {hint})"
        lines.append(f"device profile error: {location} = {value_text}: {msg}")
    return "\n".join(lines)


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
