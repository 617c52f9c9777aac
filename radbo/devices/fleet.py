"""A :class:`Fleet`: the device profile of every client, in client order.

Client ``i`` of a fleet has profile ``fleet[i]``. Fleets are built from a tier mix of catalog
devices (:meth:`Fleet.from_tiers`, deterministic given a seed), from a FedScale-style capacity
trace (:meth:`Fleet.from_trace`), or from a readable fleet file (:meth:`Fleet.from_file`, written
by :meth:`Fleet.to_file`). Files are JSON or TOML, never pickle, and loading never executes code.

>>> fleet = Fleet.from_tiers({"raspberry_pi_4": 0.5, "phone_mid": 0.5}, num_clients=4, seed=0)
>>> sorted(fleet.tiers())
['phone-mid', 'phone-mid', 'sbc', 'sbc']
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeGuard, overload

import numpy as np
import torch
from torch import Tensor

from radbo.atomic import atomic_write_bytes
from radbo.data.readers import open_regular_file, read_at_most
from radbo.devices.catalog import load_catalog, unknown_device_message
from radbo.devices.profile import DAY_S, DeviceProfile, ProfileError, parse_profile
from radbo.limits import caps_are_lifted
from radbo.tomlfile import toml_lines

__all__ = ["FLEET_FORMAT", "Fleet", "WindowSchedule", "largest_remainder_counts"]

FLEET_FORMAT = "radbo-fleet"
"""Value of the ``format`` key written at the top of every fleet file."""
_FLEET_VERSION = 1
_TRACE_FIELDS = ("computation", "communication")
# FedScale's client behaviour trace: on at active[i], off at inactive[i], repeating after
# finish_time; duration and model are read past (FedScale does not use them for availability)
_BEHAVIOR_FIELDS = ("active", "inactive", "finish_time")
_BEHAVIOR_IGNORED = ("duration", "model")
#: The largest fleet file, trace or behaviour trace read without ``radbo run --force``:
#: 256 MiB, about 190,000 device profiles as :meth:`Fleet.to_file` writes them (1.4 kB each
#: with the catalog's source notes) or 4 million trace clients. Parsed, such a file takes
#: several times its size in memory; a file far larger is a mistake (or a sparse file of
#: gigabytes). With ``--force`` a file may take up to a quarter of this machine's memory.
MAX_TABLE_FILE_BYTES = 256 << 20


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_finite_number(value: object, *, strict: bool = True) -> bool:
    """``value`` is an int/float (not bool), finite, and ``> 0`` (``>= 0`` if not strict)."""
    if not _is_number(value):
        return False
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return False
    if not math.isfinite(number):
        return False
    return number > 0 if strict else number >= 0


def largest_remainder_counts(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` items over ``weights`` by the largest-remainder (Hamilton) method.

    Each entry first gets ``floor(total * w / sum(w))``; the items left over go, one each, to the
    entries with the largest fractional remainders (ties: earlier entry first). Arithmetic is
    exact (:class:`fractions.Fraction`), so the result does not depend on float rounding. Counts
    sum to ``total`` and each differs from its exact quota by less than one.

    >>> largest_remainder_counts([0.5, 0.5], 10)
    [5, 5]
    >>> largest_remainder_counts([1, 1, 1], 10)
    [4, 3, 3]
    """
    exact = [Fraction(w) for w in weights]
    weight_sum = sum(exact, Fraction(0))
    if weight_sum <= 0:
        raise ValueError("weights must not all be zero")
    quotas = [total * w / weight_sum for w in exact]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return counts


# -- TOML writing (the values by radbo.tomlfile) ------------------------------------------
def _check_writable(value: object) -> None:
    """Refuse what a fleet file must not hold: a bool (never in a profile, where it would
    read back as 0/1) and a non-finite float (a profile is finite)."""
    if isinstance(value, bool):
        raise TypeError(f"cannot write bool {value!r} to a fleet file")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot write non-finite float {value!r} to a fleet file")
    if isinstance(value, list | tuple):  # availability windows: [[start_s, end_s], ...]
        for item in value:
            _check_writable(item)


