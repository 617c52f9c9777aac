"""Checkpoints of a run that prove their integrity: safetensors for tensors, JSON for the rest.

A checkpoint after round NNNNNN is three files in one folder:

- ``state-NNNNNN.safetensors``: every tensor of the algorithm state (``"x/<name>"``,
  ``"y/<name>"``, ``"buffers/<name>"``, ... one prefix per field of the state dataclass) and of
  the engine's cross-round state (``"sim/..."``: the coverage trackers' never-trained masks);
- ``history-NNNNNN.json``: every round record and ledger row so far (``rows``, ``ledger``);
- ``checkpoint.json``, the index: the format tag (``radbo-checkpoint/2``), the config that wrote
  it, the number of rounds done, the virtual clock, the state's scalar fields, the engine's JSON
  state (coverage history, FLOP-meter cache), the two files above each with its **SHA-256**
  (``files``), and ``index_sha256``, the SHA-256 of the index's own JSON text without that
  field (so a flipped digit in a round count is caught too, not only damage to the files).

Beside it, ``checkpoint-prev.json`` is the index of the checkpoint before (whose two files are
kept too): the fallback.

**Writing** is atomic and crash-safe. Each file is written to a temporary name in the same folder,
flushed, and renamed over the old one. A save writes the new tensor and history files, then
copies the current index to ``checkpoint-prev.json`` (only when that index verifies -- its own
hash and its files' -- and is of an earlier round), then renames the new ``checkpoint.json`` into
place: that rename is the commit point. Files named by neither index are deleted after it. A
crash at any moment leaves a ``checkpoint.json`` naming a complete checkpoint (or, when the save
was rewriting the very round that index is at, an index whose file no longer matches its hash:
then the previous checkpoint is used, see below).

**Loading** parses JSON and safetensors only: nothing in a checkpoint is ever executed or
unpickled, and the state is rebuilt by filling a template state of the same run (its dataclass,
names, shapes and dtypes are checked, and each scalar field's type), never by looking up a class
named in the file. In order: the index is validated by a pydantic model
(:class:`CheckpointIndex`: ``rounds_done`` an integer >= 0, ``clock_s`` finite, state scalars
JSON scalars, file names plain names without separators, hashes 64 lowercase hex digits),
then its own hash, then the config; each file must match its SHA-256; every floating-point
tensor must be finite; the history is validated by :class:`CheckpointHistory` (round records
and ledger rows with the types the run gives them). Anything damaged, malformed or non-finite
raises :class:`CheckpointCorruptError`: one line naming the file and the problem.

**Fallback.** When the newest checkpoint is refused as damaged (:class:`CheckpointCorruptError`,
or its index is missing), :func:`load_checkpoint` loads ``checkpoint-prev.json`` instead if that
one passes every check, and says so: a :class:`CheckpointWarning` and
:attr:`Checkpoint.fallback` (the reason, which :func:`radbo.run` records in ``results.json`` as
``resumed_from_fallback``). When neither verifies, one error names both problems. A checkpoint
from another config, or whose tensors do not fit the run, is refused outright (plain
:class:`CheckpointError`, no fallback): that is a wrong folder, not a damaged file. A resumed run
never continues from a state that did not verify.

**Older checkpoints** (``radbo-checkpoint/1``, written before checksums) are refused with one line
saying to start afresh: they cannot be verified, and a radbo run is reproducible from its config,
so starting again costs time, never results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NotRequired

import torch
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file
from torch import Tensor
from typing_extensions import TypedDict

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointWarning",
    "atomic_write",
    "atomic_write_text",
    "has_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "state_from_tensors",
    "state_to_tensors",
]

FORMAT = "radbo-checkpoint/2"
OLD_FORMATS = ("radbo-checkpoint/1",)
INDEX = "checkpoint.json"
PREVIOUS = "checkpoint-prev.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or does not belong to this run."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint is damaged: unreadable, malformed, not matching its SHA-256, or holding
    NaN/Inf. :func:`load_checkpoint` falls back to the previous checkpoint on this error."""


