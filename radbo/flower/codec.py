"""Lossless conversion of radbo's client tasks and results to Flower records and back.

A :class:`~radbo.simulation.engine.ClientTask` becomes a :class:`flwr.app.RecordDict` with

* ``"arrays"`` (:class:`~flwr.app.ArrayRecord`): the broadcast tensors (``params/<name>``)
  except those the node already holds (``reuse``); every distinct kept-index list of the
  index set once, as int32 (``index/<k>``; omitted when the node holds this round's index
  set); and, when the server partitions the data, the client's example indices
  (``data/inner``, ``data/outer``);
* ``"config"`` (:class:`~flwr.app.ConfigRecord`): client, round, phase, seed, slot, budget,
  the ordered tensor names, the reused ones, and per index-set tensor and dimension the list
  it keeps (``-1``: whole).

So the arrays of a task weigh exactly what radbo's ledger charges: ``params/*`` the phase's
``bytes_down`` and ``index/*`` the round's index metadata (:func:`radbo.cost.
index_metadata_bytes`); :func:`payload_bytes` measures them. :class:`TaskSender` decides, per
node, what to leave out.

A :class:`~radbo.simulation.engine.ClientResult` becomes ``"arrays"`` (``update/<name>``) and
``"config"`` (client, slot, the six cost counters, metric names and values). Tensors travel
as NumPy ``.npy`` bytes (Flower's :class:`~flwr.app.Array`): dtype, shape and every bit of the
values survive; layout does not (decoded tensors are contiguous).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping
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


INDEX_DTYPE = torch.int32


def encode_task(
    task: ClientTask,
    extra: Mapping[str, Any] | None = None,
    *,
    data: bool = True,
    index: bool = True,
    reuse: Collection[str] = (),
) -> RecordDict:
    """``task`` as a :class:`RecordDict` (``extra`` scalars are added to its config).

    ``data=False`` leaves out the client's example indices (the node has its own data),
    ``index=False`` the index lists (the node holds them from an earlier phase of the round),
    ``reuse`` the named broadcast tensors (the node holds them, equal, from an earlier phase of
    the round); :func:`decode_task` takes them back from the node's copies."""
    arrays: dict[str, Array] = {}
    param_names = list(task.params)
    reused = [n for n in param_names if n in reuse]
    _put_params(arrays, "params", {n: task.params[n] for n in param_names if n not in reuse})
    index_names = list(task.index_set)
    lists: dict[tuple[int, ...], int] = {}  # each distinct kept-index list once
    refs: list[int] = []  # per (name, dim) in order: the list's number, -1 when whole
    dims: list[int] = []
    for name in index_names:
        dims.append(len(task.index_set[name]))
        for idx in task.index_set[name]:
            if idx is None:
                refs.append(-1)
                continue
            key = tuple(idx.tolist())
            k = lists.setdefault(key, len(lists))
            if index and k == len(lists) - 1 and f"index/{k}" not in arrays:
                arrays[f"index/{k}"] = _array(torch.tensor(key, dtype=INDEX_DTYPE))
            refs.append(k)
    if data:
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
        "reused_names": reused,
        "index_names": index_names,
        "index_dims": dims,
        "index_refs": refs,
        "index_lists": len(lists),
        "has_index": bool(index),
        "has_data": bool(data),
    }
    if extra:
        config.update(extra)
    return RecordDict({ARRAYS: ArrayRecord(array_dict=arrays), CONFIG: ConfigRecord(config)})


def _config_ints(config: ConfigRecord, key: str) -> list[int]:
    value = config[key]
    if isinstance(value, list) and all(type(v) is int for v in value):
        return [int(v) for v in value]
    raise TypeError(f"config record entry {key!r} is not a list of integers: {value!r}")


