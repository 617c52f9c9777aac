"""Checks on a Flower node's reply, made before anything of it is decoded into radbo's state.

A node may be faulty or malicious: :func:`check_reply` reads the reply's records as
:func:`~radbo.flower.codec.encode_result` writes them and returns why the reply must not be
used (one line), or ``None``. The backend turns a reason into a rejected
:class:`~radbo.client.ClientResult` (left out of aggregation, counted in
``RoundRecord.rejected``, listed in ``RoundRecord.failures``); it never aborts the run.

What is checked:

* the record names (one ``"arrays"`` ArrayRecord, one ``"config"`` ConfigRecord, nothing
  else) and the exact config keys;
* the client id and slot are those of the task;
* the six cost counters are integers >= 0, the metrics finite numbers (not bool or text);
* the update's key set: exactly the client work's declared ``update_keys(task)`` when it
  declares one (:class:`~radbo.client.ClientWork`), otherwise every key must name (directly
  or as a ``"prefix:name"`` alias) a model tensor and a tensor the task sent, so that an
  unknown key is rejected -- but a missing one is only caught where the key set is declared;
* every array: a NumPy array (Flower's ``numpy.ndarray`` serialization, loaded without
  pickle) with exactly the dtype of the tensor the task sent under that name (an int64 or
  float64 update for a float32 model is rejected, never cast), the submodel shape the task's
  index set selects, and finite values;
* with ``max_update_ratio`` set: the update's L2 norm at most that multiple of the L2 norm of
  the task's tensors (floating ones, summed in float64). Without the bound a finite update is
  accepted however large (e.g. 3e38 in float32).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any, TypeGuard

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from radbo.client import ClientTask, CostRecord
from radbo.cost import tensor_bytes
from radbo.flower.codec import ARRAYS, CONFIG

__all__ = ["check_reply", "reported_cost"]

_COSTS = tuple(f"cost/{f.name}" for f in fields(CostRecord))
_FIXED_KEYS = frozenset({"client", "slot", "update_names", "metric_names", *_COSTS})
_UPDATE = "update/"
_METRIC = "metric/"


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _names(config: ConfigRecord, key: str) -> list[str] | str:
    """The list of distinct strings under ``key``, or why it is not one."""
    value = config[key]
    if not isinstance(value, list):
        return f"config entry {key!r} is not a list of strings"
    strings = [v for v in value if isinstance(v, str)]
    if len(strings) != len(value):
        return f"config entry {key!r} is not a list of strings"
    if len(set(strings)) != len(strings):
        return f"config entry {key!r} repeats a name"
    return strings


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _load(array: Any) -> np.ndarray | str:
    """The NumPy array a reply's :class:`~flwr.app.Array` holds, or why it cannot be read."""
    if not isinstance(array, Array):
        return f"is a {type(array).__name__}, not an Array"
    try:
        value = array.numpy()  # np.load(allow_pickle=False): no code runs
    except Exception as err:  # noqa: BLE001 -- any failure to read is a bad reply
        return f"cannot be read as a NumPy array ({type(err).__name__}: {err})"
    if not isinstance(value, np.ndarray):
        return "is not a NumPy array"
    return value


def _expected_dtype(
    key: str, name: str, task: ClientTask, dtypes: Mapping[str, torch.dtype] | None
) -> torch.dtype | None:
    for source in (task.params.get(key), task.params.get(name)):
        if source is not None:
            return source.dtype
    return None if dtypes is None else dtypes.get(name)


def _norm(values: Collection[np.ndarray | torch.Tensor]) -> float:
    """The L2 norm over the floating arrays in ``values``, summed in float64."""
    total = 0.0
    for v in values:
        t = torch.as_tensor(v)
        if t.is_floating_point():
            total += float(torch.sum(t.to(torch.float64) ** 2))
    return math.sqrt(total)


