"""Cost accounting: FLOPs executed, bytes on the wire, simulated time, energy, a virtual clock.

Every client and phase of a round produces one :class:`LedgerEntry`:

- **FLOPs** are measured, not modelled: :class:`FlopMeter` counts a client function once
  under ``torch.utils.flop_counter.FlopCounterMode``'s rules for every distinct workload (phase,
  submodel shapes, gradient / Hessian-vector counts, samples, local steps) and caches the count,
  so a run pays the counting overhead once per workload (the first of a kind is counted while it
  runs, later new ones by running them again; blocks the client marks as repeated are counted
  once per measurement); workloads that differ only in their Hessian-vector count (CG
  iterations) are composed from a verified line instead of measured.
  The counter includes backward and double-backward (Hessian-vector products) and skips
  elementwise ops, BatchNorm and pooling.
- **Bytes** are the tensors that cross the (simulated) wire: the submodel tensors received and
  the update sent (numel x element size), plus the index metadata of a submodel (its kept
  indices as int32) the first time a client receives it in a round.
- **Time**: compute time = FLOPs / the device's sustained FLOP/s; communication time =
  8 x bytes / bandwidth, down and up. A phase ends when its slowest participating client ends
  (synchronous rounds), a round is the sum of its phases, and the virtual clock adds rounds up
  (FedScale's virtual clock, with compute time from the submodel's FLOPs instead of a per-sample
  constant, and bytes from the real payload instead of the full model's pickle).
- **Energy** (joules, :func:`phase_energy`): compute energy = FLOPs x the device's
  ``energy_per_flop``; radio energy = bytes up x ``energy_per_byte_up`` + bytes down x
  ``energy_per_byte_down``. A figure the profile does not give (or a client without a profile)
  leaves that energy *unknown*, ``None`` in the ledger row, never a silent 0: :func:`totals`
  sums the known joules and counts the FLOPs and bytes it could not price
  (``energy_unpriced_flops``, ``energy_unpriced_bytes``; both 0 when the totals are complete).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NotRequired, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, model_validator
from torch import Tensor
from typing_extensions import TypedDict

from radbo.schema import Amount, Count, Joules
from radbo.typing import IndexSet

#: bytes of one index on the wire (kept indices are sent as int32)
INDEX_BYTES = 4

R = TypeVar("R")


class LinkProfile(Protocol):
    """What the time model needs from a device profile (:class:`radbo.devices.DeviceProfile`)."""

    @property
    def compute_flops(self) -> float: ...

    @property
    def uplink_bps(self) -> float: ...

    @property
    def downlink_bps(self) -> float: ...


class EnergyProfile(Protocol):
    """The energy figures of a device profile (:class:`radbo.devices.DeviceProfile`); each is
    ``None`` when unknown."""

    @property
    def energy_per_flop(self) -> float | None: ...

    @property
    def energy_per_byte_up(self) -> float | None: ...

    @property
    def energy_per_byte_down(self) -> float | None: ...


class DeviceLike(LinkProfile, Protocol):
    """What the engine and the budget planner read from a device profile
    (:class:`radbo.devices.DeviceProfile`)."""

    @property
    def name(self) -> str: ...

    @property
    def tier(self) -> str: ...

    @property
    def availability(self) -> float: ...

    @property
    def memory_bytes(self) -> int: ...


def index_metadata_bytes(index_set: IndexSet) -> int:
    """Bytes needed to tell a client its submodel: every distinct kept-index list, as int32.

    Tensors of one layer share index lists (a conv's output channels, its BN, the next conv's
    input channels), so identical lists are sent once. A full model needs no metadata.
    """
    seen: set[tuple[int, ...]] = set()
    total = 0
    for entry in index_set.values():
        for idx in entry:
            if idx is None:
                continue
            key = tuple(idx.tolist())
            if key in seen:
                continue
            seen.add(key)
            total += len(key) * INDEX_BYTES
    return total


def tensor_bytes(tensors: Mapping[str, Tensor]) -> int:
    """numel x element size summed over ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def shape_signature(tensors: Mapping[str, Tensor]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Hashable (name, shape) list identifying a submodel's shapes."""
    return tuple((name, tuple(t.shape)) for name, t in sorted(tensors.items()))


@dataclass
class FlopMeter:
    """Measures the FLOPs of a client function once per distinct workload and caches them.

    ``key`` identifies a workload; the function must be pure (same task, same work), which the
    engine's client functions are, so re-running it under the counter is safe.

    **Composition by a count.** A workload may name one count its FLOPs are affine in
    (``linear``: the Hessian-vector products of a conjugate-gradient solve, whose iteration count
    changes from round to round): FLOPs = ``base + unit x count`` for workloads equal in
    everything else. Once three measurements of such a family at different counts lie exactly on
    one line (integer arithmetic), the meter composes every further count from it instead of
    measuring; a family whose measurements are not collinear is measured for each count, as
    without composition. A measurement that shows its own unit (a count of a single uniform CG
    solve gives the FLOPs of one iteration: :func:`radbo.loops.cg_iteration_flops`) gives
    the line at once. So a CG that stops after a new number of iterations costs no new
    measurement, and the totals are exactly what measuring each workload gives.

    **Repeated work counted once.** A measurement counts a block the client marks
    :func:`radbo.flops.repeated` -- every step of :func:`radbo.loops.local_steps`, every CG
    product marked by :func:`radbo.loops.cg_product` -- the first
    time only, and runs its repetitions outside the counter at full speed, adding the first
    count (``reuse``; ``False`` counts every operation: the same integers, slower). The second
    block of each kind is counted as well and must match the first, a sample of the client's
    promise that the blocks repeat the same work (:class:`radbo.flops.RepeatedWorkError`).

    **The first of a kind counted while it runs** (``in_place``; :meth:`measure`, which
    :func:`radbo.client.run_measured` calls for every client): the first client of a family
    (phase, submodel shapes, local steps and the shapes of its draws) runs under the counter
    instead of running plainly and then again under it; the counter runs the same kernels, so
    its result is the same.
    """

    cache: dict[tuple, int] = field(default_factory=dict)
    measurements: int = 0
    compose: bool = True
    reuse: bool = True
    #: count the first workload of each family while it runs (``False``: run it, then
    #: measure it by running it again; the same integers)
    in_place: bool = True
    #: the kinds of workload met so far (:meth:`measure`'s ``family``; ``run_measured``: phase,
    #: submodel shapes, local steps, draw shapes)
    families: set[tuple] = field(default_factory=set)
    _points: dict[tuple, dict[int, int]] = field(default_factory=dict, repr=False)
    _lines: dict[tuple, tuple[int, int, int] | None] = field(default_factory=dict, repr=False)

    def count(self, run: Callable[[], Any], blocks: dict[tuple, int] | None = None) -> int:
        """The FLOPs of ``run()`` by :func:`radbo.flops.count_flops` with this meter's settings
        (``reuse``); ``blocks`` receives the counts of its repeated blocks."""
        from radbo.flops import count_flops

        return int(count_flops(run, reuse=self.reuse, blocks=blocks))

    def measure(
        self,
        run: Callable[[], R],
        family: tuple,
        workload: Callable[[R], tuple[tuple, int | None]],
        *,
        result: R | None = None,
        unit: Callable[[dict[tuple, int]], int | None] | None = None,
    ) -> tuple[R, int]:
        """Run ``run()`` (or take its ``result``, computed elsewhere) and return the result
        with its FLOPs: what a backend asks of the meter for every client.

        ``workload(result) -> (key, linear)`` names the workload the FLOPs belong to (read
        from the result, because its counts are known only once it has run) and the count
        they are affine in (or ``None``); ``family`` is the kind of workload, known before it
        runs. The FLOPs are the cached or composed ones of ``(key, linear)`` (:meth:`lookup`);
        else, the first run of a ``family`` not met before is counted while it runs
        (``in_place``, when no ``result`` is given); else the workload is measured by running
        ``run()`` again under the counter (:meth:`flops`). ``unit(blocks)`` reads the FLOPs
        one more ``linear`` count adds from a count's repeated blocks
        (:func:`radbo.loops.cg_iteration_flops`). ``run`` must be pure: counting it again gives
        the same work, and counting does not change its result (the counter runs the same
        kernels).
        """
        flops: int | None = None
        blocks: dict[tuple, int] = {}
        if result is None and self.in_place and family not in self.families:
            # a new kind of workload: count this very run instead of running it twice
            box: list[R] = []
            flops = self.count(lambda: box.append(run()), blocks)
            result = box[-1]
        elif result is None:
            result = run()
        key, linear = workload(result)
        known = self.lookup(key, linear)
        if known is not None:  # (a count in place finds it known only after a resume)
            self.families.add(family)
            return result, known
        if flops is not None:  # counted in place
            return result, self.store(
                key, flops, linear, family, None if unit is None else unit(blocks)
            )
        # a new workload of a known kind: run it again under the counter
        return result, self.flops(key, run, linear, family, unit)

    def flops(
        self,
        key: tuple,
        run: Callable[[], Any],
        linear: int | None = None,
        family: tuple | None = None,
        unit: Callable[[dict[tuple, int]], int | None] | None = None,
    ) -> int:
        """Cached FLOPs for ``key`` (and ``linear``, the count the workload's FLOPs are affine
        in); on a miss, composed from its family's line or measured by running ``run()`` under
        the FLOP counter and stored (:meth:`store`, with ``family`` and the unit that
        ``unit(blocks)`` reads from the count's repeated blocks, when given)."""
        found = self.lookup(key, linear)
        if found is not None:
            return found
        blocks: dict[tuple, int] = {}
        value = self.count(run, blocks)
        return self.store(key, value, linear, family, None if unit is None else unit(blocks))

    def lookup(self, key: tuple, linear: int | None = None) -> int | None:
        """The FLOPs of a workload known without measuring it: cached, or composed from its
        family's verified line (and then cached); ``None`` when it must be measured."""
        full = key if linear is None else (*key, linear)
        found = self.cache.get(full)
        if found is not None:
            return found
        if linear is not None and self.compose:
            line = self._lines.get(key)
            if line is not None:  # verified: base + unit * count, exactly
                k0, f0, unit = line
                value = self.cache[full] = f0 + unit * (linear - k0)
                return value
        return None

    def store(
        self,
        key: tuple,
        value: int,
        linear: int | None = None,
        family: tuple | None = None,
        unit: int | None = None,
    ) -> int:
        """Record a measurement of a workload (made by :meth:`flops`, or by the caller counting
        the workload's own run with :func:`radbo.flops.count_flops`), and its ``family`` in
        :attr:`families`; returns ``value``. ``unit``: the FLOPs one more ``linear`` count
        adds, when the count itself showed it (one uniform CG solve:
        :func:`radbo.loops.cg_iteration_flops`); the family's line is then known from
        this one measurement."""
        if family is not None:
            self.families.add(family)
        full = key if linear is None else (*key, linear)
        self.cache[full] = value
        self.measurements += 1
        if linear is not None and self.compose and key not in self._lines:
            if unit is not None:
                self._lines[key] = (linear, value, unit)
                self._points.pop(key, None)
            else:
                points = self._points.setdefault(key, {})
                points[linear] = value
                if len(points) >= 3:
                    self._lines[key] = _exact_line(points)
                    del self._points[key]
        return value

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state (for checkpoints): a resumed run measures what the uninterrupted
        one would."""
        return {
            "measurements": self.measurements,
            "cache": [[list(k), v] for k, v in self.cache.items()],
            "points": [[list(k), [[c, f] for c, f in p.items()]] for k, p in self._points.items()],
            "lines": [[list(k), None if v is None else list(v)] for k, v in self._lines.items()],
            "families": sorted((list(f) for f in self.families), key=repr),
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checkpoints without points and lines, written
        before composition existed, restore the cache only; without families, their first
        workloads are counted while they run, which gives the same cache)."""
        self.cache = {_as_tuple(k): int(v) for k, v in saved["cache"]}
        self.measurements = int(saved["measurements"])
        self._points = {
            _as_tuple(k): {int(c): int(f) for c, f in p} for k, p in saved.get("points", [])
        }
        self._lines = {
            _as_tuple(k): None if v is None else (int(v[0]), int(v[1]), int(v[2]))
            for k, v in saved.get("lines", [])
        }
        self.families = {_as_tuple(f) for f in saved.get("families", [])}


class FlopMeterState(BaseModel):
    """The schema of :meth:`FlopMeter.state_dict` as a checkpoint stores it: what a resumed
    run's meter is restored from (a meter measures every workload it caches, so it cannot have
    made fewer measurements than its cache holds)."""

    model_config = ConfigDict(extra="forbid")
    measurements: Count
    cache: list[tuple[Any, StrictInt]]
    points: list[tuple[Any, list[tuple[StrictInt, StrictInt]]]] = []
    lines: list[tuple[Any, tuple[StrictInt, StrictInt, StrictInt] | None]] = []
    families: list[Any] = []

    @model_validator(mode="after")
    def _measured_what_it_caches(self) -> FlopMeterState:
        if self.measurements < len(self.cache):
            raise ValueError(
                f"the FLOP meter made {self.measurements} measurements but caches {len(self.cache)}"
            )
        return self


def _as_tuple(value: Any) -> Any:
    """JSON lists back to the (nested) tuples of a workload key."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _exact_line(points: Mapping[int, int]) -> tuple[int, int, int] | None:
    """``(k0, f0, unit)`` with ``f = f0 + unit * (k - k0)`` through every point, in integers,
    or ``None`` when the points are not on one such line."""
    (k0, f0), *rest = sorted(points.items())
    k1, f1 = rest[0]
    unit, remainder = divmod(f1 - f0, k1 - k0)
    if remainder or any(f != f0 + unit * (k - k0) for k, f in rest):
        return None
    return k0, f0, unit


@dataclass(frozen=True)
class LedgerEntry:
    """Cost of one client in one phase of one round."""

    round: int
    phase: str
    client: int
    tier: str
    flops: int
    n_grad: int
    n_hvp: int
    samples: int
    bytes_down: int
    bytes_up: int
    compute_s: float
    comm_s: float
    energy_compute_j: float | None = None
    """FLOPs x the device's J/FLOP; ``None`` when the profile gives no ``energy_per_flop``
    (or there is no profile)."""
    energy_radio_j: float | None = None
    """bytes up x J/byte up + bytes down x J/byte down; ``None`` when the profile gives no
    per-byte figures (or there is no profile)."""

    @property
    def time_s(self) -> float:
        """Download, compute and upload, one after the other."""
        return self.compute_s + self.comm_s


# a TypedDict, not a model: pydantic checks it several times faster, which matters for the
# ledger of a long run (one row per client, phase and round)
class LedgerRow(TypedDict):
    """The schema of one :class:`LedgerEntry` as a checkpoint's history stores it (its fields,
    with their types; ``tests/checkpoint/test_checkpoint_integrity.py`` keeps the two equal)."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    round: Count
    phase: StrictStr
    client: Count
    tier: StrictStr
    flops: Count
    n_grad: Count
    n_hvp: Count
    samples: Count
    bytes_down: Count
    bytes_up: Count
    compute_s: Amount
    comm_s: Amount
    # joules, None when the device gave no figure; rows written before energy was accounted
    # lack the keys and read back as None (unknown)
    energy_compute_j: NotRequired[Joules]
    energy_radio_j: NotRequired[Joules]


