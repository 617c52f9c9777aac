"""Flower ServerApp and ClientApp running radbo's algorithms (the same code as the engine).

Server. :func:`make_server_app` builds a :class:`flwr.serverapp.ServerApp` whose main checks
the node set-up (:func:`discover_nodes`: every radbo client served by exactly one node, each
node's data checked and its client side built before round 0), then calls
:func:`radbo.experiment.run` with a ``backend_factory`` that swaps the simulation's backend
for a :class:`FlowerBackend`: the rounds, sampling, masks, aggregation, ledger, evaluation,
checkpoints and ``results.json`` are exactly those of ``radbo run``; only the clients' work
crosses Flower. A node that fails or does not reply in ``[flower] reply_timeout_s`` is a
dropped client of that phase and is asked again for its partition when it is needed next
(a restarted node rejoins). The ServerApp writes ``<output dir>/status.json``
(``running``, then ``completed`` or ``failed`` with the error) and fails the Flower run on a
fatal error; with the run config key ``resume = true`` it continues from the run's
checkpoints (``checkpoint_every``).

Client. :func:`make_client_app` (Flower's simulation runtime) runs each task in the
ClientApp itself with a stateless :class:`~radbo.flower.node.NodeHandler`; deployments use
:mod:`radbo.flower.clientapp`, which forwards to a long-lived per-node worker.

Deployment (``flwr run``): ``radbo.flower.apps:server_app`` reads the radbo config from the
run config key ``radbo-config`` (an absolute TOML file path, TOML text or the JSON of a
:class:`RunConfig`); each SuperNode is started with ``--node-config 'partition-id=<radbo
client id>'`` (and ``data-root="<dir>"`` with ``[flower] data = "node"``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from radbo.atomic import atomic_write_text
from radbo.config import RunConfig, load_config, parse_config
from radbo.experiment import RunResult, run
from radbo.flower.backend import (
    POLL_INTERVAL_S,
    FlowerBackend,
    FlowerTaskError,
    actions,
    exchange,
)
from radbo.flower.clientapp import make_app
from radbo.flower.codec import (
    CONFIG,
    CONFIG_KEY,
    CONFIG_SHA_KEY,
    TaskSender,
    config_number,
    config_sha256,
)
from radbo.flower.node import DISCOVERY, PARTITION, NodeHandler
from radbo.jsonio import dumps as json_dumps

__all__ = [
    "CONFIG_KEY",
    "FlowerSetupError",
    "client_work",
    "discover_nodes",
    "load_radbo_config",
    "make_client_app",
    "make_server_app",
    "run_on_flower",
]

STATUS_FILE = "status.json"


class FlowerSetupError(FlowerTaskError):
    """The Flower nodes cannot serve the run as they are set up (checked before round 0)."""


def load_radbo_config(spec: str | RunConfig) -> RunConfig:
    """A run config from a TOML file path, TOML text or the JSON of a :class:`RunConfig`.

    A relative path is resolved from the working directory of the process reading it (for a
    deployment: the ServerApp's, which is not the user's), so give an absolute one."""
    if isinstance(spec, RunConfig):
        return spec
    text = spec.strip()
    if not text:
        raise ValueError(
            "radbo-config is empty: give an absolute path to a radbo TOML config, or its text"
        )
    if text.startswith("{"):
        return parse_config(json.loads(text))
    if "\n" not in text and "=" not in text:  # a path, not TOML text
        path = Path(text)
        if not path.is_file():
            where = "" if path.is_absolute() else f" (relative to {os.getcwd()})"
            raise ValueError(
                f"radbo-config {text!r}: no such file{where}; give an absolute path to the "
                "config, or the TOML text itself"
            )
        return load_config(path)
    return parse_config(tomllib.loads(text))


# ----------------------------------------------------------------------------- client side

_DIRECT = NodeHandler(stateful=False)


def client_work(message: Message, context: Context) -> Message:
    """Answer a task or discovery message in this process (stateless: nothing is kept
    between messages except built client sides)."""
    reply = _DIRECT.handle(message.content, context.node_config, message.metadata.message_type)
    return Message(content=reply, reply_to=message)


def make_client_app() -> ClientApp:
    """radbo's ClientApp for Flower's simulation runtime: ``train`` (default) and
    ``train.<action>`` for every routed action, plus the node-discovery query."""
    return make_app(client_work, actions())


# ----------------------------------------------------------------------------- server side


def _query(config_json: str, node_data: bool) -> dict[str, Any]:
    """The discovery question that carries a run config: nodes check their data and build
    their client side for it when they answer."""
    return {
        CONFIG_KEY: config_json,
        CONFIG_SHA_KEY: config_sha256(config_json),
        "node_data": node_data,
    }


def _served(record: ConfigRecord) -> tuple[int, bool]:
    """A discovery reply's ``(partition id, whether the node keeps state)``; -1: none."""
    return int(config_number(record, PARTITION)), bool(record.get("stateful", False))