def decode_task(
    content: RecordDict,
    *,
    data: ClientData | None = None,
    index_set: IndexSet | None = None,
    held: Mapping[str, Tensor] | None = None,
) -> ClientTask:
    """The :class:`ClientTask` that :func:`encode_task` encoded; what it left out comes from
    the node: ``data`` (its own examples), ``index_set`` and ``held`` tensors (from an earlier
    phase of the round). Missing either when needed is a :class:`ValueError`."""
    arrays = content.array_records[ARRAYS]
    config = content.config_records[CONFIG]
    names = _config_strings(config, "index_names")
    dims, refs = _config_ints(config, "index_dims"), _config_ints(config, "index_refs")
    if len(dims) != len(names) or sum(dims) != len(refs):
        raise ValueError("the task's index description is inconsistent")
    if bool(config["has_index"]):
        lists = [
            _tensor(arrays[f"index/{k}"]).to(torch.int64)
            for k in range(int(config_number(config, "index_lists")))
        ]
        decoded: IndexSet = {}
        it = iter(refs)
        for name, d in zip(names, dims, strict=True):
            decoded[name] = tuple(None if (k := next(it)) < 0 else lists[k] for _ in range(d))
    elif index_set is None or list(index_set) != names:
        raise ValueError("the task leaves out its index set, and this node holds none for it")
    else:
        decoded = dict(index_set)
    reused = set(_config_strings(config, "reused_names"))
    missing = sorted(reused - set(held or {}))
    if missing:
        raise ValueError(f"the task reuses tensors this node does not hold: {missing}")
    params = {
        n: (held or {})[n] if n in reused else _tensor(arrays[f"params/{n}"])
        for n in _config_strings(config, "param_names")
    }
    if bool(config["has_data"]):
        client_data = ClientData(
            inner=_tensor(arrays["data/inner"]), outer=_tensor(arrays["data/outer"])
        )
    elif data is None:
        raise ValueError("the task carries no data indices and this node has no data of its own")
    else:
        client_data = data
    return ClientTask(
        client=int(config_number(config, "client")),
        round=int(config_number(config, "round")),
        phase=str(config["phase"]),
        params=params,
        index_set=decoded,
        data=client_data,
        seed=int(config_number(config, "seed")),
        budget=ClientBudget(
            capacity=float(config_number(config, "capacity")),
            local_steps=int(config_number(config, "local_steps")),
        ),
        slot=int(config_number(config, "slot")),
    )


def payload_bytes(content: RecordDict) -> dict[str, int]:
    """Bytes of the tensor values in a task or result (numel x element size), by kind:
    ``params``, ``index``, ``data`` (a task), ``update`` (a result) -- what radbo's ledger
    counts; the ``.npy`` headers and the config record are framing, not counted here."""
    out: dict[str, int] = {}
    for record in content.array_records.values():
        for key, array in record.items():
            kind = key.split("/", 1)[0]
            numel = math.prod(int(n) for n in array.shape)
            out[kind] = out.get(kind, 0) + numel * np.dtype(array.dtype).itemsize
    return out


CONFIG_KEY = "radbo.config"
CONFIG_SHA_KEY = "radbo.config-sha256"


def config_sha256(config_json: str) -> str:
    """The name a run config travels by once a node holds it: the SHA-256 of its JSON."""
    return hashlib.sha256(config_json.encode()).hexdigest()


class TaskSender:
    """Encodes a run's tasks for the nodes, leaving out what a node already holds.

    Every task names the run config by its SHA-256; the config itself (``config_json``)
    travels in the first task to each node only. A *stateful* node (one whose client side
    lives across messages: a deployed node with radbo's worker) also keeps what it received
    in the current round, so a later phase of the same round to the same client sends no
    index lists and none of the tensors it sent before unchanged (RABO's outer phase sends y,
    not x again). Stateless nodes (Flower's simulation runtime) get everything every time.
    ``send_data=False``: nodes hold their own examples (``[flower] data = "node"``).
    """

    def __init__(self, config_json: str, *, send_data: bool = True) -> None:
        self.config_json = config_json
        self.config_sha = config_sha256(config_json)
        self.send_data = send_data
        self.stateful: set[int] = set()
        self.configured: set[int] = set()
        # client -> (round, node, the tensors it was sent this round)
        self._sent: dict[int, tuple[int, int, dict[str, Tensor]]] = {}

    def encode(self, task: ClientTask, node: int) -> RecordDict:
        """The message content of ``task`` for node ``node``."""
        extra: dict[str, Any] = {CONFIG_SHA_KEY: self.config_sha}
        if node not in self.stateful or node not in self.configured:
            extra[CONFIG_KEY] = self.config_json
            self.configured.add(node)
        if node not in self.stateful:
            return encode_task(task, extra, data=self.send_data)
        before = self._sent.get(task.client)
        held = before[2] if before is not None and before[:2] == (task.round, node) else None
        reuse = (
            [] if held is None else [n for n in task.params if _same(held.get(n), task.params[n])]
        )
        sent = dict(held or {})
        sent.update(task.params)
        self._sent[task.client] = (task.round, node, sent)
        return encode_task(task, extra, data=self.send_data, index=held is None, reuse=reuse)

    def forget(self, client: int, node: int | None = None) -> None:
        """Send ``client`` everything again (its reply was lost: the node may not hold it);
        with ``node``, send that node the config again too."""
        self._sent.pop(client, None)
        if node is not None:
            self.configured.discard(node)


def _same(a: Tensor | None, b: Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


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