def _profile_record(profile: DeviceProfile) -> dict[str, Any]:
    # None (no energy figure) is left out: TOML has no null and the field defaults to None.
    # No windows and the default period are left out too, so files without windows read as
    # before; both default back to the same values.
    record = {k: v for k, v in profile.model_dump().items() if v is not None}
    if not profile.windows:
        del record["windows"]
    if profile.period_s == DAY_S:
        del record["period_s"]
    return record


def _fleet_toml(records: list[dict[str, Any]]) -> str:
    lines = [
        "# radbo fleet: one [[device]] table per client, in client order (client 0 first).",
        "# Units: FLOP/s, bytes, bit/s; availability is a probability per round.",
        *toml_lines({"format": FLEET_FORMAT, "version": _FLEET_VERSION}),
    ]
    for i, record in enumerate(records):
        for value in record.values():
            _check_writable(value)
        lines += ["", f"# client {i}", "[[device]]", *toml_lines(record)]
    return "\n".join(lines) + "\n"


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ProfileError(
            f"device profile error: {path} = {path.suffix or '<no suffix>'!r}: the file must end "
            "in .json or .toml (pickle is never read or written)"
        )
    return suffix


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ProfileError(
                f"device profile error: {key!r} appears twice in the same JSON object"
            )
        result[key] = value
    return result


