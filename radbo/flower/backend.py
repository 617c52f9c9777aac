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

Failures. One client's failure never ends the run: a task whose node is unknown, gives no
reply within ``timeout`` seconds, or answers with an error (node unavailable, ClientApp
exception) becomes a *lost* :class:`~radbo.client.ClientResult` -- a dropped client for that
phase, charged the bytes sent down -- and a reply failing :func:`radbo.flower.checks.
check_reply` a *rejected* one (left out of aggregation, counted, its cost charged as
:func:`~radbo.flower.checks.reported_cost` makes it safe). ``RoundRecord.failures`` says why.
With ``rediscover``, a client without a node or whose node failed is looked for again before
each phase it takes part in, so a restarted node rejoins.

Waiting. A phase's messages are pushed at once (``grid.push_messages``) and its replies pulled
(``grid.pull_messages``) every ``poll_interval`` seconds until all are in or ``timeout`` has
passed (:func:`exchange`); Flower's own ``send_and_receive`` pulls a deployment's replies only
every 3 s, which made every phase wait for the next 3-s tick. A grid without push and pull is
asked through its ``send_and_receive``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from flwr.app import Message

from radbo.algorithms import ALGORITHMS
from radbo.client import ClientResult, ClientRuntime, ClientTask, CostRecord
from radbo.config import FlowerConfig
from radbo.cost import FlopMeter, tensor_bytes
from radbo.flower.checks import check_reply, reported_cost
from radbo.flower.codec import decode_result, encode_task

#: The action of phases whose name is not itself a registered message type.
GENERIC_ACTION = "radbo"

#: Seconds between reply pulls when none is given: ``[flower] poll_interval_s``'s default.
POLL_INTERVAL_S: float = FlowerConfig.model_fields["poll_interval_s"].default


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


def exchange(
    grid: Any,
    messages: Sequence[Message],
    *,
    timeout: float | None,
    poll_interval: float = POLL_INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Message]:
    """Send ``messages`` through ``grid`` and return the replies that arrive in time.

    With a grid that has ``push_messages`` and ``pull_messages`` (Flower's deployment and
    in-memory grids), the messages are pushed at once and the replies pulled right away, then
    every ``poll_interval`` seconds (the last wait cut to end at the deadline), until every
    pushed message has its reply or ``timeout`` seconds have passed since the push (``None``:
    wait for all); a message the grid could not push (its id ``None``) gets no reply. Another
    grid is asked through ``grid.send_and_receive(messages, timeout=timeout)``. ``clock`` and
    ``sleep`` measure and spend the time between pulls (a test injects fake ones). Each
    reply names the message it answers in ``metadata.reply_to_message_id``.
    """
    if not messages:
        return []
    push: Callable[[Iterable[Message]], Iterable[str | None]] | None = getattr(
        grid, "push_messages", None
    )
    pull: Callable[[Iterable[str]], Iterable[Message]] | None = getattr(grid, "pull_messages", None)
    if push is None or pull is None:
        return list(grid.send_and_receive(list(messages), timeout=timeout))
    if not poll_interval > 0:
        raise ValueError(f"exchange: poll_interval = {poll_interval!r}; give seconds > 0")
    pending = [i for i in push(list(messages)) if i]
    deadline = None if timeout is None else clock() + timeout
    replies: list[Message] = []
    while pending:
        got = list(pull(list(pending)))
        replies.extend(got)
        answered = {reply.metadata.reply_to_message_id for reply in got}
        pending = [i for i in pending if i not in answered]
        if not pending:
            break
        wait = poll_interval
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                break
            wait = min(wait, left)
        sleep(wait)
    return replies


class FlowerTaskError(RuntimeError):
    """Flower cannot run the tasks at all (an infrastructure failure, not one client's)."""


def lost_result(task: ClientTask, reason: str) -> ClientResult:
    """The result of a task whose reply never arrived: the client is a dropout of the phase,
    charged the bytes sent down (the task's tensors, :func:`radbo.cost.tensor_bytes`) and no
    compute."""
    cost = CostRecord(bytes_down=tensor_bytes(task.params))
    return ClientResult(client=task.client, update={}, cost=cost, slot=task.slot, lost=reason)