class CheckpointWarning(UserWarning):
    """A resume continues from the previous checkpoint because the newest one was refused."""


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Create ``path`` atomically: ``write(tmp)`` fills a temporary file in the same folder,
    which is flushed to disk and then renamed over ``path`` (what ``write`` returns is
    ignored)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        # mkstemp makes the file private (0600); give it the permissions a plain open() would
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (temporary file + rename)."""
    atomic_write(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"))


def state_to_tensors(state: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split an algorithm state dataclass into ``(tensors, scalars)``.

    A field holding a dict of tensors becomes ``"field/name"`` entries; a field holding an int,
    float, bool, str or ``None`` goes to ``scalars``. Anything else is an error: radbo states
    are tensors and scalars only.

    >>> import torch
    >>> from radbo.algorithms.rabo import RABOState
    >>> t, s = state_to_tensors(RABOState({"a": torch.ones(2)}, {"b": torch.zeros(1)}, {}, 3))
    >>> sorted(t), s
    (['x/a', 'y/b'], {'round': 3})
    """
    if not dataclasses.is_dataclass(state) or isinstance(state, type):
        raise TypeError(f"an algorithm state must be a dataclass instance, got {type(state)!r}")
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    for f in dataclasses.fields(state):
        value = getattr(state, f.name)
        if isinstance(value, Mapping):
            for name, t in value.items():
                if not isinstance(t, Tensor):
                    raise TypeError(f"state field {f.name}[{name!r}] is not a tensor: {t!r}")
                # safetensors refuses shared storage and strided views: store a compact copy
                tensors[f"{f.name}/{name}"] = t.detach().cpu().contiguous().clone()
        elif value is None or isinstance(value, bool | int | float | str):
            scalars[f.name] = value
        else:
            raise TypeError(
                f"state field {f.name!r} holds a {type(value).__name__}; a checkpointable "
                "state holds dicts of tensors and scalars only"
            )
    return tensors, scalars


def state_from_tensors(template: Any, tensors: Mapping[str, Tensor], scalars: Mapping[str, Any]):
    """Rebuild a state shaped like ``template`` from :func:`state_to_tensors` output.

    The names, shapes and dtypes of every tensor field and the set of scalar fields must be
    those of ``template``; otherwise :class:`CheckpointError` names the first difference.
    """
    tensor_keys = set(tensors)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(template):
        current = getattr(template, f.name)
        if isinstance(current, Mapping):
            block = {}
            for name, t in current.items():
                key = f"{f.name}/{name}"
                if key not in tensors:
                    raise CheckpointError(f"checkpoint has no tensor {key!r}")
                saved = tensors[key]
                if saved.shape != t.shape or saved.dtype != t.dtype:
                    raise CheckpointError(
                        f"checkpoint tensor {key!r} is {saved.dtype} {tuple(saved.shape)}, "
                        f"this run has {t.dtype} {tuple(t.shape)}"
                    )
                block[name] = saved.to(t.device)
                tensor_keys.discard(key)
            values[f.name] = block
        else:
            if f.name not in scalars:
                raise CheckpointError(f"checkpoint has no value for state field {f.name!r}")
            value = scalars[f.name]
            if not _scalar_fits(value, current):
                raise CheckpointCorruptError(
                    f"state field {f.name!r} is {_short(value)} in the checkpoint, not of "
                    f"this run's type ({type(current).__name__})"
                )
            if isinstance(current, float) and value is not None:
                value = float(value)
            values[f.name] = value
    if tensor_keys:
        raise CheckpointError(f"checkpoint holds tensors this run does not: {sorted(tensor_keys)}")
    return dataclasses.replace(template, **values)


