"""radbo.flower's public API, declared once (read by type checkers, and at run time by
``lazy_loader.attach_stub`` in ``__init__.py``).
"""

from .apps import (
    client_work as client_work,
    discover_nodes as discover_nodes,
    load_radbo_config as load_radbo_config,
    make_client_app as make_client_app,
    make_server_app as make_server_app,
    run_on_flower as run_on_flower,
)
from .backend import (
    FlowerBackend as FlowerBackend,
    FlowerTaskError as FlowerTaskError,
    actions as actions,
    message_type as message_type,
)
from .codec import (
    TaskSender as TaskSender,
    decode_result as decode_result,
    decode_task as decode_task,
    encode_result as encode_result,
    encode_task as encode_task,
    payload_bytes as payload_bytes,
)
from .node import (
    NodeHandler as NodeHandler,
)
from .nodedata import (
    load_node_data as load_node_data,
    write_node_data as write_node_data,
)
