"""Node-local data: each Flower SuperNode trains on its own client's examples, from its disk.

In a real deployment a device's data lives on the device, so the server must not send data
(``[flower] data = "node"``). ``radbo flower partition CONFIG --out DIR``
(:func:`write_node_data`) cuts the run's training set exactly as ``radbo run`` partitions it
and writes one folder per client, ``DIR/client-<i>/``:

* ``data.safetensors`` -- the client's examples (``features``, ``labels``) and the positions of
  its inner and outer examples among them (``inner``, ``outer``; int64);
* ``node.json`` -- format, client id, fleet size, the fingerprint of every config field that
  decides the partition (:func:`data_fingerprint`), the model's input shape and outputs, the
  training set's class count and label counts (tasks such as ``vs_loss`` weigh classes by
  the whole training set), the fleet's mean local steps (wired into some algorithms), and the
  SHA-256 of ``data.safetensors``.

A SuperNode started with ``--node-config 'partition-id=<i> data-root="DIR/client-<i>"'``
loads it (:func:`load_node_data`: JSON and safetensors only, the hash checked) and builds
its client side (:func:`node_side`: :func:`radbo.experiment.clientside.client_side`, the
build the server's simulation makes) without the training set: model, submodel skeletons,
algorithm, task and sampler, over its own examples. The examples keep the order the server's
partition gives them and the inner and outer index lists keep theirs, so every minibatch a
task's generator draws holds the same examples as in the in-process run: a node-local run
equals ``radbo run`` bit for bit (one intra-op thread).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from radbo.atomic import atomic_write, atomic_write_text
from radbo.client import ClientRuntime, Phase
from radbo.config import RunConfig
from radbo.data import Dataset, DatasetSummary
from radbo.experiment import Experiment, build
from radbo.experiment.clientside import RUN_DTYPES, ClientSide, client_model, client_side
from radbo.problem import ClientData

FORMAT = "radbo-node-data/1"
DATA_FILE = "data.safetensors"
META_FILE = "node.json"
#: Config fields that decide which examples each client holds, and in which order.
_PARTITION_FIELDS = ("seed", "data", "partition", "task", "fleet", "runtime")


class NodeDataError(ValueError):
    """A node's ``data-root`` is missing, damaged or written for another run."""


def data_fingerprint(config: RunConfig) -> str:
    """SHA-256 of the config fields that decide every client's examples (seed, data,
    partition, task, fleet, dtype): a node's data written for a config with another
    fingerprint would train on the wrong examples."""
    dump = config.model_dump(mode="json")
    parts = {k: dump.get(k) for k in _PARTITION_FIELDS}
    parts["runtime"] = {"dtype": config.runtime.dtype}
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class _Meta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str
    client: int = Field(ge=0)
    num_clients: int = Field(ge=1)
    fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$")
    input_shape: tuple[int, ...]
    num_classes: int = Field(ge=1)
    num_outputs: int = Field(ge=1)
    label_counts: list[int]
    population_steps: float | None
    data_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class NodeData:
    """One client's examples and what a node needs to build its client side."""

    client: int
    num_clients: int
    fingerprint: str
    features: Tensor
    labels: Tensor
    data: ClientData  # positions in ``features``
    input_shape: tuple[int, ...]
    num_classes: int
    num_outputs: int
    label_counts: list[int]
    population_steps: float | None


def _local(inner: Tensor, outer: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows, inner_pos, outer_pos)``: the distinct examples of ``inner`` then ``outer`` in
    first-seen order, and each list's positions among them (orders kept)."""
    both = torch.cat([inner, outer])
    rows: list[int] = []
    where: dict[int, int] = {}
    positions = []
    for i in both.tolist():
        if i not in where:
            where[i] = len(rows)
            rows.append(i)
        positions.append(where[i])
    pos = torch.tensor(positions, dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64), pos[: inner.numel()], pos[inner.numel() :]


def write_node_data(
    config: RunConfig, out_dir: str | Path, experiment: Experiment | None = None
) -> list[Path]:
    """Write ``out_dir/client-<i>/`` for every client of ``config`` (see the module
    docstring); returns the folders. ``experiment`` is ``build(config)`` when given."""
    exp = build(config) if experiment is None else experiment
    out = Path(out_dir)
    train = exp.train
    counts = torch.bincount(train.labels.cpu(), minlength=train.num_classes).tolist()
    fingerprint = data_fingerprint(config)
    folders = []
    for c, data in enumerate(exp.clients):
        rows, inner, outer = _local(data.inner.cpu(), data.outer.cpu())
        tensors = {
            "features": train.features[rows].cpu().contiguous(),
            "labels": train.labels[rows].cpu().contiguous(),
            "inner": inner,
            "outer": outer,
        }
        raw = safetensors_bytes(tensors)
        meta = _Meta(
            format=FORMAT,
            client=c,
            num_clients=len(exp.clients),
            fingerprint=fingerprint,
            input_shape=tuple(train.input_shape),
            num_classes=train.num_classes,
            num_outputs=config.task.num_outputs(train),
            label_counts=counts,
            population_steps=exp.population_steps,
            data_sha256=hashlib.sha256(raw).hexdigest(),
        )
        folder = out / f"client-{c}"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / DATA_FILE, functools.partial(_write_bytes, data=raw))
        atomic_write_text(folder / META_FILE, meta.model_dump_json(indent=1) + "\n")
        folders.append(folder)
    return folders