def _scalar_fits(saved: Any, current: Any) -> bool:
    """Whether a stored scalar has the type of the template's value (``None`` fits anything:
    optional fields)."""
    if saved is None or current is None:
        return True
    if isinstance(current, bool):
        return isinstance(saved, bool)
    if isinstance(current, int):
        return isinstance(saved, int) and not isinstance(saved, bool)
    if isinstance(current, float):
        return isinstance(saved, int | float) and not isinstance(saved, bool)
    if isinstance(current, str):
        return isinstance(saved, str)
    return True


# -- the index and history models ---------------------------------------------------------

_HEX64 = r"^[0-9a-f]{64}$"
# a plain file name in the checkpoint folder: no separators, no leading dot (so no "..")
_PLAIN_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
_Count = Annotated[StrictInt, Field(ge=0)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# rows and ledger rows are TypedDicts: pydantic checks them several times faster than models,
# which matters for the ledger of a long run (one row per client, phase and round)
class LedgerRow(TypedDict):
    """One ledger row: the fields of :class:`radbo.cost.LedgerEntry`, with their types."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    round: _Count
    phase: StrictStr
    client: _Count
    tier: StrictStr
    flops: _Count
    n_grad: _Count
    n_hvp: _Count
    samples: _Count
    bytes_down: _Count
    bytes_up: _Count
    compute_s: StrictFloat
    comm_s: StrictFloat
    # joules, None when the device gave no figure; rows written before energy was accounted
    # lack the keys and read back as None (unknown)
    energy_compute_j: NotRequired[Annotated[float | None, Strict()]]
    energy_radio_j: NotRequired[Annotated[float | None, Strict()]]


class CoverageRow(TypedDict):
    """One round of a coverage tracker's history: the fields of
    :class:`radbo.masks.RoundCoverage`, with their types."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[misc]
    round: _Count
    min_coverage: _Count
    min_coverage_so_far: _Count
    histogram: list[_Count]
    untrained_fraction: StrictFloat
    never_trained_fraction: StrictFloat
    numel: _Count


class RoundRow(TypedDict):
    """One round record (``RoundRecord.as_dict()``): the engine's fields typed, metrics free
    (but evaluations, ``test_*``, are numbers)."""

    __pydantic_config__ = ConfigDict(extra="allow")  # type: ignore[misc]
    round: _Count
    clients: list[StrictInt]
    unavailable: list[StrictInt]
    rejected: dict[str, list[StrictInt]]
    dropped: NotRequired[dict[str, list[StrictInt]]]
    late: NotRequired[dict[str, list[StrictInt]]]
    communication_rounds: _Count
    wall_time_s: StrictFloat
    sim_round_time_s: StrictFloat
    sim_clock_s: StrictFloat


def _evaluations_are_numbers(row: RoundRow) -> RoundRow:
    for key, value in row.items():
        if key.startswith("test_") and not _is_number(value):
            raise ValueError(f"{key} = {_short(value)} is not a number")
    return row


class FileRef(_Model):
    """A file of the checkpoint (a plain name in its folder) and its SHA-256."""

    file: StrictStr = Field(pattern=_PLAIN_NAME)
    sha256: StrictStr = Field(pattern=_HEX64)


class CheckpointFiles(_Model):
    """The files an index names: the tensors and the history (rows and ledger)."""

    tensors: FileRef
    history: FileRef


class CoverageState(_Model):
    """One coverage tracker's JSON state (:meth:`radbo.masks.CoverageTracker.state_dict`)."""

    names: list[StrictStr] = Field(min_length=1)
    history: list[CoverageRow]


class FlopMeterState(_Model):
    """The FLOP meter's JSON state (:meth:`radbo.cost.FlopMeter.state_dict`)."""

    measurements: _Count
    cache: list[tuple[Any, StrictInt]]
    points: list[tuple[Any, list[tuple[StrictInt, StrictInt]]]] = []
    lines: list[tuple[Any, tuple[StrictInt, StrictInt, StrictInt] | None]] = []
    families: list[Any] = []


class SimulationState(BaseModel):
    """The engine's JSON state (:meth:`radbo.simulation.Simulation.state_dict`); parts other
    than coverage and the FLOP meter (the divergence guard's) are its own to check."""

    model_config = ConfigDict(extra="allow")
    coverage: dict[str, CoverageState] = {}
    flop_meter: FlopMeterState | None = None


class CheckpointIndex(_Model):
    """The checkpoint index (``checkpoint.json``) as :func:`save_checkpoint` writes it."""

    format: Literal["radbo-checkpoint/2"]
    index_sha256: StrictStr = Field(pattern=_HEX64)
    config: dict[str, Any]
    rounds_done: _Count
    clock_s: StrictFloat = Field(allow_inf_nan=False)
    files: CheckpointFiles
    state_scalars: dict[str, Any]
    simulation: SimulationState

    @field_validator("state_scalars")
    @classmethod
    def _scalars_are_scalars(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, v in value.items():
            if v is not None and not isinstance(v, bool | int | float | str):
                raise ValueError(
                    f"state scalar {name!r} = {_short(v)} is not a number, string, "
                    "true/false or null"
                )
        return value


class CheckpointHistory(_Model):
    """The history file (``history-NNNNNN.json``): every round record and ledger row so far."""

    rows: list[Annotated[RoundRow, AfterValidator(_evaluations_are_numbers)]]
    ledger: list[LedgerRow]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(part)):
            out += f".{part}" if out else str(part)
        else:
            out += f"[{str(part)!r}]"
    return out


def _describe(error: ValidationError) -> str:
    """The first problem of ``error`` in one line: ``FIELD = VALUE: what is wrong``."""
    errors = error.errors()
    first = errors[0]
    where = _location(tuple(first["loc"]))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] in ("model_type", "dict_type"):
        msg = "Input should be a JSON object"
    if first["type"] == "missing":
        text = f"{where} is missing"
    elif first["type"] == "extra_forbidden":
        text = f"{where} is an unknown field"
    elif first["type"] == "value_error":
        text = f"{where}: {msg}" if where else msg
    else:
        text = f"{where} = {_short(first.get('input'))}: {msg}"
    more = len(errors) - 1
    return text + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# -- hashing ------------------------------------------------------------------------------


