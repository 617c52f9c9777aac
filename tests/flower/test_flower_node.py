"""Flower node side: node-local data, the node handler, node set-up checks before round 0,
radbo-config parsing, and the deployment ClientApp's torch-free import."""

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'radbo[flower]')")

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict  # noqa: E402

from radbo.cli import main  # noqa: E402
from radbo.config import load_config  # noqa: E402
from radbo.experiment import build  # noqa: E402
from radbo.flower.apps import (  # noqa: E402
    FlowerSetupError,
    _rediscover,
    discover_nodes,
    load_radbo_config,
)
from radbo.flower.codec import CONFIG  # noqa: E402
from radbo.flower.node import DISCOVERY, NodeHandler  # noqa: E402
from radbo.flower.nodedata import (  # noqa: E402
    DATA_FILE,
    META_FILE,
    NodeDataError,
    load_node_data,
    node_side,
    write_node_data,
)
from tests.configs import small_config  # noqa: E402
from tests.helpers import assert_same_state  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    config = small_config(rounds=1, baseline={"enabled": False})
    exp = build(config)
    out = tmp_path_factory.mktemp("nodes")
    return config, exp, write_node_data(config, out, exp)


def test_node_data_holds_each_client_s_examples_in_order(written):
    config, exp, folders = written
    assert [f.name for f in folders] == [f"client-{c}" for c in range(config.fleet.num_clients)]
    for c, folder in enumerate(folders):
        node = load_node_data(folder)
        data = exp.clients[c]
        assert node.client == c and node.num_clients == config.fleet.num_clients
        # the positions pick exactly the server's examples, in the server's order
        assert torch.equal(node.features[node.data.inner], exp.train.features[data.inner])
        assert torch.equal(node.features[node.data.outer], exp.train.features[data.outer])
        assert torch.equal(node.labels[node.data.inner], exp.train.labels[data.inner])
        assert torch.equal(node.labels[node.data.outer], exp.train.labels[data.outer])
        # no example twice
        assert node.features.shape[0] == len(set(data.inner.tolist()) | set(data.outer.tolist()))


def test_damaged_or_foreign_node_data_is_refused(written, tmp_path):
    config, _, folders = written
    with pytest.raises(NodeDataError, match="write it with `radbo flower partition"):
        load_node_data(tmp_path / "nowhere")
    copy = tmp_path / "client-0"
    copy.mkdir()
    raw = bytearray((folders[0] / DATA_FILE).read_bytes())
    raw[-1] ^= 1
    (copy / DATA_FILE).write_bytes(bytes(raw))
    (copy / META_FILE).write_bytes((folders[0] / META_FILE).read_bytes())
    with pytest.raises(NodeDataError, match="does not match the SHA-256"):
        load_node_data(copy)
    (copy / META_FILE).write_text('{"format": "x"}')
    with pytest.raises(NodeDataError, match="is not radbo node data"):
        load_node_data(copy)
    other = small_config(rounds=1, seed=7)
    with pytest.raises(NodeDataError, match="written for another config"):
        node_side(other, load_node_data(folders[0]))