def phase_times(
    flops: int, bytes_down: int, bytes_up: int, profile: LinkProfile | None
) -> tuple[float, float]:
    """(compute seconds, communication seconds) of one client phase on ``profile``.

    Without a profile there is no clock: both are 0.
    """
    if profile is None:
        return 0.0, 0.0
    compute = flops / profile.compute_flops
    comm = 8.0 * bytes_down / profile.downlink_bps + 8.0 * bytes_up / profile.uplink_bps
    return compute, comm


def phase_energy(
    flops: int, bytes_down: int, bytes_up: int, profile: object | None
) -> tuple[float | None, float | None]:
    """(compute joules, radio joules) of one client phase on ``profile``, each ``None`` when
    the profile lacks its figures (:class:`EnergyProfile`; a profile-like object without the
    attributes counts as lacking them, as does ``profile=None``).

    Compute = ``flops * energy_per_flop``; radio = ``bytes_up * energy_per_byte_up +
    bytes_down * energy_per_byte_down``, evaluated in exactly this order (float64).

    >>> from types import SimpleNamespace as NS
    >>> phase_energy(10**9, 1000, 500, NS(energy_per_flop=1e-10, energy_per_byte_up=2e-6,
    ...                                   energy_per_byte_down=1e-6))
    (0.1, 0.002)
    >>> phase_energy(10**9, 1000, 500, NS(energy_per_flop=None))
    (None, None)
    """
    per_flop = getattr(profile, "energy_per_flop", None)
    up = getattr(profile, "energy_per_byte_up", None)
    down = getattr(profile, "energy_per_byte_down", None)
    compute = None if per_flop is None else flops * per_flop
    radio = None if up is None or down is None else bytes_up * up + bytes_down * down
    return compute, radio