def _write_bytes(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def load_node_data(root: str | Path) -> NodeData:
    """The :class:`NodeData` in ``root`` (written by :func:`write_node_data`); a missing,
    damaged or inconsistent folder is a one-line :class:`NodeDataError`."""
    folder = Path(root)
    try:
        meta = _Meta.model_validate_json((folder / META_FILE).read_bytes())
        raw = (folder / DATA_FILE).read_bytes()
    except OSError as err:
        raise NodeDataError(
            f"data-root {str(folder)!r}: {err.strerror or err}: write it with "
            "`radbo flower partition CONFIG --out DIR` and pass DIR/client-<i>"
        ) from None
    except ValidationError as err:
        raise NodeDataError(
            f"data-root {str(folder)!r}: {META_FILE} is not radbo node data "
            f"({err.errors()[0]['msg']})"
        ) from None
    if meta.format != FORMAT:
        raise NodeDataError(f"data-root {str(folder)!r}: format {meta.format!r}, need {FORMAT!r}")
    if hashlib.sha256(raw).hexdigest() != meta.data_sha256:
        raise NodeDataError(
            f"data-root {str(folder)!r}: {DATA_FILE} does not match the SHA-256 in {META_FILE} "
            "(damaged or replaced); write it again"
        )
    try:
        tensors = safetensors_load(raw)
    except SafetensorError as err:
        raise NodeDataError(f"data-root {str(folder)!r}: {DATA_FILE}: {err}") from None
    return _checked(folder, meta, tensors)


def _checked(folder: Path, meta: _Meta, tensors: Mapping[str, Tensor]) -> NodeData:
    where = f"data-root {str(folder)!r}: {DATA_FILE}"
    if set(tensors) != {"features", "labels", "inner", "outer"}:
        raise NodeDataError(f"{where} holds {sorted(tensors)}, need features/labels/inner/outer")
    features, labels = tensors["features"], tensors["labels"]
    inner, outer = tensors["inner"], tensors["outer"]
    n = features.shape[0] if features.ndim else -1
    ok = (
        features.dtype in (torch.float32, torch.float64)
        and tuple(features.shape[1:]) == meta.input_shape
        and labels.dtype == torch.int64
        and tuple(labels.shape) == (n,)
        and all(t.dtype == torch.int64 and t.ndim == 1 and t.numel() > 0 for t in (inner, outer))
    )
    if not ok:
        raise NodeDataError(f"{where}: tensors of the wrong dtype or shape")
    if not bool(torch.isfinite(features).all()):
        raise NodeDataError(f"{where}: features hold NaN or Inf")
    if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < meta.num_classes):
        raise NodeDataError(f"{where}: labels outside [0, {meta.num_classes})")
    for t in (inner, outer):
        if int(t.min()) < 0 or int(t.max()) >= n:
            raise NodeDataError(f"{where}: inner/outer positions outside [0, {n})")
    if meta.client >= meta.num_clients or len(meta.label_counts) != meta.num_classes:
        raise NodeDataError(f"data-root {str(folder)!r}: {META_FILE} is inconsistent")
    return NodeData(
        client=meta.client,
        num_clients=meta.num_clients,
        fingerprint=meta.fingerprint,
        features=features,
        labels=labels,
        data=ClientData(inner=inner, outer=outer),
        input_shape=meta.input_shape,
        num_classes=meta.num_classes,
        num_outputs=meta.num_outputs,
        label_counts=list(meta.label_counts),
        population_steps=meta.population_steps,
    )


@dataclass
class NodeSide:
    """What a node runs client work with: the client side of the run over its own examples
    (:class:`~radbo.experiment.clientside.ClientSide`), its own
    :class:`~radbo.problem.ClientData` and which client it is."""

    side: ClientSide
    data: ClientData
    client: int

    @property
    def runtime(self) -> ClientRuntime:
        """The runtime over the node's own examples."""
        return self.side.runtime

    @property
    def phases(self) -> dict[str, Phase[Any]]:
        """The algorithm's phases by name."""
        return self.side.phases


def node_side(config: RunConfig, node: NodeData) -> NodeSide:
    """Build a node's client side of ``config`` from its own data, without the training set.

    The client side is :func:`radbo.experiment.clientside.client_side`'s, as the server
    builds it: the model from the run seed (its weights never matter: every task carries the
    tensors the client computes with), submodel skeletons, the algorithm wired with the
    fleet's mean local steps the node data records, and the task built for the whole training
    set's label counts (tasks such as ``vs_loss`` weigh classes by them), over the node's own
    examples.
    """
    _check_node(config, node)
    examples = Dataset(
        node.features.to(RUN_DTYPES[config.runtime.dtype]),
        node.labels,
        node.num_classes,
        f"{config.data.name}/client-{node.client}",
    )
    training = DatasetSummary.from_label_counts(
        node.label_counts, node.input_shape, config.data.name
    )
    model = client_model(config, node.input_shape, node.num_outputs, structure=config.mask.masked)
    sampler = config.task.sampler(examples, [node.data])
    side = client_side(config, model, examples, training, sampler, node.population_steps)
    return NodeSide(side=side, data=node.data, client=node.client)


def _check_node(config: RunConfig, node: NodeData) -> None:
    """Refuse node data written for another config or fleet size."""
    if node.fingerprint != data_fingerprint(config):
        raise NodeDataError(
            f"this node's data (client {node.client}) was written for another config (its "
            "seed, data, partition, task or fleet differ): write it again with `radbo flower "
            "partition` for the config the server runs"
        )
    if node.num_clients != config.fleet.num_clients:
        raise NodeDataError(
            f"this node's data is for a fleet of {node.num_clients} clients, the run has "
            f"{config.fleet.num_clients}"
        )