def test_cli_partition_writes_every_client(tmp_path, capsys):
    config = load_config("examples/demo.toml")
    path = "examples/demo.toml"
    assert main(["flower", "partition", str(path), "--out", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "partition-id=i data-root=" in out
    for c in range(config.fleet.num_clients):
        assert load_node_data(tmp_path / "d" / f"client-{c}").client == c


# ----------------------------------------------------------------------------- set-up checks


class NodeGrid:
    """An in-process Grid of stateful nodes (as deployed, with radbo's worker), each with its
    own node config (``node_configs``: node id -> node config). A node in ``errors`` answers
    with that error (as a ClientApp's exception becomes an error reply), one in ``silent``
    never answers. Records every task's payload bytes and its reply's.

    Both ways Flower's grids answer: ``send_and_receive`` returns every reply at once, and
    ``push_messages`` / ``pull_messages`` as a deployment does: node ``n``'s reply to a pushed
    message is missed by the first ``late.get(n, 0)`` pulls that ask for it and returned by
    the next one. ``pulls`` counts the pulls, ``pushed`` the messages pushed."""

    def __init__(self, node_configs, errors=None, silent=(), late=None):
        self.node_configs, self.errors, self.silent = node_configs, errors or {}, set(silent)
        self.late = dict(late or {})
        self.handlers = {n: NodeHandler(stateful=True) for n in node_configs}
        self.sent = []  # (message type, client, round, task payload, reply payload)
        self.kinds = []  # the type of every message received
        self.pulls = 0
        self.pushed = 0
        self._waiting = {}  # pushed message id -> [pulls it still misses, reply]

    def get_node_ids(self):
        return list(self.node_configs)

    def _answer(self, msg):
        """The reply of ``msg``'s node, or ``None`` from a silent node."""
        from radbo.flower.codec import payload_bytes

        node = msg.metadata.dst_node_id
        kind = msg.metadata.message_type
        self.kinds.append(kind)
        if node in self.silent:
            return None
        try:
            if node in self.errors:
                raise ValueError(self.errors[node])
            content = self.handlers[node].handle(msg.content, self.node_configs[node], kind)
            reply = Message(content=content, reply_to=msg)
        except ValueError as err:
            reply = Message(Error(code=3, reason=str(err)), reply_to=msg)
        reply.metadata.__dict__["_src_node_id"] = node
        if kind != DISCOVERY and not reply.has_error():
            config = msg.content.config_records[CONFIG]
            self.sent.append(
                (
                    kind,
                    int(config["client"]),
                    int(config["round"]),
                    payload_bytes(msg.content),
                    payload_bytes(content),
                )
            )
        return reply

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for n, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"m{len(self.sent)}-{n}"
            reply = self._answer(msg)
            if reply is not None:
                replies.append(reply)
        return replies

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            self.pushed += 1
            msg_id = f"p{self.pushed}"
            msg.metadata.__dict__["_message_id"] = msg_id
            reply = self._answer(msg)
            if reply is not None:
                self._waiting[msg_id] = [self.late.get(msg.metadata.dst_node_id, 0), reply]
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        out = []
        for msg_id in message_ids:
            entry = self._waiting.get(msg_id)
            if entry is None:
                continue
            if entry[0] > 0:
                entry[0] -= 1
                continue
            out.append(self._waiting.pop(msg_id)[1])
        return out


def test_discovery_maps_clients_and_records_stateful_nodes(flower_identity):
    grid = NodeGrid({10: {"partition-id": 1}, 11: {"partition-id": 0}, 12: {"partition-id": 2}})
    stateful = set()
    assert discover_nodes(grid, 3, wait_s=5, stateful=stateful) == {0: 11, 1: 10, 2: 12}
    assert stateful == {10, 11, 12}
    assert grid.kinds == [DISCOVERY] * 3


def test_discovery_pulls_replies_itself_every_poll_interval(flower_identity, monkeypatch):
    """Discovery and rediscovery push their questions and pull the answers (issue 13), as the
    rounds do: a late node is found on a later pull; Flower's send_and_receive (and its 3-s
    ticks) is never used."""
    grid = NodeGrid({10: {"partition-id": 1}, 11: {"partition-id": 0}}, late={10: 2})

    def no_send_and_receive(*args, **kwargs):
        raise AssertionError("send_and_receive was used")

    monkeypatch.setattr(grid, "send_and_receive", no_send_and_receive)
    assert discover_nodes(grid, 2, wait_s=5, poll_interval=0.01) == {0: 11, 1: 10}
    assert grid.pushed == 2 and grid.pulls == 3  # the late node's reply came on pull 3

    grid.node_configs[12] = {"partition-id": 0}  # client 0's node restarted with a new id
    grid.handlers[12] = grid.handlers[11]
    known = {0: 11, 1: 10}
    find = _rediscover(grid, known, {"radbo": 1}, set(), 5.0, 0.01)
    assert find([0]) == {0: 12} and known == {0: 12, 1: 10}


@pytest.mark.parametrize(
    ("partitions", "errors", "message"),
    [
        (
            {10: {"partition-id": 0}, 11: {"partition-id": 0}, 12: {"partition-id": 1}},
            None,
            r"Flower nodes \[10, 11\] all serve radbo client 0: give each SuperNode its own",
        ),
        (
            {10: {"partition-id": 0}, 11: {"partition-id": 5}},
            None,
            r"Flower node 11 has partition-id 5, but the run's clients are 0..1",
        ),
        (
            {10: {"partition-id": 0}, 11: {}},
            None,
            r"Flower node 11 has no partition-id, but the run's clients are 0..1",
        ),
        (
            {10: {"partition-id": 0}, 11: {"partition-id": 1}},
            {11: "bad data-root"},
            r"Flower node 11 failed the radbo set-up: code 3: bad data-root",
        ),
    ],
)
def test_bad_node_setups_stop_before_round_0(partitions, errors, message, flower_identity):
    grid = NodeGrid(partitions, errors)
    with pytest.raises(FlowerSetupError, match=message):
        discover_nodes(grid, 2, wait_s=5)
    assert set(grid.kinds) == {DISCOVERY}


def test_a_missing_partition_waits_then_names_it(flower_identity):
    grid = NodeGrid(
        {10: {"partition-id": 0}, 11: {"partition-id": 2}, 12: {"partition-id": 1}}, silent={12}
    )
    with pytest.raises(
        FlowerSetupError, match=r"client\(s\) \[1\] after 0.2 s .* node\(s\) \[12\]"
    ):
        discover_nodes(grid, 3, wait_s=0.2)


def test_discovery_with_the_run_config_checks_each_node_s_data(written, flower_identity):
    config, _, folders = written
    from radbo.flower.codec import CONFIG_KEY, CONFIG_SHA_KEY, config_sha256

    text = config.model_dump_json()
    query = {CONFIG_KEY: text, CONFIG_SHA_KEY: config_sha256(text), "node_data": True}
    ok = {
        100 + c: {"partition-id": c, "data-root": str(folders[c])}
        for c in range(config.fleet.num_clients)
    }
    assert discover_nodes(NodeGrid(ok), config.fleet.num_clients, wait_s=5, query=query) == {
        c: 100 + c for c in range(config.fleet.num_clients)
    }
    # node 101 points at client 0's data: caught before round 0
    swapped = {**ok, 101: {"partition-id": 1, "data-root": str(folders[0])}}
    grid = NodeGrid(swapped)
    with pytest.raises(FlowerSetupError, match="node 101 .* serves radbo client 1, but its data"):
        discover_nodes(grid, config.fleet.num_clients, wait_s=5, query=query)


# ----------------------------------------------------------------------------- radbo-config


def test_radbo_config_spec_errors_are_one_line(tmp_path):
    with pytest.raises(ValueError, match="radbo-config is empty"):
        load_radbo_config("  ")
    with pytest.raises(ValueError, match=r"'cfg.toml': no such file \(relative to .*absolute"):
        load_radbo_config("cfg.toml")
    path = tmp_path / "c.toml"
    path.write_text("rounds = 3\n")
    assert load_radbo_config(str(path)).rounds == 3
    assert load_radbo_config("rounds = 4").rounds == 4
    assert load_radbo_config(json.dumps({"rounds": 5})).rounds == 5


def test_deployment_clientapp_imports_without_torch():
    code = (
        "import sys; import radbo.flower.clientapp as c; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(len(c.ACTIONS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    from radbo.flower.backend import actions
    from radbo.flower.clientapp import ACTIONS

    assert set(ACTIONS) == set(actions())


def test_discovery_reply_without_a_query_config():
    handler = NodeHandler(stateful=False)
    content = RecordDict({CONFIG: ConfigRecord({"radbo": 1})})
    reply = handler.handle(content, {"partition-id": "3"}, DISCOVERY)
    assert dict(reply.config_records[CONFIG]) == {"partition-id": 3, "stateful": False}
    with pytest.raises(ValueError, match="partition-id = 'x' is not an integer"):
        handler.handle(content, {"partition-id": "x"}, DISCOVERY)
    assert Context  # imported for the fake grids of other tests


# ----------------------------------------------------------------------------- node-local runs


@pytest.mark.float_sensitive  # bitwise equal to the engine: see tests.flower.test_flower.same_tensor
def test_node_local_run_equals_the_engine_and_wire_bytes_equal_the_ledger(written, flower_identity):
    from radbo.flower import FlowerBackend
    from radbo.flower.codec import TaskSender

    config, _, folders = written
    config = config.model_copy(update={"flower": config.flower.model_copy(update={"data": "node"})})
    ref = build(config)
    ref_states = list(ref.simulation.iterate(ref.initial_state, 2))

    exp = build(config)
    nodes = {c: 500 + c for c in range(config.fleet.num_clients)}
    grid = NodeGrid(
        {n: {"partition-id": c, "data-root": str(folders[c])} for c, n in nodes.items()}
    )
    sender = TaskSender(config.model_dump_json(), send_data=False)
    sender.stateful = set(nodes.values())
    exp.simulation.backend = FlowerBackend(grid, nodes, sender=sender)
    states = list(exp.simulation.iterate(exp.initial_state, 2))
    for (s, r), (rs, rr) in zip(states, ref_states, strict=True):
        assert_same_state(s, rs)
        assert r.ledger == rr.ledger
        assert r.metrics == rr.metrics

    # per message: tensors sent = the ledger's bytes down (its index metadata included),
    # tensors replied = its bytes up; no data indices travel
    ledger = {(e.round, e.client, e.phase): e for _, r in states for e in r.ledger}
    assert len(grid.sent) == len(ledger)
    phases = {"train.inner": "train.inner", "train.outer": "train.outer"}
    for kind, client, rnd, down, up in grid.sent:
        entry = ledger[(rnd, client, phases[kind])]
        assert "data" not in down
        assert down.get("params", 0) + down.get("index", 0) == entry.bytes_down, (kind, client)
        assert up.get("update", 0) == entry.bytes_up, (kind, client)
    # RABO's outer phase sends y (and the estimator state), not x again
    outer = [d for k, *_, d, _ in grid.sent if k == "train.outer"]
    inner = [d for k, *_, d, _ in grid.sent if k == "train.inner"]
    assert all("index" not in d for d in outer) and any("index" in d for d in inner)


# ----------------------------------------------------------------------------- the ServerApp


def _serve(config, grid, out, **run_config):
    from radbo.flower.apps import make_server_app

    sink = {}
    app = make_server_app(config, sink=sink)
    context = Context(0, 0, {}, RecordDict(), {"output-dir": str(out), **run_config})
    try:
        app._main(grid, context)  # the ServerApp's main, as flwr-serverapp calls it
    except Exception as err:  # noqa: BLE001 -- the test reads the sink and status file
        sink.setdefault("error", err)
    return sink


def test_server_app_resumes_from_checkpoints_and_writes_its_status(
    written, flower_identity, tmp_path
):
    from radbo.experiment import run

    config, _, folders = written
    config = config.model_copy(
        update={
            "flower": config.flower.model_copy(update={"data": "node"}),
            "checkpoint_every": 1,
            "eval_every": 1,
        }
    )

    def grid():
        return NodeGrid(
            {
                700 + c: {"partition-id": c, "data-root": str(folders[c])}
                for c in range(config.fleet.num_clients)
            }
        )

    whole = run(config.model_copy(update={"rounds": 3}), progress=False, save=False)
    first = _serve(config.model_copy(update={"rounds": 2}), grid(), tmp_path)
    assert "error" not in first
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "completed" and status["rounds"] == 2
    second = _serve(config.model_copy(update={"rounds": 3}), grid(), tmp_path, resume=True)
    assert "error" not in second, second.get("error")
    resumed = second["result"]
    assert resumed.final == whole.final
    # FLOPs are measured on the nodes, so the server's meter made no measurements
    strip = lambda t: {k: v for k, v in t.items() if k != "flop_measurements"}  # noqa: E731
    assert strip(resumed.totals) == strip(whole.totals)

    # a fatal error: the status says why, and the error reaches Flower
    failed = _serve(
        config.model_copy(update={"rounds": 1}), NodeGrid({1: {"partition-id": 0}}), tmp_path
    )
    assert isinstance(failed["error"], FlowerSetupError)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and "FlowerSetupError" in status["error"]


def _conformance_cases():
    from tests.algorithms.test_algorithm_conformance import CASES

    return list(CASES)


@pytest.mark.parametrize("case", _conformance_cases())
def test_every_algorithm_on_stateful_nodes_with_their_own_data_equals_the_engine(
    case, flower_identity, tmp_path
):
    """As deployed: nodes hold their own data and keep the round's tensors (the sender
    leaves out what they hold); every algorithm's trajectory equals the engine's.

    Bitwise, as in tests.flower.test_flower.same_tensor. Not marked ``float_sensitive`` (23 cases,
    ~45 s a kernel): the marked node-local test above runs the same node path per kernel."""
    from radbo.flower import FlowerBackend
    from radbo.flower.codec import TaskSender
    from tests.algorithms.test_algorithm_conformance import assert_bitwise, config, trajectory

    cfg = config(case, flower={"data": "node"})
    folders = write_node_data(cfg, tmp_path)
    nodes = {c: 900 + c for c in range(cfg.fleet.num_clients)}
    grid = NodeGrid(
        {n: {"partition-id": c, "data-root": str(folders[c])} for c, n in nodes.items()}
    )
    sender = TaskSender(cfg.model_dump_json(), send_data=False)
    sender.stateful = set(nodes.values())
    backend = FlowerBackend(grid, nodes, sender=sender)
    assert_bitwise(trajectory(cfg), trajectory(cfg, backend=backend))
    assert grid.sent