def round_time(entries: Iterable[LedgerEntry]) -> float:
    """Synchronous round: each phase lasts as long as its slowest client; phases add up."""
    slowest: dict[str, float] = {}
    for e in entries:
        slowest[e.phase] = max(slowest.get(e.phase, 0.0), e.time_s)
    return sum(slowest.values())


_SUMMED = ("flops", "n_grad", "n_hvp", "samples", "bytes_down", "bytes_up", "compute_s", "comm_s")


def totals(entries: Iterable[LedgerEntry]) -> dict[str, float]:
    """Sums of every counter over ``entries`` (``bytes`` = down + up), and energy:
    ``energy_compute_j`` and ``energy_radio_j`` (the known joules, summed in ledger order),
    ``energy_j`` (their sum) and what could not be priced, ``energy_unpriced_flops`` (FLOPs of
    entries without compute energy) and ``energy_unpriced_bytes`` (bytes of entries without
    radio energy); the energy totals are complete when both are 0."""
    out: dict[str, float] = dict.fromkeys(_SUMMED, 0)
    compute_j: float = 0
    radio_j: float = 0
    unpriced_flops = unpriced_bytes = 0
    for e in entries:
        for k in _SUMMED:
            out[k] += getattr(e, k)
        if e.energy_compute_j is None:
            unpriced_flops += e.flops
        else:
            compute_j += e.energy_compute_j
        if e.energy_radio_j is None:
            unpriced_bytes += e.bytes_down + e.bytes_up
        else:
            radio_j += e.energy_radio_j
    out["bytes"] = out["bytes_down"] + out["bytes_up"]
    out["energy_compute_j"] = float(compute_j)
    out["energy_radio_j"] = float(radio_j)
    out["energy_j"] = out["energy_compute_j"] + out["energy_radio_j"]
    out["energy_unpriced_flops"] = unpriced_flops
    out["energy_unpriced_bytes"] = unpriced_bytes
    return out