def _dump(data: Any) -> str:
    return json.dumps(data, allow_nan=True)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _index_digest(body: Mapping[str, Any]) -> str:
    """SHA-256 of the index's JSON text without ``index_sha256``. JSON numbers, strings and
    key order survive ``json.loads`` / ``json.dumps`` unchanged, so the loader recomputes it
    from the parsed index."""
    rest = {k: v for k, v in body.items() if k != "index_sha256"}
    return _sha256(_dump(rest).encode("utf-8"))


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns.

    Attributes:
        rounds_done: rounds completed; the run goes on with round ``rounds_done``.
        clock_s: the virtual clock after those rounds.
        state: the algorithm state after them.
        rows: ``RoundRecord.as_dict()`` of every round so far.
        ledger: the ledger rows (``LedgerEntry`` as dicts) so far.
        sim_tensors / sim_meta: the engine's cross-round state
            (:meth:`radbo.simulation.Simulation.state_dict`).
        fallback: ``None`` when this is the newest checkpoint; else why the newest was refused
            (this is then the previous one).
    """

    rounds_done: int
    clock_s: float
    state: Any
    rows: list[dict[str, Any]] = field(default_factory=list)
    ledger: list[dict[str, Any]] = field(default_factory=list)
    sim_tensors: dict[str, Tensor] = field(default_factory=dict)
    sim_meta: dict[str, Any] = field(default_factory=dict)
    fallback: str | None = None


def has_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` holds a checkpoint index (the newest or the previous one)."""
    directory = Path(directory)
    return (directory / INDEX).is_file() or (directory / PREVIOUS).is_file()


