"""Run radbo's algorithms on Flower (optional extra ``radbo[flower]``).

Its modules need ``flwr``; ``import radbo`` does not. Its names are imported on
first use (PEP 562), so the deployment ClientApp (:mod:`radbo.flower.clientapp`) and the
per-node worker transport (:mod:`radbo.flower.worker`) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radbo.lazy import lazy_attributes

if TYPE_CHECKING:
    from radbo.flower.apps import (
        client_work,
        discover_nodes,
        load_radbo_config,
        make_client_app,
        make_server_app,
        run_on_flower,
    )
    from radbo.flower.backend import FlowerBackend, FlowerTaskError, actions, message_type
    from radbo.flower.codec import (
        TaskSender,
        decode_result,
        decode_task,
        encode_result,
        encode_task,
        payload_bytes,
    )
    from radbo.flower.node import NodeHandler
    from radbo.flower.nodedata import load_node_data, write_node_data

_LAZY: dict[str, str] = {
    "client_work": "radbo.flower.apps",
    "discover_nodes": "radbo.flower.apps",
    "load_radbo_config": "radbo.flower.apps",
    "make_client_app": "radbo.flower.apps",
    "make_server_app": "radbo.flower.apps",
    "run_on_flower": "radbo.flower.apps",
    "FlowerBackend": "radbo.flower.backend",
    "FlowerTaskError": "radbo.flower.backend",
    "actions": "radbo.flower.backend",
    "message_type": "radbo.flower.backend",
    "TaskSender": "radbo.flower.codec",
    "decode_result": "radbo.flower.codec",
    "decode_task": "radbo.flower.codec",
    "encode_result": "radbo.flower.codec",
    "encode_task": "radbo.flower.codec",
    "payload_bytes": "radbo.flower.codec",
    "NodeHandler": "radbo.flower.node",
    "load_node_data": "radbo.flower.nodedata",
    "write_node_data": "radbo.flower.nodedata",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)

__all__ = [
    "client_work",
    "FlowerBackend",
    "FlowerTaskError",
    "NodeHandler",
    "TaskSender",
    "actions",
    "decode_result",
    "decode_task",
    "discover_nodes",
    "encode_result",
    "encode_task",
    "load_node_data",
    "load_radbo_config",
    "make_client_app",
    "make_server_app",
    "message_type",
    "payload_bytes",
    "run_on_flower",
    "write_node_data",
]