def check_reply(
    content: RecordDict,
    task: ClientTask,
    shapes: Mapping[str, torch.Size],
    *,
    max_update_ratio: float | None = None,
    update_keys: Collection[str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> str | None:
    """Why ``content`` is not a sound reply to ``task``, or ``None`` (see the module docstring).

    ``shapes`` are the full model's tensor shapes; ``update_keys`` the exact update key set
    when the client work declares one; ``dtypes`` the model tensors' dtypes, for update keys
    whose tensor the task did not send.
    """
    records = _records(content)
    if isinstance(records, str):
        return records
    arrays, config = records
    reason = _check_config(config, task)
    if reason is not None:
        return reason
    update_names = _update_names(arrays, config, update_keys)
    if isinstance(update_names, str):
        return update_names
    values: list[np.ndarray] = []
    for key in update_names:
        value = _update_array(key, arrays, task, shapes, update_keys=update_keys, dtypes=dtypes)
        if isinstance(value, str):
            return value
        values.append(value)
    if max_update_ratio is not None:
        return _check_norm(values, task, max_update_ratio)
    return None


def _records(content: RecordDict) -> tuple[ArrayRecord, ConfigRecord] | str:
    """The reply's two records (one ``"arrays"`` ArrayRecord, one ``"config"`` ConfigRecord,
    nothing else), or why it does not hold exactly those."""
    if not isinstance(content, RecordDict):
        return f"reply content is a {type(content).__name__}, not a RecordDict"
    names = set(content.keys())
    if names != {ARRAYS, CONFIG}:
        return f"reply records are {sorted(names)}, expected {sorted([ARRAYS, CONFIG])}"
    arrays, config = content[ARRAYS], content[CONFIG]
    if not isinstance(arrays, ArrayRecord) or not isinstance(config, ConfigRecord):
        return f"reply record {ARRAYS!r} must be an ArrayRecord and {CONFIG!r} a ConfigRecord"
    return arrays, config


def _check_config(config: ConfigRecord, task: ClientTask) -> str | None:
    """Why the reply's config is unsound, or ``None``: its exact keys, the client and slot of
    ``task``, costs integers >= 0 and metrics finite numbers."""
    missing = sorted(_FIXED_KEYS - set(config.keys()))
    if missing:
        return f"config lacks {missing}"
    metric_names = _names(config, "metric_names")
    if isinstance(metric_names, str):
        return metric_names
    expected_keys = _FIXED_KEYS | {_METRIC + k for k in metric_names}
    if set(config.keys()) != expected_keys:
        odd = sorted(set(config.keys()) ^ expected_keys)
        return f"config keys differ from the expected ones: {odd}"
    client, slot = config["client"], config["slot"]
    if not _is_int(client) or client != task.client:
        return f"reply names client {client!r}, but the task was sent to client {task.client}"
    if not _is_int(slot) or slot != task.slot:
        return f"reply names slot {slot!r}, but the task was sent as slot {task.slot}"
    for key in _COSTS:
        count = config[key]
        if not _is_int(count) or count < 0:
            return f"cost {key[5:]!r} = {count!r} is not an integer >= 0"
    for k in metric_names:
        metric = config[_METRIC + k]
        if not _is_number(metric) or not math.isfinite(metric):
            return f"metric {k!r} = {metric!r} is not a finite number"
    return None


def _update_names(
    arrays: ArrayRecord, config: ConfigRecord, update_keys: Collection[str] | None
) -> list[str] | str:
    """The update's key names: those the config lists, which must be the arrays' names and,
    when the client work declares them, exactly ``update_keys``; or why they are not."""
    update_names = _names(config, "update_names")
    if isinstance(update_names, str):
        return update_names
    stored = set(arrays.keys())
    wanted = {_UPDATE + n for n in update_names}
    if stored != wanted:
        return f"arrays {sorted(stored ^ wanted)} differ from the listed update names"
    if update_keys is not None and set(update_names) != set(update_keys):
        extra = sorted(set(update_names) - set(update_keys))
        lacking = sorted(set(update_keys) - set(update_names))
        return f"update keys differ from the phase's: extra {extra}, missing {lacking}"
    return update_names


def _update_array(
    key: str,
    arrays: ArrayRecord,
    task: ClientTask,
    shapes: Mapping[str, torch.Size],
    *,
    update_keys: Collection[str] | None,
    dtypes: Mapping[str, torch.dtype] | None,
) -> np.ndarray | str:
    """The update array under ``key``, or why it is unsound: not a model tensor (or, without
    declared ``update_keys``, one the task did not send), unreadable, of another dtype than
    the tensor sent, not the submodel shape the task's index set selects, or not finite."""
    name = key.rsplit(":", 1)[-1]
    if name not in shapes:
        return f"update {key!r} is not a model tensor"
    if update_keys is None and key not in task.params and name not in task.params:
        return f"update {key!r} names a tensor the task did not send"
    value = _load(arrays[_UPDATE + key])
    if isinstance(value, str):
        return f"update {key!r} {value}"
    dtype = _expected_dtype(key, name, task, dtypes)
    if dtype is None:
        return f"update {key!r} has no known dtype"
    if value.dtype != _numpy_dtype(dtype):
        return f"update {key!r} is {value.dtype}, expected {_numpy_dtype(dtype)}"
    index = task.index_set.get(name, (None,) * len(shapes[name]))
    expected = tuple(
        n if i is None else int(i.numel()) for i, n in zip(index, shapes[name], strict=True)
    )
    if tuple(value.shape) != expected:
        return f"update {key!r} has shape {tuple(value.shape)}, expected {expected}"
    if np.issubdtype(value.dtype, np.floating) and not bool(np.isfinite(value).all()):
        return f"update {key!r} holds NaN or Inf"
    return value


def _check_norm(values: list[np.ndarray], task: ClientTask, max_update_ratio: float) -> str | None:
    """Why the update's L2 norm exceeds ``max_update_ratio`` times the task's tensors' norm
    (``[flower] max_update_ratio``), or ``None``."""
    norm, bound = _norm(values), max_update_ratio * _norm(list(task.params.values()))
    if not norm <= bound:
        return (
            f"update L2 norm {norm:.4g} exceeds {max_update_ratio:g} x the task's "
            f"tensors' norm ({bound:.4g}; [flower] max_update_ratio)"
        )
    return None


def reported_cost(content: RecordDict, task: ClientTask) -> CostRecord:
    """The cost a reply reports, made safe to charge: a counter that is missing, not an
    integer or negative becomes the task's bytes sent down (``bytes_down``) or 0 (any other
    counter)."""
    config = content.get(CONFIG) if isinstance(content, RecordDict) else None
    out: dict[str, int] = {}
    for f in fields(CostRecord):
        value = config.get(f"cost/{f.name}") if isinstance(config, ConfigRecord) else None
        if _is_int(value) and value >= 0:
            out[f.name] = int(value)
        else:
            out[f.name] = tensor_bytes(task.params) if f.name == "bytes_down" else 0
    return CostRecord(**out)