def totals_by_tier(entries: Iterable[LedgerEntry]) -> dict[str, dict[str, float]]:
    """:func:`totals` per device tier."""
    groups: dict[str, list[LedgerEntry]] = {}
    for e in entries:
        groups.setdefault(e.tier, []).append(e)
    return {tier: totals(group) for tier, group in sorted(groups.items())}


def as_dicts(entries: Sequence[LedgerEntry]) -> list[dict[str, Any]]:
    """JSON-ready rows."""
    return [asdict(e) for e in entries]


#: what each total a savings fraction divides by is, in the reasons of undefined fractions
_TOTAL_NAMES = {
    "flops": "compute (FLOPs)",
    "bytes": "bytes",
    "bytes_up": "uplink bytes",
    "bytes_down": "downlink bytes",
    "sim_time_s": "simulated time",
    "energy_j": "known energy",
    "energy_compute_j": "known compute energy",
    "energy_radio_j": "known radio energy",
}


def _zero_total_reason(key: str, spent: Mapping[str, Any]) -> str:
    """Why a fraction of the baseline's total ``key`` (from ``spent``) is undefined."""
    what = _TOTAL_NAMES.get(key, key)
    if key not in spent:
        return f"undefined: the baseline has no {what} figure"
    if key == "sim_time_s":
        why = "the fleet has no device profiles (no simulated clock) or no client of it ran"
    elif key.startswith("energy"):
        why = "its devices have no energy figures or no client of it ran"
    else:
        why = "no client of it ran (none was available?)"
    return f"undefined: the baseline's {what} is 0: {why}"