def _ask(
    grid: Grid,
    nodes: Sequence[int],
    query: Mapping[str, Any],
    timeout: float,
    poll_interval: float = POLL_INTERVAL_S,
) -> dict[int, ConfigRecord | str]:
    """Each node's discovery reply (its config record), or the error text it sent; replies
    are pulled every ``poll_interval`` seconds (:func:`radbo.flower.backend.exchange`)."""
    messages = [
        Message(
            content=RecordDict({CONFIG: ConfigRecord(dict(query))}),
            dst_node_id=node,
            message_type=DISCOVERY,
        )
        for node in nodes
    ]
    out: dict[int, ConfigRecord | str] = {}
    for reply in exchange(grid, messages, timeout=timeout, poll_interval=poll_interval):
        node = int(reply.metadata.src_node_id)
        if reply.has_error():
            out[node] = f"code {reply.error.code}: {reply.error.reason}"
        else:
            out[node] = reply.content.config_records[CONFIG]
    return out


def discover_nodes(
    grid: Grid,
    num_clients: int,
    *,
    wait_s: float = 120.0,
    query: Mapping[str, Any] | None = None,
    stateful: set[int] | None = None,
    poll_interval: float = POLL_INTERVAL_S,
) -> dict[int, int]:
    """``{radbo client id: node id}`` for clients ``0 .. num_clients-1``, checked.

    Asks every connected node for its ``partition-id`` (``query`` scalars travel with the
    question: the run config, so nodes check their data and build their client side now),
    and keeps asking new nodes until every client is served or ``wait_s`` passes. Stops with
    a one-line :class:`FlowerSetupError` naming the node ids when two nodes serve the same
    client, a node serves none in range, a node replies with an error (its text is given),
    or a client is still not served at the deadline. Nodes that keep state across messages
    are added to ``stateful``. Replies are pulled every ``poll_interval`` seconds
    (``[flower] poll_interval_s``).
    """
    deadline = time.monotonic() + wait_s
    asked: dict[int, ConfigRecord | str] = {}
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            left = max(deadline - time.monotonic(), 1.0)
            replies = _ask(grid, new, query or {"radbo": 1}, left, poll_interval)
            asked.update(replies)
            # a node that let the wait pass has run out the clock: it is not asked again
            asked.update({n: "no reply" for n in new if n not in replies})
        served = _check_setup(asked, num_clients)
        missing = sorted(set(range(num_clients)) - set(served))
        if not missing:
            if stateful is not None:
                stateful.update(
                    n for n, r in asked.items() if isinstance(r, ConfigRecord) and _served(r)[1]
                )
            return {c: served[c] for c in range(num_clients)}
        if time.monotonic() >= deadline:
            silent = sorted(n for n, r in asked.items() if r == "no reply")
            quiet = f"; no reply from node(s) {silent}" if silent else ""
            raise FlowerSetupError(
                f"no Flower node serves radbo client(s) {missing} after {wait_s:g} s "
                f"({len(asked)} node(s) connected{quiet}): "
                "start one SuperNode per client with --node-config 'partition-id=<client>', "
                "or raise [flower] discovery_timeout_s"
            )
        time.sleep(0.5)


def _check_setup(asked: Mapping[int, ConfigRecord | str], num_clients: int) -> dict[int, int]:
    """``{client: node}`` of the replies so far; raises on a set-up no wait can fix."""
    failed = {n: r for n, r in asked.items() if isinstance(r, str) and r != "no reply"}
    if failed:
        node, reason = min(failed.items())
        raise FlowerSetupError(
            f"Flower node {node} failed the radbo set-up: {reason}"
            + (f" (and {len(failed) - 1} more node(s))" if len(failed) > 1 else "")
        )
    by_client: dict[int, list[int]] = {}
    for node, record in asked.items():
        if not isinstance(record, ConfigRecord):
            continue
        partition = _served(record)[0]
        if not 0 <= partition < num_clients:
            what = "has no partition-id" if partition == -1 else f"has partition-id {partition}"
            raise FlowerSetupError(
                f"Flower node {node} {what}, but the run's clients are 0..{num_clients - 1}: "
                "start it with --node-config 'partition-id=<client>' in that range"
            )
        by_client.setdefault(partition, []).append(node)
    twice = {c: ns for c, ns in by_client.items() if len(ns) > 1}
    if twice:
        c, ns = min(twice.items())
        raise FlowerSetupError(
            f"Flower nodes {sorted(ns)} all serve radbo client {c}: give each SuperNode its "
            "own partition-id"
        )
    return {c: ns[0] for c, ns in by_client.items()}


