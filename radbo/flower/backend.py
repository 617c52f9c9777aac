"""A radbo :class:`~radbo.simulation.engine.Backend` that runs client work on Flower nodes.

Message types. Flower routes a message of type ``"train.<action>"`` to the ClientApp handler
registered with ``@app.train("<action>")`` (``"train"`` alone to ``@app.train()``), where
``<action>`` must be a Python identifier. radbo's phase names map as follows
(:func:`message_type`):

* ``"train"`` and ``"train.<action>"`` with an action radbo's ClientApp registers
  (:func:`actions`: every registered algorithm's ``flower_actions`` -- ``inner`` and ``outer``
  for RABO / RAFBO, ``momentum`` and ``local`` for FedMSA) keep their name: RABO sends
  ``train.inner`` then ``train.outer``; SimFBO and ShroFBO send ``train``.
* Every other name (FedMBO's ``inner.<t>``, ``phe.init``, ``phe.<level>``, ``phe.final``)
  is sent as ``"train.radbo"``.

Every message also carries the exact phase name (and the run config), and the ClientApp runs
the phase of that name, so the mapping only routes; it never changes what is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flwr.app import Message

from radbo.algorithms import ALGORITHMS
from radbo.client import ClientResult, ClientRuntime, ClientTask
from radbo.cost import FlopMeter
from radbo.flower.codec import decode_result, encode_task

#: The action of phases whose name is not itself a registered message type.
GENERIC_ACTION = "radbo"


def actions() -> tuple[str, ...]:
    """``train`` actions radbo's ClientApp registers (besides the default ``train``): every
    registered algorithm's ``flower_actions``, and the generic one."""
    found = [a for cls in ALGORITHMS.classes() for a in cls.flower_actions]
    return (*dict.fromkeys(found), GENERIC_ACTION)


def message_type(phase: str) -> str:
    """The Flower message type of a radbo phase (see the module docstring)."""
    if phase == "train":
        return "train"
    category, _, action = phase.partition(".")
    if category == "train" and action in actions() and action != GENERIC_ACTION:
        return phase
    return f"train.{GENERIC_ACTION}"


class FlowerTaskError(RuntimeError):
    """A Flower node did not return a usable result for a task."""


class FlowerBackend:
    """Runs each task on the Flower node serving its client, through ``grid``.

    ``node_ids[c]`` is the Flower node id serving radbo client ``c`` (a sequence indexed by
    client id or a mapping). ``extra`` scalars (e.g. the run config as JSON) are added to
    every message's ``"config"`` record. ``run`` sends one message per task in one
    ``grid.send_and_receive`` call and returns the decoded results in task order. The client
    work is not run here: the node runs the same work (the phase's client work under
    :func:`~radbo.client.run_measured`) itself, FLOPs included.
    """

    def __init__(
        self,
        grid: Any,
        node_ids: Sequence[int] | Mapping[int, int],
        *,
        extra: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.grid = grid
        self.node_ids = dict(enumerate(node_ids)) if isinstance(node_ids, Sequence) else node_ids
        self.extra = dict(extra or {})
        self.timeout = timeout

    def node_for(self, client: int) -> int:
        try:
            return int(self.node_ids[client])
        except (KeyError, IndexError):
            raise FlowerTaskError(
                f"no Flower node serves radbo client {client} (known clients: "
                f"{sorted(self.node_ids)})"
            ) from None

    def run(
        self,
        work: Callable[[ClientRuntime, ClientTask], ClientResult],
        runtime: ClientRuntime,
        meter: FlopMeter | None,
        tasks: Sequence[ClientTask],
    ) -> list[ClientResult]:
        if not tasks:
            return []
        messages = [
            Message(
                content=encode_task(task, self.extra),
                dst_node_id=self.node_for(task.client),
                message_type=message_type(task.phase),
            )
            for task in tasks
        ]
        replies = list(self.grid.send_and_receive(messages, timeout=self.timeout))
        # the grid sets each message's id when it pushes it; replies name the id they answer
        ids = [m.metadata.message_id for m in messages]
        by_id: dict[str, Message] = {}
        for reply in replies:
            by_id[reply.metadata.reply_to_message_id] = reply
        results = []
        for task, mid in zip(tasks, ids, strict=True):
            where = f"client {task.client}, round {task.round}, phase {task.phase!r}"
            reply = by_id.get(mid)
            if reply is None:
                raise FlowerTaskError(f"no reply from Flower node for {where}")
            if reply.has_error():
                err = reply.error
                raise FlowerTaskError(
                    f"Flower node failed on {where}: code {err.code}: {err.reason}"
                )
            result = decode_result(reply.content)
            if result.client != task.client:
                raise FlowerTaskError(f"reply for {where} is from radbo client {result.client}")
            results.append(result)
        return results