def savings(run_totals: Mapping[str, float], baseline_totals: Mapping[str, float]) -> dict:
    """Fractions of a baseline's compute, bytes, simulated time and energy that a run used
    (``nan`` where the baseline's figure is 0 or absent, e.g. energy on a fleet without energy
    figures, or everything when no client was ever available; then ``reasons`` maps each such
    fraction to why, and ``results.json`` holds ``null`` for it). The energy fractions compare
    known joules: they are exact when neither run has unpriced FLOPs or bytes
    (``energy_unpriced_*`` in the totals).

    >>> sv = savings({"flops": 0, "bytes": 0}, {"flops": 0, "bytes": 4})
    >>> sv["bytes_fraction"], sv["compute_fraction"]
    (0.0, nan)
    >>> sv["reasons"]["compute_fraction"]
    "undefined: the baseline's compute (FLOPs) is 0: no client of it ran (none was available?)"
    """
    reasons: dict[str, str] = {}

    def frac(name: str, key: str) -> float:
        base = baseline_totals.get(key, 0.0)
        if base:
            return float(run_totals.get(key, 0.0)) / base
        reasons[name] = _zero_total_reason(key, baseline_totals)
        return float("nan")

    out: dict[str, Any] = {
        "compute_fraction": frac("compute_fraction", "flops"),
        "bytes_fraction": frac("bytes_fraction", "bytes"),
        "bytes_up_fraction": frac("bytes_up_fraction", "bytes_up"),
        "bytes_down_fraction": frac("bytes_down_fraction", "bytes_down"),
        "time_fraction": frac("time_fraction", "sim_time_s"),
        "energy_fraction": frac("energy_fraction", "energy_j"),
        "energy_compute_fraction": frac("energy_compute_fraction", "energy_compute_j"),
        "energy_radio_fraction": frac("energy_radio_fraction", "energy_radio_j"),
    }
    if reasons:
        out["reasons"] = reasons
    return out


