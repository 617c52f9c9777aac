"""radbo's ClientApp for deployments (``flwr run`` with SuperNodes): a thin forwarder.

Flower 1.41 starts one ``flwr-clientapp`` process per message (pull one message, run the
ClientApp, push the reply, exit), so a ClientApp that imported radbo and built its experiment
would pay both -- seconds of CPU -- for every message. This module imports only Flower and the
standard library: it serializes the message content and hands it over a Unix-domain socket
to a long-lived per-node worker (:mod:`radbo.flower.worker`) that imported radbo once and
keeps the node's client side and this round's tensors (:class:`radbo.flower.node.NodeHandler`,
stateful). The worker is started on the node's first message and belongs to its node (the
ClientApp process's parent: the SuperNode's SuperExec, which ends with the SuperNode) and
run; it exits when the SuperNode does or after ``RADBO_WORKER_IDLE_S`` seconds (default 600)
without a message.

Point a Flower app at it: ``clientapp = "radbo.flower.clientapp:client_app"``. Flower's
simulation runtime (Ray) uses :func:`radbo.flower.apps.make_client_app` instead, which runs
the work in the ClientApp itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from radbo.flower import worker

#: The worker's handler (imported in the worker, never here).
HANDLER = "radbo.flower.node:handle_request"
#: Message types the forwarder answers (the node handler tells them apart).
GENERIC_ACTION = "radbo"


def forward(message: Message, context: Context) -> Message:
    """Hand ``message`` to this node's worker and return its reply."""
    header = json.dumps(
        {
            "node_config": dict(context.node_config),
            "message_type": message.metadata.message_type,
        }
    ).encode()
    request = header + b"\n" + recorddict_to_proto(message.content).SerializeToString()
    # flwr-clientapp runs as a child of its SuperNode's SuperExec (flwr 1.41), which exits
    # with the SuperNode: the worker's parent, one per node
    supernode = os.getppid()
    reply = worker.call(
        f"node-{supernode}-run-{context.run_id}",
        request,
        handler=HANDLER,
        parent_pid=supernode,
        idle_s=float(os.environ.get("RADBO_WORKER_IDLE_S", "600")),
    )
    proto = ProtoRecordDict()
    proto.ParseFromString(reply)
    return Message(content=recorddict_from_proto(proto), reply_to=message)


def make_app(handler: Callable[[Message, Context], Message], actions: Sequence[str]) -> ClientApp:
    """A ClientApp answering ``train``, ``train.<action>`` for ``actions`` and radbo's
    node-discovery query (``query.radbo_partition``) with ``handler``."""
    app = ClientApp()
    app.train()(handler)
    for action in actions:
        app.train(action)(handler)
    app.query("radbo_partition")(handler)
    return app


# the routed actions of every registered algorithm, listed here without importing radbo's
# algorithms (and torch); tests/flower/test_flower.py checks it equals
# radbo.flower.backend.actions()
ACTIONS = ("inner", "outer", "momentum", "local", GENERIC_ACTION)

#: The ClientApp of a deployment.
client_app = make_app(forward, ACTIONS)