def save_checkpoint(
    directory: str | Path,
    *,
    config: Mapping[str, Any],
    state: Any,
    rounds_done: int,
    clock_s: float,
    rows: list[dict[str, Any]],
    ledger: list[dict[str, Any]],
    sim_tensors: Mapping[str, Tensor],
    sim_meta: Mapping[str, Any],
) -> Path:
    """Write a checkpoint after ``rounds_done`` rounds into ``directory``; returns the index.

    ``config`` is the run's config as JSON data; :func:`load_checkpoint` compares it. The
    checkpoint that was the newest becomes ``checkpoint-prev.json`` when it verifies and is of
    an earlier round (see the module docstring for the order of the writes).
    """
    directory = Path(directory)
    tensors, scalars = state_to_tensors(state)
    for key, t in sim_tensors.items():
        tensors[f"sim/{key}"] = t.detach().cpu().contiguous().clone()
    names = {
        "tensors": f"state-{rounds_done:06d}.safetensors",
        "history": f"history-{rounds_done:06d}.json",
    }
    digests: dict[str, str] = {}

    def write_tensors(tmp: Path) -> None:
        save_file(tensors, str(tmp))
        digests["tensors"] = _sha256(tmp.read_bytes())

    atomic_write(directory / names["tensors"], write_tensors)
    history = _dump({"rows": rows, "ledger": ledger}).encode("utf-8")
    digests["history"] = _sha256(history)
    atomic_write(directory / names["history"], lambda tmp: tmp.write_bytes(history))
    previous = _keep_as_previous(directory, rounds_done)
    body: dict[str, Any] = {
        "format": FORMAT,
        "config": config,
        "rounds_done": rounds_done,
        "clock_s": clock_s,
        "files": {k: {"file": names[k], "sha256": digests[k]} for k in names},
        "state_scalars": scalars,
        "simulation": dict(sim_meta),
    }
    # the digest is that of the JSON text a loader re-dumps (so tuples become lists first)
    body = json.loads(_dump(body))
    index = {"format": FORMAT, "index_sha256": _index_digest(body), **body}
    atomic_write_text(directory / INDEX, _dump(index))  # the commit point
    keep = set(names.values()) | previous
    for pattern in ("state-*.safetensors", "history-*.json"):
        for old in directory.glob(pattern):
            if old.name not in keep:
                old.unlink(missing_ok=True)
    return directory / INDEX


def _keep_as_previous(directory: Path, rounds_done: int) -> set[str]:
    """Copy the current index to ``checkpoint-prev.json`` if it verifies (its own hash and its
    files') and is of an earlier round than ``rounds_done``, else leave the previous one as it
    is; returns the names of the files the previous index names."""
    try:
        raw = (directory / INDEX).read_bytes()
        index = _verified_index(directory, raw)
    except (OSError, CheckpointError):
        return _named_files(directory / PREVIOUS)  # no current index, or not one to keep
    if index.rounds_done >= rounds_done:
        return _named_files(directory / PREVIOUS)
    atomic_write(directory / PREVIOUS, lambda tmp: tmp.write_bytes(raw))
    return {index.files.tensors.file, index.files.history.file}


def _verified_index(directory: Path, raw: bytes) -> CheckpointIndex:
    """The index whose bytes are ``raw``, if it and the files it names match their hashes."""
    index, _ = _parse_index(directory / INDEX, raw)
    for ref in (index.files.tensors, index.files.history):
        if _sha256((directory / ref.file).read_bytes()) != ref.sha256:
            raise CheckpointCorruptError(f"{directory / ref.file} is damaged")
    return index


def _named_files(path: Path) -> set[str]:
    """The files an index names, read leniently (none if it cannot be read)."""
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        return {
            files[k]["file"] for k in ("tensors", "history") if isinstance(files[k]["file"], str)
        }
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError):
        return set()


