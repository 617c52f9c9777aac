"""The client side of a Flower node: decode a task, run the phase's client work, reply.

One :class:`NodeHandler` serves one node. It keeps the run configs it was sent (by SHA-256)
and the client side built for each: :func:`radbo.experiment.clientside.client_side`'s, over
the whole training set when the server sends data indices (the experiment of the config), or
over the node's own ``data-root`` (:func:`radbo.flower.nodedata.node_side`). A
*stateful* handler -- one that lives across messages, in radbo's per-node worker
(:mod:`radbo.flower.worker`, reached from :mod:`radbo.flower.clientapp`) -- also keeps what
each client received in the current round, so the server need not send it again
(:class:`radbo.flower.codec.TaskSender`).

:func:`handle_request` is the worker's entry point: a request is one JSON header line (node
config, message type) followed by the serialized :class:`flwr.app.RecordDict`; the reply is
the serialized reply content.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from radbo.client import ClientRuntime, Phase, run_measured
from radbo.config import RunConfig
from radbo.cost import FlopMeter
from radbo.experiment import build
from radbo.flower.codec import (
    CONFIG,
    CONFIG_KEY,
    CONFIG_SHA_KEY,
    config_sha256,
    decode_task,
    encode_result,
)
from radbo.flower.nodedata import load_node_data, node_side
from radbo.problem import ClientData
from radbo.typing import IndexSet, Params

PARTITION = "partition-id"
DATA_ROOT = "data-root"
#: Message type of the node-discovery query.
DISCOVERY = "query.radbo_partition"
#: How many built client sides a node keeps (configs of concurrent or successive runs).
_SIDES = 4


@dataclass
class _Side:
    runtime: ClientRuntime
    phases: dict[str, Phase[Any]]
    meter: FlopMeter
    data: ClientData | None  # the node's own examples; None: the server sends indices
    client: int | None


def partition_of(node_config: Mapping[str, Any]) -> int | None:
    """The radbo client a node serves (its ``partition-id`` node config), or ``None``."""
    value = node_config.get(PARTITION)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"node config partition-id = {value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"node config partition-id = {value!r} is not an integer") from None


class NodeHandler:
    """A node's client side (see the module docstring)."""

    def __init__(self, *, stateful: bool) -> None:
        self.stateful = stateful
        self._configs: dict[str, str] = {}
        self._sides: OrderedDict[tuple[str, str | None], _Side] = OrderedDict()
        # client -> (round, index set, tensors held): what it received this round
        self._round: dict[int, tuple[int, IndexSet, Params]] = {}

    # -- run configs and client sides ----------------------------------------------------
    def _config(self, config: ConfigRecord) -> tuple[str, str]:
        text = config.get(CONFIG_KEY)
        digest = None if text is None else config_sha256(str(text))
        sha = str(config.get(CONFIG_SHA_KEY, digest))
        if text is not None:
            if digest != sha:
                raise ValueError("the run config does not match its SHA-256")
            self._configs[sha] = str(text)
        if sha not in self._configs:
            raise ValueError(f"this node does not hold run config {sha[:12]}; send it again")
        return sha, self._configs[sha]

    def _side(self, sha: str, config_json: str, node_config: Mapping[str, Any], own: bool) -> _Side:
        root = str(node_config[DATA_ROOT]) if own and DATA_ROOT in node_config else None
        if own and root is None:
            raise ValueError(
                '[flower] data = "node", but this node has no data-root: start it with '
                "--node-config 'partition-id=<i> data-root=\"<dir>/client-<i>\"'"
            )
        key = (sha, root)
        side = self._sides.get(key)
        if side is not None:
            self._sides.move_to_end(key)
            return side
        cfg = RunConfig.model_validate_json(config_json)
        if root is None:
            server = build(cfg).client_side  # the server sends indices into the training set
            side = _Side(server.runtime, server.phases, FlopMeter(), None, None)
        else:
            built = node_side(cfg, load_node_data(root))
            partition = partition_of(node_config)
            if partition is not None and partition != built.client:
                raise ValueError(
                    f"this node serves radbo client {partition}, but its data-root {root!r} "
                    f"holds client {built.client}'s data"
                )
            side = _Side(built.runtime, built.phases, FlopMeter(), built.data, built.client)
        self._sides[key] = side
        while len(self._sides) > _SIDES:
            self._sides.popitem(last=False)
        return side

    # -- messages ------------------------------------------------------------------------
    def discovery(self, content: RecordDict, node_config: Mapping[str, Any]) -> RecordDict:
        """The node's partition id and statefulness; with a run config in the query, the
        client side is built now (data-root checked), so round 0 does not wait for it."""
        partition = partition_of(node_config)
        config = content.config_records[CONFIG]
        if CONFIG_SHA_KEY in config:
            sha, text = self._config(config)
            own = bool(config.get("node_data", False))
            self._side(sha, text, node_config, own)
        record = ConfigRecord(
            {PARTITION: -1 if partition is None else partition, "stateful": self.stateful}
        )
        return RecordDict({CONFIG: record})

    def task(self, content: RecordDict, node_config: Mapping[str, Any]) -> RecordDict:
        """Run the task in ``content``; the reply content."""
        config = content.config_records[CONFIG]
        sha, text = self._config(config)
        own = not bool(config["has_data"])
        side = self._side(sha, text, node_config, own)
        client = int(config["client"])  # type: ignore[arg-type]
        partition = partition_of(node_config)
        if partition is not None and partition != client:
            raise ValueError(
                f"this node serves radbo client {partition}, but received a task of client {client}"
            )
        held = self._round.get(client) if self.stateful else None
        rnd = int(config["round"])  # type: ignore[arg-type]
        if held is not None and held[0] != rnd:
            held = None
        task = decode_task(
            content,
            data=side.data,
            index_set=None if held is None else held[1],
            held=None if held is None else held[2],
        )
        phase = side.phases.get(task.phase)
        if phase is None:
            raise ValueError(f"the configured algorithm has no phase {task.phase!r}")
        if self.stateful:
            kept = dict(held[2]) if held is not None else {}
            kept.update(task.params)
            self._round[client] = (rnd, task.index_set, kept)
        result = run_measured(phase.client, side.runtime, side.meter, task)
        return encode_result(result)

    def handle(
        self, content: RecordDict, node_config: Mapping[str, Any], message_type: str
    ) -> RecordDict:
        """Reply content for a message of ``message_type``."""
        if message_type == DISCOVERY:
            return self.discovery(content, node_config)
        return self.task(content, node_config)


_WORKER_HANDLER: NodeHandler | None = None


def handle_request(request: bytes) -> bytes:
    """The per-node worker's handler (see the module docstring)."""
    global _WORKER_HANDLER
    if _WORKER_HANDLER is None:
        _WORKER_HANDLER = NodeHandler(stateful=True)
    header, _, body = request.partition(b"\n")
    meta = json.loads(header)
    proto = ProtoRecordDict()
    proto.ParseFromString(body)
    content = recorddict_from_proto(proto)
    reply = _WORKER_HANDLER.handle(content, meta["node_config"], str(meta["message_type"]))
    return bytes(recorddict_to_proto(reply).SerializeToString())