def _table_file_cap() -> int:
    """:data:`MAX_TABLE_FILE_BYTES`, or a quarter of this machine's memory under ``--force``."""
    if not caps_are_lifted():
        return MAX_TABLE_FILE_BYTES
    import psutil

    return max(MAX_TABLE_FILE_BYTES, int(psutil.virtual_memory().total) // 4)


def _read_file(path: Path, what: str) -> bytearray:
    """The bytes of ``path``, a fleet file, trace or behaviour trace.

    Bounded: only a regular file is opened (a FIFO would block the read forever, a device
    such as ``/dev/zero`` never end: both refused before opening, by what they are), and its
    size is checked against :data:`MAX_TABLE_FILE_BYTES` before anything is read (a sparse
    30 GiB file costs a stat). Errors are one :class:`ProfileError` line naming the file.
    """
    try:
        handle, size = open_regular_file(path, what)
    except FileNotFoundError:
        raise ProfileError(
            f"device profile error: {what} {path} does not exist or is not a file"
        ) from None
    except ValueError as err:  # a special file, a NUL in the name, a name too long
        raise ProfileError(f"device profile error: {err}") from None
    cap = _table_file_cap()
    with handle:
        if size > cap:
            lift = "" if caps_are_lifted() else "; radbo run --force lifts this cap"
            raise ProfileError(
                f"device profile error: {what} {path} holds {size} bytes, more than the {cap} "
                f"a {what} may hold (about 190,000 device profiles or 4 million trace "
                f"clients){lift}"
            )
        try:
            raw = read_at_most(handle, cap + 1)
        except OSError as err:
            raise ProfileError(
                f"device profile error: {what} {path} cannot be read: {err.strerror or err}"
            ) from None
        except MemoryError:
            raise ProfileError(
                f"device profile error: {what} {path} does not fit in the memory free now"
            ) from None
    if len(raw) > cap:  # the file grew while it was read
        raise ProfileError(f"device profile error: {what} {path} grew past {cap} bytes")
    return raw


def _text(raw: bytearray) -> str:
    """``raw`` decoded as UTF-8, newlines translated as :meth:`Path.read_text` does."""
    text = raw.decode("utf-8")
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def _read_table(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """Parse a JSON or TOML file (by suffix) into a dict; errors are :class:`ProfileError`
    lines naming the file (a special file, a file above the size cap: see :func:`_read_file`)."""
    path = Path(path)
    suffix = _suffix(path)
    raw = _read_file(path, what)
    try:
        text = _text(raw)
        del raw
        if suffix == ".json":
            data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
        else:
            data = tomllib.loads(text)
    except ProfileError as err:  # a duplicate JSON key
        raise ProfileError(f"{err} (in {what} {path})") from None
    except ValueError as err:  # JSON/TOML/UTF-8 decoding, or an integer of 4300+ digits
        kind = "JSON" if suffix == ".json" else "TOML"
        raise ProfileError(
            f"device profile error: {what} {path} is not valid {kind}: {err}"
        ) from None
    except RecursionError:  # both parsers recurse once per level of nesting
        kind = "JSON" if suffix == ".json" else "TOML"
        raise ProfileError(
            f"device profile error: {what} {path} is not valid {kind}: nested too deeply"
        ) from None
    except OSError as err:
        raise ProfileError(
            f"device profile error: {what} {path} cannot be read: {err.strerror or err}"
        ) from None
    if not isinstance(data, dict):
        raise ProfileError(
            f"device profile error: {what} {path} must hold a table at the top level, "
            f"got {type(data).__name__}"
        )
    return data


def _check_trace_arguments(flops_per_sample: float, memory_bytes: int, availability: float) -> None:
    """Refuse :meth:`Fleet.from_trace`'s numbers when they are not what a profile takes."""
    if not _is_finite_number(flops_per_sample):
        raise ValueError(f"flops_per_sample = {flops_per_sample!r}: must be a finite number > 0")
    if not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool) or memory_bytes < 1:
        raise ValueError(f"memory_bytes = {memory_bytes!r}: must be an integer > 0 (bytes)")
    if not _is_finite_number(availability, strict=False) or availability > 1:
        raise ValueError(f"availability = {availability!r}: must be a number in [0, 1]")


def _trace_entries(path: Path) -> dict[int, Mapping[str, Any]]:
    """The checked entries of the device-capacity trace at ``path``, by integer client id;
    :class:`ProfileError` for an empty trace, an id that is not an integer or appears twice."""
    data = _read_table(path, "trace")
    if not data:
        raise ProfileError(f"device profile error: trace {path} lists no clients")
    entries: dict[int, Mapping[str, Any]] = {}
    for key, entry in data.items():
        try:
            cid = int(str(key).strip())
        except ValueError:
            raise ProfileError(
                f"device profile error: trace[{key!r}] = {{...}}: client ids must be integers"
            ) from None
        if cid in entries:
            raise ProfileError(
                f"device profile error: trace[{key!r}]: client id {cid} appears twice"
            )
        entries[cid] = _check_trace_entry(key, entry)
    return entries


def _trace_record(
    path: Path,
    cid: int,
    entry: Mapping[str, Any],
    *,
    flops_per_sample: float,
    memory_bytes: int,
    availability: float,
    base: DeviceProfile | None,
) -> dict[str, Any]:
    """The profile fields of trace client ``cid`` (see :meth:`Fleet.from_trace`)."""
    computation = float(entry["computation"])
    communication = float(entry["communication"])
    note = (
        f"FedScale-style trace {path.name}, client {cid}: computation {computation} "
        f"ms/sample, communication {communication} kbit/s, flops_per_sample "
        f"{flops_per_sample}"
    )
    return {
        "name": f"client {cid}" if base is None else f"{base.name} (client {cid})",
        "tier": "trace" if base is None else base.tier,
        # = flops_per_sample / (computation / 1000), without underflow to 0 for tiny values
        "compute_flops": flops_per_sample * 1000.0 / computation,
        "memory_bytes": memory_bytes,
        "uplink_bps": communication * 1000.0,
        "downlink_bps": communication * 1000.0,
        "availability": availability,
        "energy_per_flop": None if base is None else base.energy_per_flop,
        "energy_per_byte_up": None if base is None else base.energy_per_byte_up,
        "energy_per_byte_down": None if base is None else base.energy_per_byte_down,
        "source": note if base is None or not base.source else f"{note}; {base.source}",
    }


@dataclass(frozen=True)
class Fleet(Sequence[DeviceProfile]):
    """Immutable sequence of client device profiles; client ``i`` has profile ``fleet[i]``."""

    profiles: tuple[DeviceProfile, ...]

    def __post_init__(self) -> None:
        profiles = tuple(self.profiles)
        if not profiles:
            raise ValueError("a fleet needs at least one client profile")
        for i, p in enumerate(profiles):
            if not isinstance(p, DeviceProfile):
                raise TypeError(f"fleet client {i} is a {type(p).__name__}, not a DeviceProfile")
        object.__setattr__(self, "profiles", profiles)

    # -- sequence protocol ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.profiles)

    @overload
    def __getitem__(self, index: int) -> DeviceProfile: ...
    @overload
    def __getitem__(self, index: slice) -> Fleet: ...
    def __getitem__(self, index: int | slice) -> DeviceProfile | Fleet:
        """Client ``index``'s profile, or a sub-fleet for a slice."""
        if isinstance(index, slice):
            return Fleet(self.profiles[index])
        return self.profiles[index]

    def __iter__(self) -> Iterator[DeviceProfile]:
        return iter(self.profiles)

    # -- constructors -----------------------------------------------------------------------
    @classmethod
    def from_profiles(cls, profiles: Sequence[DeviceProfile]) -> Fleet:
        """A fleet whose client ``i`` has ``profiles[i]``."""
        return cls(tuple(profiles))

    @classmethod
    def from_tiers(
        cls,
        mix: Mapping[str, float],
        num_clients: int,
        seed: int,
        catalog: Mapping[str, DeviceProfile] | None = None,
    ) -> Fleet:
        """``num_clients`` clients drawn from a device mix, deterministic given ``seed``.

        ``mix`` maps device id (a key of ``catalog``, default :func:`load_catalog`) to a
        non-negative weight; weights need not sum to one but must not all be zero. Counts follow
        :func:`largest_remainder_counts` (``{a: 0.5, b: 0.5}`` with 10 clients gives exactly 5
        and 5), then client order is shuffled by ``numpy.random.default_rng(seed)``.
        """
        catalog = load_catalog() if catalog is None else catalog
        if not isinstance(num_clients, int) or isinstance(num_clients, bool) or num_clients < 1:
            raise ValueError(f"num_clients = {num_clients!r}: must be an integer >= 1")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed = {seed!r}: must be an integer >= 0")
        if not mix:
            raise ValueError("mix = {}: give at least one device id with a weight > 0")
        for device, weight in mix.items():
            if device not in catalog:
                raise ValueError(unknown_device_message(device, list(catalog)))
            if not _is_finite_number(weight, strict=False):
                raise ValueError(f"mix[{device!r}] = {weight!r}: must be a finite number >= 0")
        if not any(w > 0 for w in mix.values()):
            raise ValueError(f"mix = {dict(mix)!r}: at least one weight must be > 0")
        counts = largest_remainder_counts(list(mix.values()), num_clients)
        ordered = [catalog[d] for d, c in zip(mix, counts, strict=True) for _ in range(c)]
        order = np.random.default_rng(seed).permutation(num_clients)
        return cls(tuple(ordered[int(i)] for i in order))

    @classmethod
    def from_trace(
        cls,
        path: str | os.PathLike[str],
        *,
        flops_per_sample: float,
        memory_bytes: int,
        availability: float = 1.0,
        base: DeviceProfile | None = None,
        behavior: str | os.PathLike[str] | None = None,
    ) -> Fleet:
        """A fleet from a FedScale-style device-capacity trace in JSON or TOML.

        The trace maps client id to ``{"computation": ms per sample, "communication": kbit/s}``,
        the content of FedScale's ``client_device_capacity`` file (pickled upstream; radbo reads
        the same content from JSON/TOML only). Client ``i`` of the fleet is the ``i``-th id in
        numeric order. Per client: ``compute_flops = flops_per_sample / (computation / 1000)``
        and ``uplink_bps = downlink_bps = communication * 1000``; ``memory_bytes`` and
        ``availability`` apply to every client. ``base``, if given, supplies the name prefix,
        tier, energy per FLOP and source note; otherwise clients are named ``client <id>`` with
        tier ``trace``.

        ``behavior``, if given, is a FedScale-style client behaviour trace (JSON or TOML; the
        content of FedScale's ``client_behave_trace``, pickled upstream): client id ->
        ``{"active": [s, ...], "inactive": [s, ...], "finish_time": s}``. Client ``c`` is on
        from ``active[i]`` to ``inactive[i]`` (seconds), and the pattern repeats every
        ``finish_time`` seconds: its profile gets ``windows = [[active[i], inactive[i]], ...]``
        and ``period_s = finish_time`` (validated like any profile's windows; FedScale's
        ``duration`` and ``model`` keys are allowed and not used). Every client of the capacity
        trace needs an entry with at least one window; entries for other ids are not used.
        """
        _check_trace_arguments(flops_per_sample, memory_bytes, availability)
        path = Path(path)
        entries = _trace_entries(path)
        windows = {} if behavior is None else _read_behavior(Path(behavior), sorted(entries))
        profiles = []
        for cid in sorted(entries):
            record = _trace_record(
                path,
                cid,
                entries[cid],
                flops_per_sample=flops_per_sample,
                memory_bytes=memory_bytes,
                availability=availability,
                base=base,
            )
            if cid in windows:
                record["windows"], record["period_s"] = windows[cid]
            profiles.append(parse_profile(record, where=f"trace client {cid}: "))
        return cls(tuple(profiles))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Fleet:
        """Read a fleet written by :meth:`to_file` (JSON or TOML, chosen by suffix).

        Every profile is validated; errors are :class:`ProfileError` lines naming the client index
        and field, e.g. ``device profile error: device[3].compute_flops = -1.0: ...``.
        """
        path = Path(path)
        data = _read_table(path, "fleet file")
        unknown = sorted(set(data) - {"format", "version", "device"})
        problems = [
            f"device profile error: {key} = {data[key]!r}: unknown top-level key in fleet file "
            f"{path} (allowed: format, version, device)"
            for key in unknown
        ]
        if data.get("format", FLEET_FORMAT) != FLEET_FORMAT:
            problems.append(
                f"device profile error: format = {data['format']!r}: expected {FLEET_FORMAT!r}"
            )
        if data.get("version", _FLEET_VERSION) != _FLEET_VERSION:
            problems.append(
                f"device profile error: version = {data['version']!r}: this radbo reads version "
                f"{_FLEET_VERSION}"
            )
        devices = data.get("device")
        if not isinstance(devices, list) or not devices:
            problems.append(
                f"device profile error: device = {devices!r}: expected a non-empty list of device "
                "tables, one per client ([[device]] in TOML)"
            )
            devices = []
        profiles = []
        for i, entry in enumerate(devices):
            try:
                profiles.append(parse_profile(entry, where=f"device[{i}]."))
            except ProfileError as err:
                problems.append(str(err))
        if problems:
            raise ProfileError("\n".join(problems))
        return cls(tuple(profiles))

    # -- output -----------------------------------------------------------------------------
    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write the fleet as JSON (``.json``) or TOML (``.toml``), atomically.

        The file is a readable list of profiles (``device``: one table per client, in order);
        :meth:`from_file` reads it back exactly. Written to a temporary file in the same folder,
        flushed, then moved over ``path`` (:func:`radbo.atomic.atomic_write`).
        """
        path = Path(path)
        suffix = _suffix(path)
        records = [_profile_record(p) for p in self.profiles]
        if suffix == ".json":
            document = {"format": FLEET_FORMAT, "version": _FLEET_VERSION, "device": records}
            text = json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
        else:
            text = _fleet_toml(records)
        atomic_write_bytes(path, text.encode("utf-8"))

    def tiers(self) -> list[str]:
        """Per-client tier label: ``profile.tier``, or ``profile.name`` when the tier is empty."""
        return [p.tier or p.name for p in self.profiles]

    def table(self) -> list[dict[str, Any]]:
        """One row per client for display: index, name, tier, compute (GFLOP/s, 1e9), memory
        (MB, 1e6 bytes), uplink and downlink (Mbit/s, 1e6 bit/s) and availability."""
        return [
            {
                "index": i,
                "name": p.name,
                "tier": tier,
                "compute_gflops": p.compute_flops / 1e9,
                "memory_mb": p.memory_bytes / 1e6,
                "uplink_mbps": p.uplink_bps / 1e6,
                "downlink_mbps": p.downlink_bps / 1e6,
                "availability": p.availability,
            }
            for i, (p, tier) in enumerate(zip(self.profiles, self.tiers(), strict=True))
        ]


def _read_behavior(
    path: Path, clients: Sequence[int]
) -> dict[int, tuple[list[list[float]], float]]:
    """``{client id: (windows, period_s)}`` for ``clients`` from a FedScale-style behaviour
    trace (see :meth:`Fleet.from_trace`); one :class:`ProfileError` line per problem."""
    data = _read_table(path, "behavior trace")
    by_id: dict[int, tuple[object, object]] = {}
    for key, entry in data.items():
        try:
            cid = int(str(key).strip())
        except ValueError:
            raise ProfileError(
                f"device profile error: behavior[{key!r}] = {{...}}: client ids must be integers"
            ) from None
        if cid in by_id:
            raise ProfileError(
                f"device profile error: behavior[{key!r}]: client id {cid} appears twice"
            )
        by_id[cid] = (key, entry)
    missing = [c for c in clients if c not in by_id]
    if missing:
        shown = ", ".join(str(c) for c in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ProfileError(
            f"device profile error: behavior trace {path} has no entry for client {shown} of "
            f"the capacity trace ({len(missing)} missing); every client needs one"
        )
    out = {}
    problems = []
    for cid in clients:
        raw_key, raw_entry = by_id[cid]
        try:
            out[cid] = _check_behavior_entry(raw_key, raw_entry)
        except ProfileError as err:
            problems.append(str(err))
    if problems:
        raise ProfileError("\n".join(problems))
    return out


def _check_behavior_entry(key: object, entry: object) -> tuple[list[list[float]], float]:
    """One behaviour trace entry as ``(windows, period_s)``; one line per problem."""
    where = f"behavior[{key!r}]"
    if not isinstance(entry, Mapping):
        raise ProfileError(
            f"device profile error: {where} = {entry!r}: expected a table with active and "
            "inactive (lists of seconds) and finish_time (seconds)"
        )
    problems = [
        f"device profile error: {where}.{name} = {entry[name]!r}: unknown field (allowed: "
        f"{', '.join(_BEHAVIOR_FIELDS + _BEHAVIOR_IGNORED)})"
        for name in sorted(set(entry) - set(_BEHAVIOR_FIELDS) - set(_BEHAVIOR_IGNORED))
    ]
    for name in _BEHAVIOR_FIELDS:
        if name not in entry:
            problems.append(f"device profile error: {where}.{name} = <missing>: Field required")
    times: dict[str, list[float]] = {}
    for name in ("active", "inactive"):
        value = entry.get(name)
        if name not in entry:
            continue
        if not isinstance(value, list) or not all(
            _is_finite_number(t, strict=False) for t in value
        ):
            problems.append(
                f"device profile error: {where}.{name} = {_short(value)}: must be a list of "
                "finite numbers >= 0 (seconds)"
            )
        else:
            times[name] = [float(t) for t in value]
    period = entry.get("finish_time")
    if "finish_time" in entry and not (_is_number(period) and _is_finite_number(period)):
        problems.append(
            f"device profile error: {where}.finish_time = {period!r}: must be a finite number "
            "> 0 (seconds after which the pattern repeats)"
        )
    if len(times) == 2:
        on, off = times["active"], times["inactive"]
        if len(on) != len(off):
            problems.append(
                f"device profile error: {where}: active has {len(on)} times and inactive "
                f"{len(off)}; give one inactive time per active time"
            )
        elif not on:
            problems.append(
                f"device profile error: {where}.active = []: the client is never on; give it "
                "a window, or leave the client out of the traces"
            )
    if problems:
        raise ProfileError("\n".join(problems))
    windows = [[a, b] for a, b in zip(times["active"], times["inactive"], strict=True)]
    assert _is_number(period)  # checked above
    return windows, float(period)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class WindowSchedule:
    """The availability windows of every client, in flat arrays, to check all clients at once.

    Built by :meth:`of` from the clients' profiles (``windows`` and ``period_s`` of
    :class:`~radbo.devices.DeviceProfile`); a client without windows is always on. ``open``
    agrees exactly with :meth:`DeviceProfile.available_at` (the phase is ``clock_s % period_s``
    in float64, as Python computes it).

    >>> on = {"name": "d", "compute_flops": 1.0, "memory_bytes": 1, "uplink_bps": 1.0,
    ...       "downlink_bps": 1.0, "windows": [[0, 100]], "period_s": 200.0}
    >>> schedule = WindowSchedule.of([parse_profile(on), parse_profile(on | {"windows": []})])
    >>> [schedule.open(t).tolist() for t in (50.0, 150.0)]
    [[True, True], [False, True]]
    """

    always: np.ndarray
    """``bool[n]``: clients without windows."""
    owner: np.ndarray
    """``int64[w]``: the client of each window."""
    start: np.ndarray
    """``float64[w]``: where each window opens in its period, seconds."""
    end: np.ndarray
    """``float64[w]``: where each window closes (exclusive), seconds."""
    period: np.ndarray
    """``float64[w]``: the period of each window's client, seconds."""

    @classmethod
    def of(cls, profiles: Sequence[object]) -> WindowSchedule | None:
        """The schedule of ``profiles`` (client order), or ``None`` when none has windows.
        Objects without a ``windows`` attribute count as always on."""
        owner, start, end, period = [], [], [], []
        always = np.ones(len(profiles), dtype=bool)
        for c, profile in enumerate(profiles):
            windows = getattr(profile, "windows", ())
            if not windows:
                continue
            always[c] = False
            for a, b in windows:
                owner.append(c)
                start.append(float(a))
                end.append(float(b))
                period.append(float(getattr(profile, "period_s", DAY_S)))
        if not owner:
            return None
        return cls(
            always=always,
            owner=np.asarray(owner, dtype=np.int64),
            start=np.asarray(start, dtype=np.float64),
            end=np.asarray(end, dtype=np.float64),
            period=np.asarray(period, dtype=np.float64),
        )

    def _covered(self, clock_s: float) -> np.ndarray:
        phase = np.remainder(np.float64(clock_s), self.period)  # = clock_s % period_s, exactly
        return (self.start <= phase) & (phase < self.end)

    def open(self, clock_s: float) -> Tensor:
        """``bool[n]``: which clients a window covers at virtual time ``clock_s``."""
        on = self.always.copy()
        on[self.owner[self._covered(clock_s)]] = True
        return torch.from_numpy(on)

    def next_opening(self, clock_s: float) -> float:
        """The earliest virtual time ``>= clock_s`` at which some client's window is open."""
        if self.always.any() or self._covered(clock_s).any():
            return clock_s
        phase = np.remainder(np.float64(clock_s), self.period)
        wait = np.where(self.start > phase, self.start - phase, self.start + self.period - phase)
        opening = clock_s + float(wait.min())
        # rounding can land a few ulps before the window opens: step up to it
        for _ in range(64):
            if self._covered(opening).any():
                break
            opening = math.nextafter(opening, math.inf)
        return opening


def _check_trace_entry(key: object, entry: object) -> Mapping[str, Any]:
    """Validate one trace client entry; one :class:`ProfileError` line per problem."""
    where = f"trace[{key!r}]"
    if not isinstance(entry, Mapping):
        raise ProfileError(
            f"device profile error: {where} = {entry!r}: expected a table with computation "
            "(ms per sample) and communication (kbit/s)"
        )
    problems = []
    for name in sorted(set(entry) - set(_TRACE_FIELDS)):
        problems.append(
            f"device profile error: {where}.{name} = {entry[name]!r}: unknown field "
            "(allowed: computation, communication)"
        )
    units = {"computation": "milliseconds per sample", "communication": "kbit/s"}
    for name in _TRACE_FIELDS:
        if name not in entry:
            problems.append(f"device profile error: {where}.{name} = <missing>: Field required")
            continue
        value = entry[name]
        if not _is_finite_number(value):
            problems.append(
                f"device profile error: {where}.{name} = {value!r}: must be a finite number > 0 "
                f"({units[name]})"
            )
    if problems:
        raise ProfileError("\n".join(problems))
    return entry
