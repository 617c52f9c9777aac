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
place: that rename is the commit point. Files named by neither index are deleted after it, and
so are the temporary files that saves which crashed left (:func:`remove_temporary_files`; a
resume removes them too). A crash at any moment leaves a ``checkpoint.json`` naming a complete
checkpoint (or, when the save was rewriting the very round that index is at, an index whose
file no longer matches its hash: then the previous checkpoint is used, see below). A write the
system refuses (the disk is full, the folder is read-only: an ``OSError`` with an errno) is one
:class:`CheckpointError` line naming the file; the save's temporary file and the new files no
index names are removed, and the checkpoints written before stay as they were.

**Loading** parses JSON and safetensors only: nothing in a checkpoint is ever executed or
unpickled, and the state is rebuilt by filling a template state of the same run (its dataclass,
names, shapes and dtypes are checked, and each scalar field's type), never by looking up a class
named in the file. This module knows files, not runs: what the records mean comes from the
caller, as a :class:`Contents` (a run's is :data:`radbo.simulation.RUN_CHECKPOINT`, composed of
the schemas and checks the engine's parts declare beside their own code). Each file must be a
regular file no larger than a cap (the index and the history: :attr:`Contents.caps`, for a run
from its config's rounds and clients; the tensors: three times the state's bytes; never more
than an eighth of the machine's memory, :func:`memory_ceiling`), judged by its size on disk
before a byte is read. In order: the index is validated by a pydantic model
(:class:`CheckpointIndex`: ``rounds_done`` an integer >= 0, ``clock_s`` finite, state scalars
JSON scalars, file names plain names without separators, hashes 64 lowercase hex digits; its
engine part of :attr:`Contents.engine`'s schema), then its own hash, then the config; each file
must match its SHA-256; every floating-point tensor must be finite; the history is validated
against :attr:`Contents.row` and :attr:`Contents.ledger_row` (for a run: round records and
ledger rows with the types the run gives them: times, costs and energies finite and not
negative, floats written as floats, evaluations finite, coverage figures and counts of
rejected, dropped and late clients those of the round's lists). Then the **meaning**
(:attr:`Contents.check`; SHA-256 proves that a file is the one written, not that it makes
sense: a checkpoint is a file a user can edit) -- for a run: ``rounds_done`` rounds numbered 0
to ``rounds_done - 1``, on a clock that never runs back and ends at ``clock_s``; ledger rows of
those rounds, in order, charging clients the round sampled; a coverage history of one entry
per round that had clients, for the blocks the rounds report, equal to what they report; the
divergence guard's rollbacks, last good round and diverging flag those the rounds give -- and
every tensor of the state of its template's shape and dtype. Last, the caller's ``restore``
(the engine's :meth:`radbo.simulation.Simulation.load_state_dict`: coverage masks of the
model's shapes, no tensor the engine does not have, each round's costs the sums of its ledger
rows) runs as one more check. Anything damaged, malformed, non-finite or meaningless raises
:class:`CheckpointCorruptError`: one line naming the file and the problem.

**Fallback.** When the newest checkpoint is unusable for any reason -- damaged, malformed,
meaningless, of an older format, too large, unreadable, missing, or holding an engine state the
run cannot restore -- :func:`load_checkpoint` loads ``checkpoint-prev.json`` instead if that one
passes every check, and says so: a :class:`CheckpointWarning` and :attr:`Checkpoint.fallback`
(the reason, which :func:`radbo.run` records in ``results.json`` as ``resumed_from_fallback``).
When neither is usable, one error names both problems. Only a checkpoint from another config is
refused outright (plain :class:`CheckpointError`, no fallback): the config changed or the folder
is another run's, and the previous checkpoint is of the same config. A resumed run never
continues from a state that did not verify.

**Older checkpoints** (``radbo-checkpoint/1``, written before checksums) cannot be verified:
the previous checkpoint is tried, and without one the error says to start afresh (a radbo run
is reproducible from its config, so starting again costs time, never results).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import stat
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictStr,
    ValidationError,
    create_model,
    field_validator,
)
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file
from torch import Tensor

from radbo.atomic import atomic_write, atomic_write_text
from radbo.errors import field_path, more_problems, problems
from radbo.schema import Count, short

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointWarning",
    "Contents",
    "PLAIN",
    "memory_ceiling",
    "has_checkpoint",
    "load_checkpoint",
    "remove_temporary_files",
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
            if not _scalar_fits(value, current) or (
                value is None and current is not None and not _admits_none(template, f.name)
            ):
                raise CheckpointCorruptError(
                    f"state field {f.name!r} is {short(value)} in the checkpoint, not of "
                    f"this run's type ({type(current).__name__})"
                )
            if isinstance(current, float) and value is not None:
                value = float(value)
            values[f.name] = value
    if tensor_keys:
        raise CheckpointError(f"checkpoint holds tensors this run does not: {sorted(tensor_keys)}")
    return dataclasses.replace(template, **values)


def _admits_none(template: Any, name: str) -> bool:
    """Whether the field ``name`` of the dataclass ``template`` is declared to hold ``None``
    (``X | None``, ``Any``, ``object``); a declaration that cannot be resolved admits it."""
    try:
        hint = typing.get_type_hints(type(template)).get(name, Any)
    except Exception:  # a forward reference that does not resolve: nothing to tell by
        return True
    if hint is Any or hint is object or hint is type(None):
        return True
    return type(None) in typing.get_args(hint)


def _scalar_fits(saved: Any, current: Any) -> bool:
    """Whether a stored scalar has the type of the template's value (``None`` fits anything
    here; :func:`state_from_tensors` accepts it only for a field declared optional)."""
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


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Contents:
    """What a checkpoint holds beside the algorithm state, as the component that writes it
    declares it: this module stores and verifies files (sizes, hashes, JSON, safetensors,
    finite tensors, the config), and the caller says what their records mean. A run's engine
    hands :data:`radbo.simulation.RUN_CHECKPOINT`, composed of the schemas its parts declare
    beside their own code (:class:`radbo.cost.LedgerRow`, :class:`radbo.cost.FlopMeterState`,
    :class:`radbo.masks.coverage_report.CoverageState`, :class:`radbo.simulation.RoundRow`).

    Attributes:
        row: the type of one round record of the history (any JSON object by default).
        ledger_row: the type of one ledger row.
        engine: the type of the engine's JSON state in the index (``simulation``).
        check: the meaning of a checkpoint whose files parsed:
            ``check(rounds_done, clock_s, engine, rows, ledger, history_name)`` raises
            ``ValueError`` with a sentence when its counters, history and engine state do not
            fit together (``engine`` is the JSON as written, in its key order).
        caps: ``caps(config)``, the largest index and history files (bytes) a run of
            ``config`` writes (default: :func:`memory_ceiling` for both).
    """

    row: Any = dict[str, Any]
    ledger_row: Any = dict[str, Any]
    engine: Any = dict[str, Any]
    check: Callable[[int, float, Mapping[str, Any], list[Any], list[Any], str], None] | None = None
    caps: Callable[[Mapping[str, Any] | None], tuple[int, int]] | None = None

    @cached_property
    def index_model(self) -> type[CheckpointIndex]:
        """:class:`CheckpointIndex` with this engine state's schema."""
        return create_model(
            "CheckpointIndex", __base__=CheckpointIndex, simulation=(self.engine, ...)
        )

    @cached_property
    def history_model(self) -> type[BaseModel]:
        """The history file (``history-NNNNNN.json``): every round record and ledger row so
        far, of these schemas."""
        return create_model(
            "CheckpointHistory",
            __base__=_Model,
            rows=(list[self.row], ...),  # type: ignore[name-defined]
            ledger=(list[self.ledger_row], ...),  # type: ignore[name-defined]
        )

    def index_cap(self, config: Mapping[str, Any] | None) -> int:
        return self.caps(config)[0] if self.caps is not None else memory_ceiling()

    def history_cap(self, config: Mapping[str, Any] | None) -> int:
        return self.caps(config)[1] if self.caps is not None else memory_ceiling()


#: Files only: any JSON records, no check of their meaning (for states saved outside a run).
PLAIN = Contents()


class FileRef(_Model):
    """A file of the checkpoint (a plain name in its folder) and its SHA-256."""

    file: StrictStr = Field(pattern=_PLAIN_NAME)
    sha256: StrictStr = Field(pattern=_HEX64)


class CheckpointFiles(_Model):
    """The files an index names: the tensors and the history (rows and ledger)."""

    tensors: FileRef
    history: FileRef


class CheckpointIndex(_Model):
    """The checkpoint index (``checkpoint.json``) as :func:`save_checkpoint` writes it."""

    format: Literal["radbo-checkpoint/2"]
    index_sha256: StrictStr = Field(pattern=_HEX64)
    config: dict[str, Any]
    rounds_done: Count
    clock_s: StrictFloat = Field(allow_inf_nan=False)
    files: CheckpointFiles
    state_scalars: dict[str, Any]
    #: the engine's JSON state, of the schema :attr:`Contents.engine` gives
    simulation: dict[str, Any]

    @field_validator("state_scalars")
    @classmethod
    def _scalars_are_scalars(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name, v in value.items():
            if v is not None and not isinstance(v, bool | int | float | str):
                raise ValueError(
                    f"state scalar {name!r} = {short(v)} is not a number, string, "
                    "true/false or null"
                )
        return value


def _describe(error: ValidationError) -> str:
    """The first problem of ``error`` in one line: ``FIELD = VALUE: what is wrong``."""
    found = problems(error)
    first = found[0]
    where = field_path(first.loc)
    msg = first.message
    if first.type in ("model_type", "dict_type"):
        msg = "Input should be a JSON object"
    if first.type == "missing":
        text = f"{where} is missing"
    elif first.type == "extra_forbidden":
        text = f"{where} is an unknown field"
    elif first.type == "value_error":
        text = f"{where}: {msg}" if where else msg
    else:
        text = f"{where} = {short(first.value)}: {msg}"
    more = len(found) - 1
    return text + (f" ({more_problems(more)})" if more else "")


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
    """Whether ``directory`` holds a checkpoint index (the newest or the previous one): a file
    of that name, or anything else in its place (a folder, a link, a pipe), which
    :func:`load_checkpoint` then refuses as damaged, naming it, rather than a resume calling
    the folder empty."""
    directory = Path(directory)
    return os.path.lexists(directory / INDEX) or os.path.lexists(directory / PREVIOUS)


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
    contents: Contents,
) -> Path:
    """Write a checkpoint after ``rounds_done`` rounds into ``directory``; returns the index.

    ``config`` is the run's config as JSON data; :func:`load_checkpoint` compares it;
    ``contents`` sizes the caps (:class:`Contents`). The checkpoint that was the newest becomes
    ``checkpoint-prev.json`` when it verifies and is of an earlier round (see the module
    docstring for the order of the writes).

    A write the system refuses (an :class:`OSError` with an errno: the disk is full, the folder
    is read-only) raises :class:`CheckpointError`, one line naming the file; its temporary file
    and the new files no index names are removed, and the checkpoints written before are
    intact. Temporary files left by saves that crashed are removed after the commit.
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

    try:
        with _writing(directory / names["tensors"]):
            atomic_write(directory / names["tensors"], write_tensors)
        history = _dump({"rows": rows, "ledger": ledger}).encode("utf-8")
        digests["history"] = _sha256(history)
        with _writing(directory / names["history"]):
            atomic_write(directory / names["history"], lambda tmp: tmp.write_bytes(history))
        with _writing(directory / PREVIOUS):
            previous = _keep_as_previous(directory, rounds_done, config, state, contents)
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
        with _writing(directory / INDEX):
            atomic_write_text(directory / INDEX, _dump(index))  # the commit point
    except BaseException:
        # the files of this save that no index names (a crash between two writes leaves them
        # for the next save to delete)
        cap = contents.index_cap(config)
        named = _named_files(directory / INDEX, cap) | _named_files(directory / PREVIOUS, cap)
        for name in names.values():
            if name not in named:
                with suppress(OSError):
                    (directory / name).unlink(missing_ok=True)
        raise
    keep = set(names.values()) | previous
    for pattern in ("state-*.safetensors", "history-*.json"):
        for old in directory.glob(pattern):
            if old.name not in keep:
                with suppress(OSError):
                    old.unlink(missing_ok=True)
    remove_temporary_files(directory)
    return directory / INDEX


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Turn an :class:`OSError` the system raised while writing ``path`` (one with an errno:
    ``ENOSPC``, ``EACCES``, ``EROFS``, ...) into one :class:`CheckpointError` line naming it."""
    try:
        yield
    except OSError as err:
        if err.errno is None:
            raise
        reason = err.strerror or errno.errorcode.get(err.errno, str(err.errno))
        where: Any = path
        named = err.filename if isinstance(err.filename, str) else None
        if named and err.errno in _PATH_ERRORS and not _TEMPORARY.match(Path(named).name):
            where = named  # the folder that cannot be made or written
        raise CheckpointError(
            f"cannot write the checkpoint file {where}: {reason}; the checkpoints written "
            "before are kept"
        ) from None


# errors about the path an OSError names (a folder that cannot be made or written) rather
# than about the data written to it
_PATH_ERRORS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.ENAMETOOLONG)

# the temporary names atomic_write gives the files of a checkpoint: ".NAME.RANDOM.tmp"
_TEMPORARY = re.compile(
    r"^\.(state-\d+\.safetensors|history-\d+\.json|checkpoint\.json|checkpoint-prev\.json)"
    r"\.[A-Za-z0-9_]+\.tmp$"
)


def remove_temporary_files(directory: str | Path) -> list[Path]:
    """Delete the temporary files that saves which crashed left in the checkpoint folder
    ``directory`` (regular files named as :func:`atomic_write` names a checkpoint file's
    temporary copy; nothing else is touched); returns those deleted. Only the run that writes
    the folder may call this: a temporary file is a save in progress until its rename."""
    directory = Path(directory)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not _TEMPORARY.match(entry.name):
            continue
        with suppress(OSError):
            if entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _keep_as_previous(
    directory: Path, rounds_done: int, config: Mapping[str, Any], state: Any, contents: Contents
) -> set[str]:
    """Copy the current index to ``checkpoint-prev.json`` if it verifies (its own hash and its
    files', each no larger than a checkpoint of the run of ``config`` and ``state`` needs) and
    is of an earlier round than ``rounds_done``, else leave the previous one as it is; returns
    the names of the files the previous index names."""
    cap = contents.index_cap(config)
    try:
        raw = _read(directory / INDEX, cap)
        caps = {"tensors": _tensor_cap(state), "history": contents.history_cap(config)}
        index = _verified_index(directory, raw, caps, contents)
    except (OSError, CheckpointError):
        return _named_files(directory / PREVIOUS, cap)  # no current index, or not one to keep
    if index.rounds_done >= rounds_done:
        return _named_files(directory / PREVIOUS, cap)
    atomic_write(directory / PREVIOUS, lambda tmp: tmp.write_bytes(raw))
    return {index.files.tensors.file, index.files.history.file}


def _verified_index(
    directory: Path, raw: bytes, caps: Mapping[str, int], contents: Contents
) -> CheckpointIndex:
    """The index whose bytes are ``raw``, if it and the files it names (each at most its
    ``caps`` bytes) match their hashes."""
    index, _ = _parse_index(directory / INDEX, raw, contents)
    for kind, ref in (("tensors", index.files.tensors), ("history", index.files.history)):
        if _sha256(_read(directory / ref.file, caps[kind])) != ref.sha256:
            raise CheckpointCorruptError(f"{directory / ref.file} is damaged")
    return index


def _named_files(path: Path, cap: int) -> set[str]:
    """The files an index (at most ``cap`` bytes) names, read leniently (none if it cannot
    be read)."""
    try:
        files = json.loads(_read(path, cap).decode("utf-8"))["files"]
        return {
            files[k]["file"] for k in ("tensors", "history") if isinstance(files[k]["file"], str)
        }
    except (CheckpointError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError):
        return set()


def load_checkpoint(
    directory: str | Path,
    *,
    template: Any,
    config: Mapping[str, Any] | None = None,
    ignore: tuple[str, ...] = (),
    restore: Callable[[Checkpoint], object] | None = None,
    contents: Contents,
) -> Checkpoint:
    """Read the checkpoint in ``directory`` into a state shaped like ``template``.

    ``contents`` says what its records are and what makes them meaningful
    (:class:`Contents`; a run's: :data:`radbo.simulation.RUN_CHECKPOINT`).

    With ``config``, the stored config must equal it except for the top-level keys in
    ``ignore`` (e.g. ``rounds``, which a resumed run may raise); a difference raises
    :class:`CheckpointError` naming the first differing key. ``config`` also sizes the caps
    on the files' sizes (:attr:`Contents.caps`).

    ``restore(checkpoint)``, when given, is the last check of a checkpoint: it restores what
    the caller keeps beside the algorithm state (the engine's state,
    :meth:`radbo.simulation.Simulation.load_state_dict`), raising :class:`CheckpointError` or
    ``ValueError`` / ``KeyError`` / ``TypeError`` (...) for a state that does not fit; it
    must leave nothing half-restored when it raises, since the previous checkpoint's restore
    follows.

    Every check of the module docstring runs; when the newest checkpoint is unusable for any
    reason but a config that differs, the previous one is loaded if it passes them all, with
    a :class:`CheckpointWarning` and :attr:`Checkpoint.fallback` set. When neither is usable,
    one :class:`CheckpointCorruptError` names both problems; without a previous checkpoint,
    the newest one's error is raised as it is.
    """
    directory = Path(directory)
    if not has_checkpoint(directory):
        raise CheckpointError(f"no checkpoint in {directory} (no {INDEX})")
    try:
        return _load(directory, INDEX, template, config, ignore, restore, contents)
    except _ConfigMismatch as err:
        raise CheckpointError(str(err)) from None
    except CheckpointError as err:
        refused = err
    if not os.path.lexists(directory / PREVIOUS):
        raise refused
    try:
        ckpt = _load(directory, PREVIOUS, template, config, ignore, restore, contents)
    except CheckpointError as err:
        raise CheckpointCorruptError(
            f"{refused}; the previous checkpoint is refused too: {err}"
        ) from None
    ckpt.fallback = str(refused)
    warnings.warn(
        f"{refused}; resuming from the previous checkpoint ({directory / PREVIOUS}, "
        f"after round {ckpt.rounds_done}) instead",
        CheckpointWarning,
        stacklevel=2,
    )
    return ckpt


class _ConfigMismatch(CheckpointError):
    """The checkpoint was written by another config: a wrong folder or a changed config, not
    a damaged checkpoint, so :func:`load_checkpoint` does not fall back."""


# what a restore callback raises for an engine state it cannot take
_RESTORE_ERRORS = (
    AttributeError,
    IndexError,
    KeyError,
    OverflowError,
    RecursionError,
    TypeError,
    ValueError,
)


def _load(
    directory: Path,
    name: str,
    template: Any,
    config: Mapping[str, Any] | None,
    ignore: tuple[str, ...],
    restore: Callable[[Checkpoint], object] | None,
    contents: Contents,
) -> Checkpoint:
    """The checkpoint whose index is ``directory / name``, after every check of the module
    docstring's **Loading**, in its order: the index, the config (unless ``config`` is None;
    keys in ``ignore`` may differ), the tensors, the history, the counters, the state against
    ``template``, and last ``restore``."""
    path = directory / name
    if not os.path.lexists(path):  # anything else in its place: not a regular file (_read)
        raise CheckpointCorruptError(f"{path} is missing")
    index, data = _parse_index(path, _read(path, contents.index_cap(config)), contents)
    if config is not None:
        _check_same_config(directory, index, config, ignore)
    tensors = _load_tensors(directory, index, template)
    history_path = directory / index.files.history.file
    history = _load_history(history_path, index, config, contents)
    if contents.check is not None:
        try:
            contents.check(
                index.rounds_done,
                index.clock_s,
                data["simulation"],
                history["rows"],
                history["ledger"],
                history_path.name,
            )
        except ValueError as err:
            raise CheckpointCorruptError(f"{path}: {err}") from None
    sim_tensors = {k[4:]: t for k, t in tensors.items() if k.startswith("sim/")}
    state_tensors = {k: t for k, t in tensors.items() if not k.startswith("sim/")}
    try:
        state = state_from_tensors(template, state_tensors, index.state_scalars)
    except CheckpointCorruptError:
        raise
    except CheckpointError as err:  # the config is this run's: its tensors must fit
        raise CheckpointCorruptError(f"{path}: {err}") from None
    ckpt = Checkpoint(
        rounds_done=index.rounds_done,
        clock_s=float(index.clock_s),
        state=state,
        rows=history["rows"],
        ledger=history["ledger"],
        sim_tensors=sim_tensors,
        sim_meta=data["simulation"],
    )
    if restore is not None:
        _restore(path, ckpt, restore)
    return ckpt


def _check_same_config(
    directory: Path, index: CheckpointIndex, config: Mapping[str, Any], ignore: tuple[str, ...]
) -> None:
    """Refuse (:class:`_ConfigMismatch`, no fallback) a checkpoint written by another config
    than ``config`` (keys in ``ignore`` aside), naming the first differences."""
    differences = _config_differences(index.config, dict(config), ignore)
    if differences:
        shown = "; ".join(differences[:_SHOWN_DIFFERENCES])
        if len(differences) > _SHOWN_DIFFERENCES:
            shown += f"; and {len(differences) - _SHOWN_DIFFERENCES} more"
        raise _ConfigMismatch(
            f"the checkpoint in {directory} was written by a different config ({shown}); "
            "use another output_dir, or start afresh without resume (radbo run "
            "--overwrite)"
        )


def _load_tensors(directory: Path, index: CheckpointIndex, template: Any) -> dict[str, Tensor]:
    """The checkpoint's tensor file, read (at most three times ``template``'s bytes), matched
    against its SHA-256 and parsed as safetensors; every floating-point tensor finite."""
    tensors_path = directory / index.files.tensors.file
    raw = _read_verified(tensors_path, index.files.tensors.sha256, _tensor_cap(template))
    try:
        tensors = load_bytes(raw)
    except MemoryError:
        raise CheckpointCorruptError(f"{tensors_path} does not fit in memory") from None
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointCorruptError(f"cannot read {tensors_path}: {_one_line(str(err))}") from None
    del raw
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
    return tensors


def _load_history(
    history_path: Path,
    index: CheckpointIndex,
    config: Mapping[str, Any] | None,
    contents: Contents,
) -> dict[str, Any]:
    """The checkpoint's history file, read (at most the cap of ``config``'s run), matched
    against its SHA-256 and validated by :attr:`Contents.history_model`."""
    content = _read_verified(history_path, index.files.history.sha256, contents.history_cap(config))
    history = _parse_json(history_path, content, "checkpoint history")
    del content
    try:
        contents.history_model.model_validate(history)
    except ValidationError as err:
        raise CheckpointCorruptError(
            f"{history_path} is a malformed checkpoint history: {_describe(err)}"
        ) from None
    return history


def _restore(path: Path, ckpt: Checkpoint, restore: Callable[[Checkpoint], object]) -> None:
    """Run the caller's ``restore`` on ``ckpt`` as one more check: what it refuses (a
    :class:`CheckpointError` or one of :data:`_RESTORE_ERRORS`) makes the checkpoint at
    ``path`` corrupt, in one line."""
    try:
        restore(ckpt)
    except CheckpointError as err:
        raise CheckpointCorruptError(
            f"{path} holds an engine state this run cannot restore: {err}"
        ) from None
    except _RESTORE_ERRORS as err:
        detail = _one_line(str(err))
        if isinstance(err, KeyError) or not detail:
            detail = f"{type(err).__name__} {detail}".strip()
        if len(detail) > 300:
            detail = detail[:297] + "..."
        raise CheckpointCorruptError(
            f"{path} holds an engine state this run cannot restore: {detail}"
        ) from None


# -- size caps ----------------------------------------------------------------------------

#: A tensor file holds the state, the state before it (the divergence guard's) and one bool
#: mask per model tensor (coverage), besides its header (a few hundred bytes per tensor).
TENSOR_HEADER_BYTES = 1 << 20
TENSOR_KEY_BYTES = 4 << 10


def _tensor_cap(template: Any) -> int:
    """The largest tensor file (bytes) a run whose state is shaped like ``template`` writes:
    three times the state's bytes (itself, the state before, bool masks) and the header."""
    nbytes = keys = 0
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        for f in dataclasses.fields(template):
            value = getattr(template, f.name)
            if isinstance(value, Mapping):
                for t in value.values():
                    if isinstance(t, Tensor):
                        nbytes += t.numel() * t.element_size()
                        keys += 1
    cap = 3 * nbytes + TENSOR_HEADER_BYTES + 3 * keys * TENSOR_KEY_BYTES
    return min(cap, memory_ceiling())


def memory_ceiling() -> int:
    """An eighth of the machine's memory (at least 64 MiB): a JSON file takes several times
    its size once parsed, so a larger checkpoint file could not be loaded anyway."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        total = 8 << 30
    return max(total // 8, 64 << 20)


# -- reading ------------------------------------------------------------------------------


def _read(path: Path, cap: int) -> bytes:
    """The bytes of the regular file ``path``, refused (:class:`CheckpointCorruptError`) when
    it is larger than ``cap`` by its size on disk, before anything is read, or is not a regular
    file (a FIFO is opened without blocking and refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise CheckpointCorruptError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointCorruptError(f"{path} is not a regular file")
        if info.st_size > cap:
            raise CheckpointCorruptError(
                f"{path} is {info.st_size:,} bytes, more than the {cap:,} any checkpoint of "
                "this run needs"
            )
        chunks = []
        size = 0
        while size <= cap:
            chunk = os.read(fd, min(cap + 1 - size, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > cap:
            raise CheckpointCorruptError(f"{path} grew past {cap:,} bytes while it was read")
        return b"".join(chunks)
    except OSError as err:
        raise CheckpointCorruptError(f"cannot read {path}: {err.strerror or err}") from None
    except MemoryError:
        raise CheckpointCorruptError(f"{path} does not fit in memory") from None
    finally:
        os.close(fd)


def _read_verified(path: Path, sha256: str, cap: int) -> bytes:
    """The bytes of ``path`` (at most ``cap``) after checking their SHA-256."""
    if not os.path.lexists(path):  # anything else in its place: not a regular file (_read)
        raise CheckpointCorruptError(f"{path} is missing")
    content = _read(path, cap)
    if _sha256(content) != sha256:
        raise CheckpointCorruptError(
            f"{path} does not match the SHA-256 its index records: the file is damaged"
        )
    return content


def _parse_json(path: Path, raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except MemoryError:
        raise CheckpointCorruptError(f"{path} does not fit in memory") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        detail = "nested too deeply" if isinstance(err, RecursionError) else _one_line(str(err))
        raise CheckpointCorruptError(f"{path} is not a readable {what}: {detail}") from None


def _parse_index(
    path: Path, raw: bytes, contents: Contents
) -> tuple[CheckpointIndex, dict[str, Any]]:
    """Parse, validate and hash-check the index at ``path`` (content ``raw``); returns the
    model and the parsed JSON (the simulation state as written, in its key order)."""
    data = _parse_json(path, raw, "checkpoint index")
    if isinstance(data, dict) and data.get("format") in OLD_FORMATS:
        # not a damaged file, but not one to continue from: the previous checkpoint is tried
        raise CheckpointError(
            f"{path} is a {data['format']} checkpoint, written before checkpoints carried "
            f"checksums, so it cannot be verified; start the run afresh (delete {path.parent} "
            "or use another output_dir)"
        )
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path} is not a {FORMAT} index")
    try:
        index = contents.index_model.model_validate(data)
    except ValidationError as err:
        raise CheckpointCorruptError(
            f"{path} is a malformed checkpoint index: {_describe(err)}"
        ) from None
    try:
        intact = _index_digest(data) == index.index_sha256
    except (RecursionError, ValueError):
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
    return "absent" if value is _ABSENT else short(value, 60)
