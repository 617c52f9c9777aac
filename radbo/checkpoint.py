"""Checkpoints of a run: safetensors for tensors, JSON for everything else, atomic writes.

A checkpoint folder holds two kinds of file:

- ``state-NNNNNN.safetensors``: every tensor of the algorithm state after round NNNNNN
  (``"x/<name>"``, ``"y/<name>"``, ``"buffers/<name>"``, ... one prefix per field of the state
  dataclass) and of the engine's cross-round state (``"sim/..."``: the coverage trackers'
  never-trained masks);
- ``checkpoint.json``: the format tag, the config that wrote it, the number of rounds done,
  the virtual clock, the state's scalar fields, the engine's JSON state (coverage history,
  FLOP-meter cache), every round record and ledger row so far, and the name of the tensor file.

Each file is written to a temporary name in the same folder and renamed over the old one, so a
crash leaves either the previous checkpoint or the new one, never a torn file; the JSON is
renamed last and is the commit point (older tensor files are deleted after it). Loading parses
JSON and safetensors only: nothing in a checkpoint is ever executed or unpickled, and the
state is rebuilt by filling a template state of the same run (its dataclass, names, shapes and
dtypes are checked), never by looking up a class named in the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointError",
    "atomic_write",
    "atomic_write_text",
    "load_checkpoint",
    "save_checkpoint",
    "state_from_tensors",
    "state_to_tensors",
]

FORMAT = "radbo-checkpoint/1"
INDEX = "checkpoint.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or does not belong to this run."""


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
            values[f.name] = scalars[f.name]
    if tensor_keys:
        raise CheckpointError(f"checkpoint holds tensors this run does not: {sorted(tensor_keys)}")
    return dataclasses.replace(template, **values)


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
    """

    rounds_done: int
    clock_s: float
    state: Any
    rows: list[dict[str, Any]] = field(default_factory=list)
    ledger: list[dict[str, Any]] = field(default_factory=list)
    sim_tensors: dict[str, Tensor] = field(default_factory=dict)
    sim_meta: dict[str, Any] = field(default_factory=dict)


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

    ``config`` is the run's config as JSON data; :func:`load_checkpoint` compares it.
    """
    directory = Path(directory)
    tensors, scalars = state_to_tensors(state)
    for key, t in sim_tensors.items():
        tensors[f"sim/{key}"] = t.detach().cpu().contiguous().clone()
    tensor_file = f"state-{rounds_done:06d}.safetensors"
    atomic_write(directory / tensor_file, lambda tmp: save_file(tensors, str(tmp)))
    index = {
        "format": FORMAT,
        "config": config,
        "rounds_done": rounds_done,
        "clock_s": clock_s,
        "tensors": tensor_file,
        "state_scalars": scalars,
        "simulation": dict(sim_meta),
        "rows": rows,
        "ledger": ledger,
    }
    atomic_write_text(directory / INDEX, json.dumps(index, allow_nan=True))
    for old in directory.glob("state-*.safetensors"):
        if old.name != tensor_file:
            old.unlink(missing_ok=True)
    return directory / INDEX


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
    """
    directory = Path(directory)
    path = directory / INDEX
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {directory} (no {INDEX})")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable checkpoint index: {err}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} index")
    if config is not None:
        difference = _first_difference(index.get("config"), dict(config), ignore)
        if difference is not None:
            raise CheckpointError(
                f"the checkpoint in {directory} was written by a different config "
                f"({difference}); use another output_dir or run without resume"
            )
    tensor_file = index.get("tensors")
    if not isinstance(tensor_file, str) or "/" in tensor_file or "\\" in tensor_file:
        raise CheckpointError(f"{path} names no valid tensor file: {tensor_file!r}")
    try:
        tensors = load_file(str(directory / tensor_file))
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"cannot read {directory / tensor_file}: {err}") from None
    sim_tensors = {k[4:]: t for k, t in tensors.items() if k.startswith("sim/")}
    state_tensors = {k: t for k, t in tensors.items() if not k.startswith("sim/")}
    state = state_from_tensors(template, state_tensors, index.get("state_scalars", {}))
    return Checkpoint(
        rounds_done=int(index["rounds_done"]),
        clock_s=float(index["clock_s"]),
        state=state,
        rows=list(index.get("rows", [])),
        ledger=list(index.get("ledger", [])),
        sim_tensors=sim_tensors,
        sim_meta=dict(index.get("simulation", {})),
    )


def _first_difference(saved: Any, current: dict[str, Any], ignore: tuple[str, ...]) -> str | None:
    if not isinstance(saved, dict):
        return "no config stored"
    for key in sorted(set(saved) | set(current)):
        if key in ignore:
            continue
        if saved.get(key) != current.get(key):
            return f"{key}: {saved.get(key)!r} then, {current.get(key)!r} now"
    return None