def first_reaching(
    rounds: Sequence[Mapping[str, Any]],
    target: float,
    initial: Mapping[str, Any] | None = None,
) -> dict[str, float] | None:
    """What a run spent until its first evaluation at ``test_accuracy >= target``: ``rounds``
    (rounds completed; 0 when the initial evaluation already reaches it), and the cumulative
    ``communication_rounds``, ``flops``, ``bytes``, ``sim_time_s`` (the virtual clock) and
    ``energy_j`` (known joules) up to and including that round; ``None`` when no evaluation
    reaches ``target``.

    ``rounds`` are ``results.json`` rows (``cost_flops``, ``cost_bytes``,
    ``communication_rounds``, ``sim_clock_s``, ``test_accuracy`` where evaluated);
    ``initial`` is the evaluation before round 0 (``test_accuracy``), when the run has one.

    >>> rows = [{"round": 0, "communication_rounds": 2, "cost_flops": 5, "cost_bytes": 7,
    ...          "sim_clock_s": 1.5, "test_accuracy": 0.5},
    ...         {"round": 1, "communication_rounds": 2, "cost_flops": 5, "cost_bytes": 7,
    ...          "sim_clock_s": 3.0, "test_accuracy": 0.75}]
    >>> first_reaching(rows, 0.7)  # doctest: +NORMALIZE_WHITESPACE
    {'rounds': 2, 'communication_rounds': 4, 'flops': 10, 'bytes': 14, 'sim_time_s': 3.0,
     'energy_j': 0}
    >>> first_reaching(rows, 0.8) is None
    True
    """
    spent: dict[str, Any] = {
        "rounds": 0,
        "communication_rounds": 0,
        "flops": 0,
        "bytes": 0,
        "sim_time_s": 0.0,
        "energy_j": 0,
    }
    start = None if initial is None else initial.get("test_accuracy")
    if start is not None and start >= target:
        return spent
    for row in rounds:
        spent["rounds"] = int(row["round"]) + 1
        spent["communication_rounds"] += row["communication_rounds"]
        spent["flops"] += row["cost_flops"]
        spent["bytes"] += row["cost_bytes"]
        spent["sim_time_s"] = row["sim_clock_s"]
        spent["energy_j"] += row.get("cost_energy_j") or 0
        accuracy = row.get("test_accuracy")
        if accuracy is not None and accuracy >= target:
            return dict(spent)
    return None


