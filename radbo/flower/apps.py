"""Flower ServerApp and ClientApp running radbo's algorithms (the same code as the engine).

Server. :func:`make_server_app` builds a :class:`flwr.serverapp.ServerApp` whose main asks
every connected node which radbo client it serves (a ``query.radbo_partition`` message,
answered from the node's ``partition-id``), then calls :func:`radbo.experiment.run` with a
``backend_factory`` that swaps the simulation's backend for a :class:`FlowerBackend`: the
rounds, sampling, masks, aggregation, ledger, evaluation, checkpoints and ``results.json``
are exactly those of ``radbo run``; only the clients' work crosses Flower.

Client. :func:`make_client_app` builds a :class:`flwr.clientapp.ClientApp` with one
``train`` handler per routed message type (see :func:`radbo.flower.backend.message_type`).
A handler decodes the task, builds the experiment of the run config the message carries
(once per process, cached), takes the phase of the task's name from the algorithm and runs
:func:`~radbo.client.run_measured` on it with the experiment's runtime and FLOP
meter, as the engine's sequential backend does, and replies with the encoded result.

Deployment (``flwr run``): ``radbo.flower.apps:server_app`` and ``radbo.flower.apps:client_app``
read the radbo config from the run config key ``radbo-config`` (a TOML file path, TOML text
or the JSON of a :class:`RunConfig`); each SuperNode is started with
``--node-config 'partition-id=<radbo client id>'``.
"""

from __future__ import annotations

import functools
import json
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from radbo.client import run_measured
from radbo.config import RunConfig, load_config, parse_config
from radbo.experiment import Experiment, RunResult, build, run
from radbo.flower.backend import FlowerBackend, FlowerTaskError, actions, message_type
from radbo.flower.codec import CONFIG, config_number, decode_task, encode_result

#: Config-record key of the run config (JSON) in every task message.
CONFIG_KEY = "radbo.config"
#: Message type of the node-discovery query.
DISCOVERY = "query.radbo_partition"
PARTITION = "partition-id"


def load_radbo_config(spec: str | RunConfig) -> RunConfig:
    """A run config from a TOML file path, TOML text or the JSON of a :class:`RunConfig`."""
    if isinstance(spec, RunConfig):
        return spec
    text = spec.strip()
    if text.startswith("{"):
        return parse_config(json.loads(text))
    if "\n" not in text and Path(text).is_file():
        return load_config(text)
    return parse_config(tomllib.loads(text))


# ----------------------------------------------------------------------------- client side


@functools.lru_cache(maxsize=4)
def _experiment(config_json: str) -> Experiment:
    """The experiment of a run config (JSON), built once per process."""
    return build(RunConfig.model_validate_json(config_json))


@functools.lru_cache(maxsize=4)
def _phases(config_json: str) -> dict[str, Any]:
    return {p.name: p for p in _experiment(config_json).simulation.algorithm.phases()}


def client_work(message: Message, context: Context) -> Message:
    """Run the phase client function a task message asks for; reply with its result."""
    config = message.content.config_records[CONFIG]
    config_json = str(config[CONFIG_KEY])
    task = decode_task(message.content)
    expected = message_type(task.phase)
    if message.metadata.message_type != expected:
        raise ValueError(
            f"phase {task.phase!r} arrived as {message.metadata.message_type!r}, "
            f"expected {expected!r}"
        )
    partition = context.node_config.get(PARTITION)
    if partition is not None and int(partition) != task.client:
        raise ValueError(
            f"this node serves radbo client {partition}, but received a task of client "
            f"{task.client}"
        )
    exp = _experiment(config_json)
    phase = _phases(config_json).get(task.phase)
    if phase is None:
        raise ValueError(f"the configured algorithm has no phase {task.phase!r}")
    sim = exp.simulation
    result = run_measured(phase.client, sim.runtime, sim.flop_meter, task)
    return Message(content=encode_result(result), reply_to=message)


def _discovery(message: Message, context: Context) -> Message:
    partition = context.node_config.get(PARTITION)
    record = ConfigRecord({PARTITION: -1 if partition is None else int(partition)})
    return Message(content=RecordDict({CONFIG: record}), reply_to=message)