class FlowerBackend:
    """Runs each task on the Flower node serving its client, through ``grid``.

    ``node_ids[c]`` is the Flower node id serving radbo client ``c`` (a sequence indexed by
    client id or a mapping). Task messages are encoded by ``sender`` (a
    :class:`~radbo.flower.codec.TaskSender`: ``sender.encode(task, node)``) or, without one,
    by :func:`~radbo.flower.codec.encode_task` with the ``extra`` scalars (e.g. the run config
    as JSON) added to every message's ``"config"`` record. ``run`` sends one message per task
    and collects the replies with :func:`exchange` (pushed at once, pulled every
    ``poll_interval`` seconds for up to ``timeout`` seconds; ``clock`` and ``sleep`` are
    :func:`exchange`'s) and returns one result per task, in task order; the node runs the
    client work (under :func:`~radbo.client.run_measured`, FLOPs included) itself.

    Every reply passes :func:`~radbo.flower.checks.check_reply` (exact key set where the
    client work declares ``update_keys``; ``max_update_ratio`` bounds the update's norm)
    before it is decoded. What fails is reported in the results, never raised (see the
    module docstring); ``rediscover(clients) -> {client: node}`` is asked, before a phase,
    for the clients of that phase without a node or whose node failed earlier, and its
    answer replaces their nodes (a client it does not find keeps a node that failed, and is
    tried there again; one with no node at all is a lost result).
    """

    def __init__(
        self,
        grid: Any,
        node_ids: Sequence[int] | Mapping[int, int],
        *,
        extra: Mapping[str, Any] | None = None,
        sender: Any = None,
        timeout: float | None = None,
        rediscover: Callable[[Sequence[int]], Mapping[int, int]] | None = None,
        max_update_ratio: float | None = None,
        poll_interval: float = POLL_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not poll_interval > 0:
            raise ValueError(
                f"FlowerBackend: poll_interval = {poll_interval!r}; give a number of seconds > 0"
            )
        self.grid = grid
        pairs = enumerate(node_ids) if isinstance(node_ids, Sequence) else node_ids.items()
        self.node_ids: dict[int, int] = {int(c): int(n) for c, n in pairs}
        self.extra = dict(extra or {})
        self.sender = sender
        self.timeout = timeout
        self.rediscover = rediscover
        self.max_update_ratio = max_update_ratio
        self.poll_interval = poll_interval
        self.clock = clock
        self.sleep = sleep
        self.failed: set[int] = set()  # clients whose node failed and has not been found again

    def node_for(self, client: int) -> int | None:
        """The node serving ``client``, or ``None`` when none is known."""
        return self.node_ids.get(client)

    def _refresh(self, clients: Sequence[int]) -> None:
        """Ask ``rediscover`` for the nodes of those of ``clients`` that need one."""
        if self.rediscover is None:
            return
        wanted = [c for c in clients if c in self.failed or c not in self.node_ids]
        if not wanted:
            return
        for client, node in dict(self.rediscover(wanted)).items():
            self.node_ids[int(client)] = int(node)
            self.failed.discard(int(client))

    def _encode(self, task: ClientTask, node: int) -> Any:
        if self.sender is not None:
            return self.sender.encode(task, node)
        return encode_task(task, self.extra)

    def _fail(self, task: ClientTask, node: int, reason: str) -> ClientResult:
        self.failed.add(task.client)
        if self.sender is not None and hasattr(self.sender, "forget"):
            self.sender.forget(task.client, node)  # the node may not hold what it was sent
        return lost_result(task, reason)

    def run(
        self,
        work: Callable[[ClientRuntime, ClientTask], ClientResult],
        runtime: ClientRuntime,
        meter: FlopMeter | None,
        tasks: Sequence[ClientTask],
    ) -> list[ClientResult]:
        """One result per task, in order: each task sent to its client's node, the replies
        checked and decoded (see the class docstring)."""
        if not tasks:
            return []
        self._refresh([t.client for t in tasks])
        state = runtime.model.state_dict()
        shapes = {n: t.shape for n, t in state.items()}
        dtypes: dict[str, torch.dtype] = {n: t.dtype for n, t in state.items()}
        keys_of: Callable[[ClientTask], Collection[str]] | None = getattr(work, "update_keys", None)
        nodes = [self.node_for(t.client) for t in tasks]
        gone = self._gone(tasks, nodes)
        messages, replies = self._exchange(tasks, nodes, gone)
        results = []
        for j, (task, node) in enumerate(zip(tasks, nodes, strict=True)):
            if node is None:
                results.append(
                    lost_result(task, f"no Flower node serves radbo client {task.client}")
                )
            elif node in gone:
                results.append(self._fail(task, node, f"Flower node {node} is not connected"))
            else:
                reply = replies.get(messages[j].metadata.message_id)
                results.append(self._result(task, node, reply, shapes, dtypes, keys_of))
        return results

    def _gone(self, tasks: Sequence[ClientTask], nodes: Sequence[int | None]) -> set[int]:
        """The nodes of ``tasks`` whose earlier failure was their leaving the grid (Flower
        dropped them after missed heartbeats): not waited for again, their clients are lost
        at once until the node is found again."""
        if not (any(t.client in self.failed for t in tasks) and hasattr(self.grid, "get_node_ids")):
            return set()
        connected = set(self.grid.get_node_ids())
        return {
            n
            for t, n in zip(tasks, nodes, strict=True)
            if n is not None and t.client in self.failed and n not in connected
        }

    def _exchange(
        self, tasks: Sequence[ClientTask], nodes: Sequence[int | None], gone: set[int]
    ) -> tuple[dict[int, Message], dict[str, Message]]:
        """Send each task that has a connected node its message and wait for the replies:
        the messages by task position, and the first reply to each by the id of the message
        it answers (the grid sets a message's id when it pushes it)."""
        messages: dict[int, Message] = {}  # task position -> its message
        for j, (task, node) in enumerate(zip(tasks, nodes, strict=True)):
            if node is not None and node not in gone:
                messages[j] = Message(
                    content=self._encode(task, node),
                    dst_node_id=node,
                    message_type=message_type(task.phase),
                )
        replies = exchange(
            self.grid,
            list(messages.values()),
            timeout=self.timeout,
            poll_interval=self.poll_interval,
            clock=self.clock,
            sleep=self.sleep,
        )
        by_id: dict[str, Message] = {}
        for answer in replies:
            by_id.setdefault(answer.metadata.reply_to_message_id, answer)
        return messages, by_id

    def _result(
        self,
        task: ClientTask,
        node: int,
        reply: Message | None,
        shapes: Mapping[str, torch.Size],
        dtypes: Mapping[str, torch.dtype],
        keys_of: Callable[[ClientTask], Collection[str]] | None,
    ) -> ClientResult:
        """The result of ``task`` from ``node``'s ``reply``: lost (the node failed: no reply,
        or an error reply), rejected (the reply fails :func:`check_reply` or cannot be
        decoded; its reported cost is charged), or the decoded result."""
        if reply is None:
            within = "" if self.timeout is None else f" within {self.timeout:g} s"
            return self._fail(task, node, f"no reply from Flower node {node}{within}")
        if reply.has_error():
            err = reply.error
            failed = f"Flower node {node} failed: code {err.code}: {err.reason}"
            return self._fail(task, node, " ".join(failed.split()))
        self.failed.discard(task.client)
        reason: str | None = check_reply(
            reply.content,
            task,
            shapes,
            max_update_ratio=self.max_update_ratio,
            update_keys=None if keys_of is None else keys_of(task),
            dtypes=dtypes,
        )
        if reason is None:
            try:
                return decode_result(reply.content)
            except Exception as err:  # noqa: BLE001 -- the checks should have caught it
                reason = f"cannot be decoded ({type(err).__name__}: {err})"
        return ClientResult(
            client=task.client,
            update={},
            cost=reported_cost(reply.content, task),
            slot=task.slot,
            rejected=f"reply rejected: {' '.join(reason.split())}",
        )