def load_checkpoint(
    directory: str | Path,
    *,
    template: Any,
    config: Mapping[str, Any] | None = None,
    ignore: tuple[str, ...] = (),
) -> Checkpoint:
    """Read the checkpoint in ``directory`` into a state shaped like ``template``.

    With ``config``, the stored config must equal it except for the top-level keys in
    ``ignore`` (e.g. ``rounds``, which a resumed run may raise); a difference raises
    :class:`CheckpointError` naming the first differing key.

    Every check of the module docstring runs; when the newest checkpoint is damaged
    (:class:`CheckpointCorruptError`) the previous one is loaded if it passes them all, with a
    :class:`CheckpointWarning` and :attr:`Checkpoint.fallback` set. When neither verifies, one
    :class:`CheckpointCorruptError` names both problems.
    """
    directory = Path(directory)
    if not has_checkpoint(directory):
        raise CheckpointError(f"no checkpoint in {directory} (no {INDEX})")
    try:
        return _load(directory, INDEX, template, config, ignore)
    except CheckpointCorruptError as err:
        refused = str(err)
    if not (directory / PREVIOUS).is_file():
        raise CheckpointCorruptError(refused)
    try:
        ckpt = _load(directory, PREVIOUS, template, config, ignore)
    except CheckpointError as err:
        raise CheckpointCorruptError(
            f"{refused}; the previous checkpoint is refused too: {err}"
        ) from None
    ckpt.fallback = refused
    warnings.warn(
        f"{refused}; resuming from the previous checkpoint ({directory / PREVIOUS}, "
        f"after round {ckpt.rounds_done}) instead",
        CheckpointWarning,
        stacklevel=2,
    )
    return ckpt


def _load(
    directory: Path,
    name: str,
    template: Any,
    config: Mapping[str, Any] | None,
    ignore: tuple[str, ...],
) -> Checkpoint:
    path = directory / name
    if not path.is_file():
        raise CheckpointCorruptError(f"{path} is missing")
    index, data = _parse_index(path, _read(path))
    if config is not None:
        differences = _config_differences(index.config, dict(config), ignore)
        if differences:
            shown = "; ".join(differences[:_SHOWN_DIFFERENCES])
            if len(differences) > _SHOWN_DIFFERENCES:
                shown += f"; and {len(differences) - _SHOWN_DIFFERENCES} more"
            raise CheckpointError(
                f"the checkpoint in {directory} was written by a different config ({shown}); "
                "use another output_dir, or start afresh without resume (radbo run "
                "--overwrite)"
            )
    tensors_path = directory / index.files.tensors.file
    try:
        tensors = load_bytes(_read_verified(tensors_path, index.files.tensors.sha256))
    except CheckpointError:
        raise
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointCorruptError(f"cannot read {tensors_path}: {_one_line(str(err))}") from None
    for key, t in tensors.items():
        if not (t.is_floating_point() or t.is_complex()):
            continue
        try:  # a lying header may name a dtype torch cannot test (float8: NotImplementedError)
            finite = bool(torch.isfinite(t).all())
        except (NotImplementedError, RuntimeError):
            raise CheckpointCorruptError(
                f"{tensors_path}: tensor {key!r} has dtype {t.dtype}, which no radbo run saves"
            ) from None
        if not finite:
            raise CheckpointCorruptError(f"{tensors_path}: tensor {key!r} holds NaN or Inf")
    history_path = directory / index.files.history.file
    content = _read_verified(history_path, index.files.history.sha256)
    history = _parse_json(history_path, content, "checkpoint history")
    try:
        CheckpointHistory.model_validate(history)
    except ValidationError as err:
        raise CheckpointCorruptError(
            f"{history_path} is a malformed checkpoint history: {_describe(err)}"
        ) from None
    sim_tensors = {k[4:]: t for k, t in tensors.items() if k.startswith("sim/")}
    state_tensors = {k: t for k, t in tensors.items() if not k.startswith("sim/")}
    state = state_from_tensors(template, state_tensors, index.state_scalars)
    return Checkpoint(
        rounds_done=index.rounds_done,
        clock_s=float(index.clock_s),
        state=state,
        rows=history["rows"],
        ledger=history["ledger"],
        sim_tensors=sim_tensors,
        sim_meta=data["simulation"],
    )


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise CheckpointCorruptError(f"cannot read {path}: {err.strerror or err}") from None