def _rediscover(
    grid: Grid,
    known: dict[int, int],
    query: Mapping[str, Any],
    stateful: set[int],
    timeout: float,
    poll_interval: float = POLL_INTERVAL_S,
):
    """The backend's hook for lost clients: asks nodes it does not know yet (a restarted
    SuperNode comes back with a new node id) for their partition."""

    def find(clients: Sequence[int]) -> dict[int, int]:
        used = set(known.values())
        new = [n for n in grid.get_node_ids() if n not in used]
        if not new:
            return {}
        found: dict[int, int] = {}
        for node, record in _ask(grid, new, query, timeout, poll_interval).items():
            if not isinstance(record, ConfigRecord):
                continue
            partition, keeps_state = _served(record)
            if partition in clients and partition not in found:
                found[partition] = node
                if keeps_state:
                    stateful.add(node)
        known.update(found)
        return found

    return find


def write_status(out: Path, status: str, **fields: Any) -> None:
    """``<out>/status.json``: the run's status (``running``, ``completed``, ``failed``)."""
    out.mkdir(parents=True, exist_ok=True)
    body = {"status": status, "time": time.time(), **fields}
    atomic_write_text(out / STATUS_FILE, json_dumps(body, indent=1) + "\n")


def _exit_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM (``flwr stop``, a stopped SuperLink) raise ``SystemExit`` in the main
    thread, so the ServerApp records the stop in ``status.json``; returns the undo. Off the
    main thread (Flower's simulation runtime) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum} (SIGTERM)")

    previous = signal.signal(signal.SIGTERM, stop)

    def undo() -> None:
        signal.signal(signal.SIGTERM, previous)

    return undo


def make_server_app(
    config: RunConfig | str | None = None,
    *,
    sink: dict[str, Any] | None = None,
    progress: bool | None = None,
    save: bool | None = None,
    output_dir: str | Path | None = None,
    timeout: float | None = None,
) -> ServerApp:
    """radbo's ServerApp.

    ``config`` (a :class:`RunConfig`, path or TOML text) defaults to the run config key
    ``radbo-config``; ``save`` and ``output_dir`` default to the run config keys ``save``
    (true) and ``output-dir`` (the config's ``output_dir``), ``progress`` to the run config
    key ``progress`` (true: a progress bar on stderr, which ``flwr log`` shows); ``resume``
    (run config key, default false) continues from the run's checkpoints; ``timeout`` overrides
    ``[flower] reply_timeout_s``. The :class:`RunResult` (or the exception) is put in
    ``sink["result"]`` (``sink["error"]``) when ``sink`` is given.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        out: Path | None = None
        do_save = False
        stopped = _exit_on_sigterm()
        try:
            run_config: Mapping[str, Any] = context.run_config
            cfg, do_save, out = _server_settings(config, run_config, save, output_dir)
            if do_save:
                write_status(out, "running")
            show = bool(run_config.get("progress", True)) if progress is None else progress
            result = _run_on_grid(
                grid,
                cfg,
                out=out,
                save=do_save,
                progress=show,
                resume=bool(run_config.get("resume", False)),
                timeout=timeout,
            )
        except BaseException as err:
            if sink is not None:
                sink["error"] = err
            if out is not None and do_save:
                try:
                    write_status(out, "failed", error=f"{type(err).__name__}: {err}")
                except OSError:
                    pass
            raise
        finally:
            stopped()
        if do_save:
            write_status(out, "completed", rounds=len(result.rounds))
        if sink is not None:
            sink["result"] = result

    return app


def _server_settings(
    config: RunConfig | str | None,
    run_config: Mapping[str, Any],
    save: bool | None,
    output_dir: str | Path | None,
) -> tuple[RunConfig, bool, Path]:
    """The ServerApp's run config, whether it saves, and its output folder: ``config``,
    ``save`` and ``output_dir`` where given, else the run config keys ``radbo-config``,
    ``save`` (true) and ``output-dir`` (the config's ``output_dir``)."""
    spec = config if config is not None else run_config.get("radbo-config")
    if spec is None:
        raise ValueError("no radbo config: set the run config key 'radbo-config'")
    cfg = load_radbo_config(spec)
    do_save = bool(run_config.get("save", True)) if save is None else save
    where = output_dir if output_dir is not None else run_config.get("output-dir")
    return cfg, do_save, Path(str(where)) if where else Path(cfg.output_dir)


def _run_on_grid(
    grid: Grid,
    cfg: RunConfig,
    *,
    out: Path,
    save: bool,
    progress: bool,
    resume: bool,
    timeout: float | None,
) -> RunResult:
    """Discover the nodes of ``cfg``'s clients on ``grid`` and run ``cfg`` on them
    (:func:`radbo.experiment.run` with a :class:`FlowerBackend`); ``timeout`` overrides
    ``[flower] reply_timeout_s``."""
    fc = cfg.flower
    node_data = fc.data == "node"
    stateful: set[int] = set()
    query = _query(cfg.model_dump_json(), node_data)
    nodes = discover_nodes(
        grid,
        cfg.fleet.num_clients,
        wait_s=fc.discovery_timeout_s,
        query=query,
        stateful=stateful,
        poll_interval=fc.poll_interval_s,
    )
    reply_timeout = fc.reply_timeout_s if timeout is None else timeout

    def backend(run_cfg: RunConfig) -> FlowerBackend:
        """The backend of a run of ``run_cfg`` (the config, or a baseline's) on the nodes
        found; the nodes discovery configured for ``cfg`` are not sent it again."""
        text = run_cfg.model_dump_json()
        sender = TaskSender(text, send_data=not node_data)
        sender.stateful = stateful
        if text == query[CONFIG_KEY]:  # discovery already sent it
            sender.configured.update(n for n in nodes.values() if n in stateful)
        ask = _query(text, node_data)
        return FlowerBackend(
            grid,
            dict(nodes),
            sender=sender,
            timeout=reply_timeout,
            max_update_ratio=fc.max_update_ratio,
            poll_interval=fc.poll_interval_s,
            rediscover=_rediscover(grid, nodes, ask, stateful, reply_timeout, fc.poll_interval_s),
        )

    return run(
        cfg,
        progress=progress,  # on stderr, which `flwr log` shows
        output_dir=out,
        save=save,
        resume=resume,
        backend_factory=backend,
    )


def run_on_flower(
    config: RunConfig | str,
    *,
    num_supernodes: int | None = None,
    backend_config: dict[str, Any] | None = None,
    progress: bool = False,
    save: bool = False,
    output_dir: str | Path | None = None,
    verbose: bool = False,
) -> RunResult:
    """Run ``config`` on Flower's simulation runtime (Ray): one virtual SuperNode per client.

    ``num_supernodes`` defaults to ``fleet.num_clients`` (node ``partition-id`` i serves radbo
    client i); ``backend_config`` is Flower's (default: one CPU per ClientApp). Returns the
    same :class:`RunResult` as :func:`radbo.experiment.run`. The simulation partitions data
    on the server (``[flower] data = "server"``).
    """
    from flwr.simulation import run_simulation

    cfg = load_radbo_config(config)
    n = cfg.fleet.num_clients if num_supernodes is None else num_supernodes
    if n != cfg.fleet.num_clients:
        raise ValueError(
            f"num_supernodes = {n}: each of the {cfg.fleet.num_clients} clients needs exactly "
            "one node"
        )
    if cfg.flower.data != "server":
        raise ValueError(
            'run_on_flower partitions data on the server: set [flower] data = "server" '
            '("node" is for deployments whose SuperNodes hold their own data)'
        )
    sink: dict[str, Any] = {}
    server = make_server_app(cfg, sink=sink, progress=progress, save=save, output_dir=output_dir)
    backend_config = backend_config or {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}}
    run_simulation(
        server_app=server,
        client_app=make_client_app(),
        num_supernodes=n,
        backend_config=backend_config,
        verbose_logging=verbose,
    )
    if "error" in sink:
        raise sink["error"]
    if "result" not in sink:
        raise FlowerTaskError("the Flower simulation ended without a result")
    result: RunResult = sink["result"]
    return result


#: The ServerApp for ``flwr run`` (config from the run config key ``radbo-config``).
server_app = make_server_app()
#: The ClientApp for Flower's simulation runtime; deployments use
#: ``radbo.flower.clientapp:client_app`` (a forwarder to a long-lived per-node worker).
client_app = make_client_app()
