"""Run radbo's algorithms on Flower (optional extra ``radbo[flower]``).

Importing this package needs ``flwr``; ``import radbo`` does not.
"""

from radbo.flower.apps import (
    client_work,
    discover_nodes,
    load_radbo_config,
    make_client_app,
    make_server_app,
    run_on_flower,
)
from radbo.flower.backend import FlowerBackend, FlowerTaskError, actions, message_type
from radbo.flower.codec import decode_result, decode_task, encode_result, encode_task

__all__ = [
    "FlowerBackend",
    "FlowerTaskError",
    "actions",
    "client_work",
    "decode_result",
    "decode_task",
    "discover_nodes",
    "encode_result",
    "encode_task",
    "load_radbo_config",
    "make_client_app",
    "make_server_app",
    "message_type",
    "run_on_flower",
]