def savings_at_accuracy(
    run_rounds: Sequence[Mapping[str, Any]],
    run_final: Mapping[str, Any],
    baseline_rounds: Sequence[Mapping[str, Any]],
    baseline_final: Mapping[str, Any],
    *,
    run_initial: Mapping[str, Any] | None = None,
    baseline_initial: Mapping[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Savings at equal accuracy: the compute, bytes, simulated time and energy a run needs to
    first reach ``target_accuracy`` (the final test accuracy of the worse of the run and its
    baseline) as fractions of what the baseline needs to first reach it
    (:func:`first_reaching` of each). :func:`savings` compares the two at the last round
    only, which says little when one of them oscillates.

    Returns ``target_accuracy``, ``run`` and ``baseline`` (what each spent, or ``None``:
    "not reached") and ``compute_fraction``, ``bytes_fraction``, ``time_fraction``,
    ``energy_fraction`` (``nan`` when either did not reach it or the baseline's figure is 0,
    e.g. time and energy without device profiles; then ``reasons`` maps each such fraction to
    why, and ``results.json`` holds ``null`` for it); ``None`` when either run has no final
    test accuracy.

    >>> run = [{"round": 0, "communication_rounds": 1, "cost_flops": 2, "cost_bytes": 4,
    ...         "sim_clock_s": 1.0, "test_accuracy": 0.8}]
    >>> base = [{"round": r, "communication_rounds": 1, "cost_flops": 4, "cost_bytes": 8,
    ...          "sim_clock_s": 2.0 * (r + 1), "test_accuracy": a}
    ...         for r, a in enumerate([0.6, 0.9, 0.7])]
    >>> sv = savings_at_accuracy(run, {"test_accuracy": 0.8}, base, {"test_accuracy": 0.7})
    >>> sv["target_accuracy"], sv["run"]["rounds"], sv["baseline"]["rounds"]
    (0.7, 1, 2)
    >>> sv["compute_fraction"], sv["bytes_fraction"], sv["time_fraction"]
    (0.25, 0.25, 0.25)
    """
    accuracies = [final.get("test_accuracy") for final in (run_final, baseline_final)]
    if any(a is None or a != a for a in accuracies):  # absent or NaN
        return None
    target = min(float(a) for a in accuracies if a is not None)
    mine = first_reaching(run_rounds, target, run_initial)
    base = first_reaching(baseline_rounds, target, baseline_initial)

    reasons: dict[str, str] = {}
    missed = [who for who, spent in (("run", mine), ("baseline", base)) if spent is None]

    def frac(name: str, key: str) -> float:
        if missed:
            reasons[name] = f"undefined: the {' and the '.join(missed)} never reached the target"
            return float("nan")
        assert mine is not None and base is not None
        if not base[key]:
            reasons[name] = (
                f"undefined: the baseline's {_TOTAL_NAMES[key]} until it reached the target "
                "is 0 (it reached it at its initial evaluation, or has no figure for it)"
            )
            return float("nan")
        return float(mine[key]) / base[key]

    out: dict[str, Any] = {
        "target_accuracy": target,
        "run": mine,
        "baseline": base,
        "compute_fraction": frac("compute_fraction", "flops"),
        "bytes_fraction": frac("bytes_fraction", "bytes"),
        "time_fraction": frac("time_fraction", "sim_time_s"),
        "energy_fraction": frac("energy_fraction", "energy_j"),
    }
    if reasons:
        out["reasons"] = reasons
    return out