def make_client_app() -> ClientApp:
    """radbo's ClientApp: ``train`` (default) and ``train.<action>`` for every routed action,
    plus the node-discovery query."""
    app = ClientApp()
    app.train()(client_work)
    for action in actions():
        app.train(action)(client_work)
    app.query(DISCOVERY.split(".", 1)[1])(_discovery)
    return app


# ----------------------------------------------------------------------------- server side


def discover_nodes(grid: Grid, num_clients: int, *, wait_s: float = 120.0) -> dict[int, int]:
    """``{radbo client id: node id}`` for clients ``0 .. num_clients-1``.

    Waits up to ``wait_s`` seconds for enough nodes to connect, then asks each node for its
    ``partition-id``. Raises :class:`FlowerTaskError` when a client has no node.
    """
    deadline = time.monotonic() + wait_s
    nodes = list(grid.get_node_ids())
    while len(nodes) < num_clients and time.monotonic() < deadline:
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    messages = [
        Message(
            content=RecordDict({CONFIG: ConfigRecord({"radbo": 1})}),
            dst_node_id=node,
            message_type=DISCOVERY,
        )
        for node in nodes
    ]
    replies = list(grid.send_and_receive(messages, timeout=wait_s))
    mapping: dict[int, int] = {}
    for reply in replies:
        if reply.has_error():
            continue
        partition = int(config_number(reply.content.config_records[CONFIG], PARTITION))
        if 0 <= partition < num_clients:
            mapping.setdefault(partition, int(reply.metadata.src_node_id))
    missing = sorted(set(range(num_clients)) - set(mapping))
    if missing:
        raise FlowerTaskError(
            f"no Flower node serves radbo client(s) {missing}: start one SuperNode per client "
            f"with --node-config 'partition-id=<client>' ({len(nodes)} node(s) connected)"
        )
    return mapping


def make_server_app(
    config: RunConfig | str | None = None,
    *,
    sink: dict[str, Any] | None = None,
    progress: bool = False,
    save: bool | None = None,
    output_dir: str | Path | None = None,
    timeout: float | None = None,
) -> ServerApp:
    """radbo's ServerApp.

    ``config`` (a :class:`RunConfig`, path or TOML text) defaults to the run config key
    ``radbo-config``; ``save`` and ``output_dir`` default to the run config keys ``save``
    (true) and ``output-dir`` (the config's ``output_dir``). The :class:`RunResult` (or the
    exception) is put in ``sink["result"]`` (``sink["error"]``) when ``sink`` is given.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_config: Mapping[str, Any] = context.run_config
            spec = config if config is not None else run_config.get("radbo-config")
            if spec is None:
                raise ValueError("no radbo config: set the run config key 'radbo-config'")
            cfg = load_radbo_config(spec)
            nodes = discover_nodes(grid, cfg.fleet.num_clients)
            do_save = bool(run_config.get("save", True)) if save is None else save
            out = output_dir if output_dir is not None else run_config.get("output-dir")

            def backend(run_cfg: RunConfig) -> FlowerBackend:
                extra = {CONFIG_KEY: run_cfg.model_dump_json()}
                return FlowerBackend(grid, nodes, extra=extra, timeout=timeout)

            result = run(
                cfg, progress=progress, output_dir=out, save=do_save, backend_factory=backend
            )
        except BaseException as err:
            if sink is not None:
                sink["error"] = err
            raise
        if sink is not None:
            sink["result"] = result

    return app


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
    client i; extra nodes stay idle); ``backend_config`` is Flower's (default: one CPU per
    ClientApp). Returns the same :class:`RunResult` as :func:`radbo.experiment.run`.
    """
    from flwr.simulation import run_simulation

    cfg = load_radbo_config(config)
    n = cfg.fleet.num_clients if num_supernodes is None else num_supernodes
    if n < cfg.fleet.num_clients:
        raise ValueError(
            f"num_supernodes = {n}: each of the {cfg.fleet.num_clients} clients needs a node"
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
    return sink["result"]


#: Apps for ``flwr run`` (config from the run config key ``radbo-config``).
server_app = make_server_app()
client_app = make_client_app()