def _read_verified(path: Path, sha256: str) -> bytes:
    """The bytes of ``path`` after checking their SHA-256."""
    if not path.is_file():
        raise CheckpointCorruptError(f"{path} is missing")
    content = _read(path)
    if _sha256(content) != sha256:
        raise CheckpointCorruptError(
            f"{path} does not match the SHA-256 its index records: the file is damaged"
        )
    return content


def _parse_json(path: Path, raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        detail = "nested too deeply" if isinstance(err, RecursionError) else _one_line(str(err))
        raise CheckpointCorruptError(f"{path} is not a readable {what}: {detail}") from None


def _parse_index(path: Path, raw: bytes) -> tuple[CheckpointIndex, dict[str, Any]]:
    """Parse, validate and hash-check the index at ``path`` (content ``raw``); returns the
    model and the parsed JSON (the simulation state as written, in its key order)."""
    data = _parse_json(path, raw, "checkpoint index")
    if isinstance(data, dict) and data.get("format") in OLD_FORMATS:
        raise CheckpointError(
            f"{path} is a {data['format']} checkpoint, written before checkpoints carried "
            f"checksums, so it cannot be verified; start the run afresh (delete {path.parent} "
            "or use another output_dir)"
        )
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path} is not a {FORMAT} index")
    try:
        index = CheckpointIndex.model_validate(data)
    except ValidationError as err:
        raise CheckpointCorruptError(
            f"{path} is a malformed checkpoint index: {_describe(err)}"
        ) from None
    try:
        intact = _index_digest(data) == index.index_sha256
    except RecursionError:
        intact = False
    if not intact:
        raise CheckpointCorruptError(
            f"{path} does not match its index_sha256: the index was changed or damaged after "
            "it was written"
        )
    return index, data


# differing config keys a refused resume names (the rest are counted)
_SHOWN_DIFFERENCES = 5
_ABSENT = object()


def _config_differences(saved: Any, current: dict[str, Any], ignore: tuple[str, ...]) -> list[str]:
    """Each key whose value differs between the stored config and ``current`` (top-level
    keys in ``ignore`` aside), by its dotted path: ``algorithm.inner_lr: 0.1 then, 0.2 now``.
    Sections are compared key by key, except that a section of another kind (its ``name`` or
    ``kind`` tag differs) is named by its tag alone."""
    if not isinstance(saved, dict):
        return ["no config stored"]
    found: list[str] = []
    _differences(saved, current, (), ignore, found)
    return found


def _differences(
    saved: dict[str, Any],
    current: dict[str, Any],
    path: tuple[str, ...],
    ignore: tuple[str, ...],
    found: list[str],
) -> None:
    for key in sorted(set(saved) | set(current), key=str):
        if not path and key in ignore:
            continue
        old, new = saved.get(key, _ABSENT), current.get(key, _ABSENT)
        if old == new:
            continue
        where = (*path, str(key))
        if isinstance(old, dict) and isinstance(new, dict):
            tag = next((t for t in ("name", "kind") if t in old and t in new), None)
            if tag is not None and old[tag] != new[tag]:
                where = (*where, tag)
                old, new = old[tag], new[tag]
            else:
                _differences(old, new, where, (), found)
                continue
        found.append(f"{'.'.join(where)}: {_then(old)} then, {_then(new)} now")


def _then(value: Any) -> str:
    return "absent" if value is _ABSENT else _short(value, 60)
