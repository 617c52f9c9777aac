"""Lossless conversion of radbo's client tasks and results to Flower records and back.

A :class:`~radbo.simulation.engine.ClientTask` becomes a :class:`flwr.app.RecordDict` with

* ``"arrays"`` (:class:`~flwr.app.ArrayRecord`): the broadcast tensors (``params/<name>``),
  the kept indices of every index-set dimension that is not whole (``index/<name>/<dim>``)
  and the client's data indices (``data/inner``, ``data/outer``);
* ``"config"`` (:class:`~flwr.app.ConfigRecord`): client, round, phase, seed, slot, budget,
  the ordered tensor names and, per index-set tensor, which dimensions are whole.

A :class:`~radbo.simulation.engine.ClientResult` becomes ``"arrays"`` (``update/<name>``) and
``"config"`` (client, slot, the six cost counters, metric names and values). Tensors travel
as NumPy ``.npy`` bytes (Flower's :class:`~flwr.app.Array`): dtype, shape and every bit of the
values survive; layout does not (decoded tensors are contiguous).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from torch import Tensor

from radbo.client import ClientBudget, ClientResult, ClientTask, CostRecord
from radbo.problem import ClientData
from radbo.typing import IndexSet, Params

ARRAYS = "arrays"
CONFIG = "config"
_COST_FIELDS = tuple(f.name for f in fields(CostRecord))


def _array(tensor: Tensor) -> Array:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"expected a tensor, got {type(tensor).__name__}")
    return Array(tensor.detach().cpu().contiguous().numpy())


def _tensor(array: Array) -> Tensor:
    # np.load may return a read-only array; copy so torch owns writable memory
    return torch.from_numpy(np.array(array.numpy(), copy=True))


def _put_params(arrays: dict[str, Array], prefix: str, params: Mapping[str, Tensor]) -> list[str]:
    names = list(params)
    for name in names:
        arrays[f"{prefix}/{name}"] = _array(params[name])
    return names


def _get_params(record: ArrayRecord, prefix: str, names: list[str]) -> Params:
    return {name: _tensor(record[f"{prefix}/{name}"]) for name in names}


def config_number(config: ConfigRecord, key: str) -> int | float:
    """The number :func:`encode_task` / :func:`encode_result` stored under ``key``."""
    value = config[key]
    if not isinstance(value, int | float):
        raise TypeError(f"config record entry {key!r} is not a number: {value!r}")
    return value


def _config_strings(config: ConfigRecord, key: str) -> list[str]:
    """The list of strings stored under ``key``."""
    value = config[key]
    if isinstance(value, list):
        strings = [v for v in value if isinstance(v, str)]
        if len(strings) == len(value):
            return strings
    raise TypeError(f"config record entry {key!r} is not a list of strings: {value!r}")


def encode_task(task: ClientTask, extra: Mapping[str, Any] | None = None) -> RecordDict:
    """``task`` as a :class:`RecordDict` (``extra`` scalars are added to its config)."""
    arrays: dict[str, Array] = {}
    param_names = _put_params(arrays, "params", task.params)
    index_names = list(task.index_set)
    whole: list[str] = []  # "<name>:<0/1 per dim>" -- 1 where the dimension is kept whole
    for name in index_names:
        flags = []
        for d, idx in enumerate(task.index_set[name]):
            if idx is None:
                flags.append("1")
            else:
                flags.append("0")
                arrays[f"index/{name}/{d}"] = _array(idx)
        whole.append("".join(flags))
    arrays["data/inner"] = _array(task.data.inner)
    arrays["data/outer"] = _array(task.data.outer)
    config: dict[str, Any] = {
        "client": int(task.client),
        "round": int(task.round),
        "phase": task.phase,
        "seed": int(task.seed),
        "slot": int(task.slot),
        "capacity": float(task.budget.capacity),
        "local_steps": int(task.budget.local_steps),
        "param_names": param_names,
        "index_names": index_names,
        "index_whole": whole,
    }
    if extra:
        config.update(extra)
    return RecordDict({ARRAYS: ArrayRecord(array_dict=arrays), CONFIG: ConfigRecord(config)})


def decode_task(content: RecordDict) -> ClientTask:
    """The :class:`ClientTask` that :func:`encode_task` encoded."""
    arrays = content.array_records[ARRAYS]
    config = content.config_records[CONFIG]
    index_set: IndexSet = {}
    names, whole = _config_strings(config, "index_names"), _config_strings(config, "index_whole")
    for name, flags in zip(names, whole, strict=True):
        index_set[name] = tuple(
            None if flag == "1" else _tensor(arrays[f"index/{name}/{d}"])
            for d, flag in enumerate(flags)
        )
    return ClientTask(
        client=int(config_number(config, "client")),
        round=int(config_number(config, "round")),
        phase=str(config["phase"]),
        params=_get_params(arrays, "params", _config_strings(config, "param_names")),
        index_set=index_set,
        data=ClientData(inner=_tensor(arrays["data/inner"]), outer=_tensor(arrays["data/outer"])),
        seed=int(config_number(config, "seed")),
        budget=ClientBudget(
            capacity=float(config_number(config, "capacity")),
            local_steps=int(config_number(config, "local_steps")),
        ),
        slot=int(config_number(config, "slot")),
    )


def encode_result(result: ClientResult) -> RecordDict:
    """``result`` as a :class:`RecordDict`."""
    arrays: dict[str, Array] = {}
    update_names = _put_params(arrays, "update", result.update)
    metric_names = list(result.metrics)
    config: dict[str, Any] = {
        "client": int(result.client),
        "slot": int(result.slot),
        **{f"cost/{k}": int(getattr(result.cost, k)) for k in _COST_FIELDS},
        "update_names": update_names,
        "metric_names": metric_names,
    }
    for k in metric_names:
        value = result.metrics[k]
        config[f"metric/{k}"] = value if isinstance(value, int | float) else float(value)
    return RecordDict({ARRAYS: ArrayRecord(array_dict=arrays), CONFIG: ConfigRecord(config)})


def decode_result(content: RecordDict) -> ClientResult:
    """The :class:`ClientResult` that :func:`encode_result` encoded."""
    arrays = content.array_records[ARRAYS]
    config = content.config_records[CONFIG]
    return ClientResult(
        client=int(config_number(config, "client")),
        update=_get_params(arrays, "update", _config_strings(config, "update_names")),
        cost=CostRecord(**{k: int(config_number(config, f"cost/{k}")) for k in _COST_FIELDS}),
        metrics={
            k: config_number(config, f"metric/{k}") for k in _config_strings(config, "metric_names")
        },
        slot=int(config_number(config, "slot")),
    )
