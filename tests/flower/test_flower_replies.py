"""Every reply a Flower node sends is checked before it touches the server's state, and one
node's failure never ends the run: the FlowerBackend against an in-process fake grid whose
nodes can send bad replies, stay silent, answer with an error, or come back on a new node."""

from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'radbo[flower]')")

from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, RecordDict  # noqa: E402

from radbo.client import ClientResult, run_measured  # noqa: E402
from radbo.cost import tensor_bytes  # noqa: E402
from radbo.experiment import build  # noqa: E402
from radbo.flower.backend import FlowerBackend  # noqa: E402
from radbo.flower.checks import check_reply, reported_cost  # noqa: E402
from radbo.flower.codec import ARRAYS, CONFIG, decode_task, encode_result  # noqa: E402
from radbo.simulation import SequentialBackend  # noqa: E402
from tests.configs import small_config  # noqa: E402
from tests.helpers import Recorder, nan_where  # noqa: E402

ROUND, PHASE = 0, "train.inner"
SLOT = 2  # the bad reply comes from the third client of the round
RATIO = 1e3  # [flower] max_update_ratio of the bad-reply runs


def config(rounds=1):
    return small_config(rounds=rounds, baseline={"enabled": False}, algorithm={"inner_steps": 3})


class Grid:
    """An in-process Grid: node ``n`` runs radbo client ``nodes[n]``'s work with the
    experiment's runtime (as a node would) and answers; ``behave(task, node)`` may make it
    stay ``"silent"``, answer with an :class:`Error`, or return a function that tampers with
    the encoded reply. Messages to a node not in ``nodes`` get Flower's node-unavailable
    error. Replies come back in reverse order."""

    def __init__(self, exp, nodes, behave=None):
        self.sim = exp.simulation
        self.phases = {p.name: p for p in self.sim.algorithm.phases()}
        self.nodes = dict(nodes)
        self.behave = behave or (lambda task, node: None)
        self.sent, self.timeouts = [], []

    def send_and_receive(self, messages, *, timeout=None):
        self.timeouts.append(timeout)
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            task = decode_task(msg.content)
            action = self.behave(task, node)
            if isinstance(action, str) and action == "silent":
                continue
            if isinstance(action, Error):
                replies.append(Message(action, reply_to=msg))
                continue
            if node not in self.nodes:
                error = Error(code=3, reason="Node Unavailable: the node is not connected")
                replies.append(Message(error, reply_to=msg))
                continue
            assert self.nodes[node] == task.client
            work = self.phases[task.phase].client
            result = run_measured(work, self.sim.runtime, self.sim.flop_meter, task)
            content = encode_result(replace(result, slot=task.slot))
            if action is not None:
                content = action(content, task)
            replies.append(Message(content, reply_to=msg))
        return replies[::-1]


def flower_run(cfg, behave=None, *, rounds=1, nodes=None, **backend):
    """``rounds`` rounds of ``cfg`` through a FlowerBackend on a :class:`Grid`."""
    exp = build(cfg)
    nodes = {c: 100 + c for c in range(cfg.fleet.num_clients)} if nodes is None else nodes
    grid = Grid(exp, {n: c for c, n in nodes.items()}, behave)
    flower = FlowerBackend(grid, nodes, **backend)
    exp.simulation.backend = flower
    return list(exp.simulation.iterate(exp.initial_state, rounds)), grid, exp


def target(task):
    return task.round == ROUND and task.phase == PHASE and task.slot == SLOT


@pytest.fixture(scope="module")
def reference():
    """Round 0 of the engine with the target's update rejected (NaN)."""
    exp = build(config())
    exp.simulation.backend = Recorder(nan_where(target))  # the engine's own rejection
    ((state, record),) = exp.simulation.iterate(exp.initial_state, 1)
    return exp, state, record


# ------------------------------------------------------------------------- tampering
def tampered(content, arrays=None, config=None, drop=()):
    """A copy of a reply with some arrays and config entries replaced (``None`` removes one)
    and the update tensors ``drop`` left out."""
    a = dict(content[ARRAYS].items())
    c = dict(content[CONFIG].items())
    for key, value in {**(arrays or {})}.items():
        if value is None:
            a.pop(key, None)
        else:
            a[key] = value
    for key, value in {**(config or {})}.items():
        if value is None:
            c.pop(key, None)
        else:
            c[key] = value
    if drop:
        c["update_names"] = [n for n in c["update_names"] if n not in drop]
        for n in drop:
            a.pop(f"update/{n}")
    return RecordDict({ARRAYS: ArrayRecord(array_dict=a), CONFIG: ConfigRecord(c)})


def first_update(content):
    name = content[CONFIG]["update_names"][0]
    return name, content[ARRAYS][f"update/{name}"].numpy()


def as_dtype(dtype):
    def tamper(content, task):
        name, value = first_update(content)
        return tampered(content, {f"update/{name}": Array(value.astype(dtype))})

    return tamper


def int64_shift(content, task):
    name, value = first_update(content)  # the "moves head.weight by 500"
    return tampered(content, {f"update/{name}": Array(np.full(value.shape, 500, np.int64))})


def huge(content, task):
    name, value = first_update(content)
    return tampered(content, {f"update/{name}": Array(np.full_like(value, 3e38))})


def missing(content, task):
    name, _ = first_update(content)
    return tampered(content, drop=(name,))


def extra_key(content, task):
    name, value = first_update(content)  # a valid alias of a model tensor, not asked for
    alias = f"v:{name}"
    names = [*content[CONFIG]["update_names"], alias]
    return tampered(content, {f"update/{alias}": Array(value)}, {"update_names": names})


def wrong_shape(content, task):
    name, value = first_update(content)
    bigger = np.concatenate([value, value[:1]])
    return tampered(content, {f"update/{name}": Array(bigger)})


def costs(**values):
    return lambda content, task: tampered(
        content, config={f"cost/{k}": v for k, v in values.items()}
    )


def nan_metric(content, task):
    return tampered(content, config={"metric/inner_loss": float("nan")})


def other_client(content, task):
    return tampered(content, config={"client": (task.client + 1) % 10})


BAD_REPLIES = {
    "float64-tensor": (as_dtype(np.float64), "is float64, expected float32"),
    "int64-tensor": (int64_shift, "is int64, expected float32"),
    "missing-tensor": (missing, "missing ["),
    "finite-3e38": (huge, "exceeds 1000 x"),
    "negative-flops": (costs(flops=-1_000_000), "cost 'flops' = -1000000"),
    "negative-bytes": (costs(bytes_up=-5, bytes_down=-7), "cost 'bytes_down' = -7"),
    "nan-metric": (nan_metric, "metric 'inner_loss' = nan"),
    "wrong-client-id": (other_client, "but the task was sent to client"),
    "extra-key": (extra_key, "extra ['v:"),
    "wrong-shape": (wrong_shape, "has shape"),
}


@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_bad_reply_is_rejected_and_counted(case, reference, flower_identity):
    """Each bad reply of issue 13 is rejected before it is decoded, counted like the engine's
    own rejection of a NaN update (same state, bit for bit), its reason listed, and the round
    finishes; a reported cost that is negative is not charged."""
    tamper, reason = BAD_REPLIES[case]
    ref_exp, ref_state, ref_record = reference
    behave = lambda task, node: tamper if target(task) else None  # noqa: E731
    ((state, record),), grid, exp = flower_run(config(), behave, max_update_ratio=RATIO)

    bad = record.clients[SLOT]
    assert record.rejected == ref_record.rejected == {PHASE: [bad]}
    assert record.metrics["rejected_updates"] == 1
    assert list(record.failures) == [PHASE] and list(record.failures[PHASE]) == [bad]
    assert record.failures[PHASE][bad].startswith("reply rejected: ")
    assert reason in record.failures[PHASE][bad]
    assert record.dropped == {}
    for k, v in exp.simulation.algorithm.model_state(state).items():
        assert torch.equal(v, ref_exp.simulation.algorithm.model_state(ref_state)[k]), k
    for k, v in record.metrics.items():
        if isinstance(v, float):
            assert v == ref_record.metrics[k] or (np.isnan(v) and np.isnan(ref_record.metrics[k]))
    # the rejected reply's cost: as reported, or its sanitised value
    (entry,) = [e for e in record.ledger if e.client == bad and e.phase == PHASE]
    (ref_entry,) = [e for e in ref_record.ledger if e.client == bad and e.phase == PHASE]
    if case == "negative-flops":
        assert entry.flops == 0 and ref_entry.flops > 0
    elif case == "negative-bytes":
        assert entry.bytes_up == 0
        assert entry.bytes_down == ref_entry.bytes_down  # the task's bytes (+ index metadata)
    else:
        assert (entry.flops, entry.bytes_down) == (ref_entry.flops, ref_entry.bytes_down)
    assert all(e.flops >= 0 and e.bytes_up >= 0 for e in record.ledger)
    assert grid.timeouts == [None, None]


def test_a_finite_huge_update_passes_without_the_bound(recorded_reply):
    """Documented: without ``max_update_ratio`` a finite update is accepted however large;
    with it, the same reply is rejected."""
    task, content, shapes = recorded_reply
    wild = huge(content, task)
    assert check_reply(content, task, shapes, max_update_ratio=RATIO) is None
    assert check_reply(wild, task, shapes) is None
    assert "exceeds" in check_reply(wild, task, shapes, max_update_ratio=RATIO)


@pytest.fixture(scope="module")
def recorded_reply():
    """One honest reply (client 0, round 0, the inner phase) with its task."""
    exp = build(config())
    sim = exp.simulation
    (phase, *_) = sim.algorithm.phases()
    sim.backend = recorder = Recorder()
    sim.step(exp.initial_state, 0)
    task = recorder.tasks[0]
    result = run_measured(phase.client, sim.runtime, sim.flop_meter, task)
    return task, encode_result(replace(result, slot=task.slot)), dict(sim.shapes)


def test_reply_format_checks(recorded_reply):
    """Record names, config keys, slot and array encoding are checked too; reasons are one
    line; a rejected reply's cost is charged only where it is sound."""
    task, content, shapes = recorded_reply
    keys = set(content[CONFIG]["update_names"])
    assert check_reply(content, task, shapes, update_keys=keys) is None
    cases = {
        "records": RecordDict({ARRAYS: content[ARRAYS]}),
        "extra config key": tampered(content, config={"surprise": 1}),
        "bool client": tampered(content, config={"client": True}),
        "slot": tampered(content, config={"slot": task.slot + 1}),
        "text metric": tampered(content, config={"metric/inner_loss": "low"}),
        "bool metric": tampered(content, config={"metric/inner_loss": True}),
        "float cost": tampered(content, config={"cost/n_grad": 1.5}),
        "missing cost": tampered(content, config={"cost/samples": None}),
        "unlisted array": tampered(content, {"update/ghost": Array(np.zeros(1, np.float32))}),
        "not numpy": tampered(
            content,
            {
                f"update/{first_update(content)[0]}": Array(
                    dtype="float32", shape=(1,), stype="torch.raw", data=b"\0" * 4
                )
            },
        ),
        "unknown tensor": extra_key_named(content, "nowhere.weight"),
        "inf": tampered(
            content,
            {
                f"update/{first_update(content)[0]}": Array(
                    np.full_like(first_update(content)[1], np.inf)
                )
            },
        ),
    }
    for what, bad in cases.items():
        reason = check_reply(bad, task, shapes, update_keys=keys)
        assert reason is not None and "\n" not in reason, what
    # a missing tensor is caught by an exact key set, and unknown keys even without one
    assert check_reply(missing(content, task), task, shapes) is None
    assert "missing" in check_reply(missing(content, task), task, shapes, update_keys=keys)
    assert "not a model tensor" in check_reply(cases["unknown tensor"], task, shapes)

    sent = tensor_bytes(task.params)
    honest = reported_cost(content, task)
    assert honest.flops > 0 and honest.bytes_down > 0
    lying = costs(flops=-1, bytes_down=-1, bytes_up=float("nan"), n_grad=True)(content, task)
    assert reported_cost(lying, task) == replace(
        honest, flops=0, bytes_down=sent, bytes_up=0, n_grad=0
    )


def extra_key_named(content, name):
    _, value = first_update(content)
    names = [*content[CONFIG]["update_names"], name]
    return tampered(content, {f"update/{name}": Array(value)}, {"update_names": names})


# ------------------------------------------------------------------------- failures
def test_silent_and_failing_nodes_are_dropped_clients(flower_identity):
    """A node that never replies (the grid's timeout passes) and one answering with an Error
    are dropped clients of that phase, charged the bytes sent down; the run continues, both
    take part again in the next round, and ``record.failures`` says why."""
    cfg = config(rounds=2)

    def behave(task, node):
        if task.round == 0 and task.phase == "train.outer":
            if task.slot == 1:
                return "silent"
            if task.slot == 4:
                return Error(code=7, reason="ClientApp raised\nValueError: boom")
        return None

    rounds, grid, _ = flower_run(cfg, behave, rounds=2, timeout=30.0)
    (_, first), (_, second) = rounds
    silent, failing = first.clients[1], first.clients[4]
    assert first.dropped == {"train.outer": sorted([silent, failing])}
    assert first.failures == {
        "train.outer": {
            silent: f"no reply from Flower node {100 + silent} within 30 s",
            failing: f"Flower node {100 + failing} failed: code 7: ClientApp raised "
            "ValueError: boom",
        }
    }
    for c in (silent, failing):
        (entry,) = [e for e in first.ledger if e.client == c and e.phase == "train.outer"]
        assert entry.bytes_up == entry.flops == entry.n_grad == entry.samples == 0
        assert entry.bytes_down > 0
    assert grid.timeouts == [30.0] * 4
    assert second.dropped == {} and second.failures == {} and second.rejected == {}
    assert {silent, failing} <= {e.client for e in second.ledger}


@pytest.mark.float_sensitive  # bitwise equal to the engine: see tests.flower.test_flower.same_tensor
def test_lost_replies_equal_the_engine_s_dropouts(flower_identity):
    """Losing a client's reply through Flower gives the state of the engine run where that
    client drops out in the same phase."""
    cfg = config()
    ref = build(cfg)
    n = cfg.fleet.num_clients
    ref.simulation.dropout = [1.0 if c == 3 else 0.0 for c in range(n)]
    ((ref_state, ref_record),) = ref.simulation.iterate(ref.initial_state, 1)
    phases = [p.name for p in ref.simulation.algorithm.phases()]
    drop_phase = phases[ref.simulation.dropouts(0, range(n), len(phases))[3]]
    behave = lambda task, node: "silent" if task.client == 3 and task.phase == drop_phase else None  # noqa: E731
    ((state, record),), _, exp = flower_run(cfg, behave)
    assert record.dropped == ref_record.dropped == {drop_phase: [3]}
    a, b = (
        exp.simulation.algorithm.model_state(state),
        ref.simulation.algorithm.model_state(ref_state),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_restarted_node_rejoins_through_rediscover(flower_identity):
    """Client 2's node dies in round 0; it is back on a new node id for round 1 and
    ``rediscover`` finds it: it takes part again. Without a node at all, a client is a lost
    result, not an exception."""
    cfg = config(rounds=2)
    nodes = {c: 100 + c for c in range(cfg.fleet.num_clients)}
    exp = build(cfg)
    grid = Grid(exp, {n: c for c, n in nodes.items()})
    asked = []

    def behave(task, node):
        if task.client == 2 and task.round == 0 and task.phase == "train.outer":
            del grid.nodes[102]  # the SuperNode is killed
            grid.nodes[777] = 2  # ... and restarted under a new node id
        return None

    grid.behave = behave

    def rediscover(clients):
        asked.append(list(clients))
        return {c: n for n, c in grid.nodes.items() if c in clients and n != nodes.get(c)}

    backend = FlowerBackend(grid, nodes, rediscover=rediscover)
    exp.simulation.backend = backend
    (_, first), (_, second) = exp.simulation.iterate(exp.initial_state, 2)
    assert first.dropped == {"train.outer": [2]}
    assert "Node Unavailable" in first.failures["train.outer"][2]
    assert asked == [[2]]  # once, before the next phase client 2 takes part in
    assert backend.node_ids[2] == 777 and not backend.failed
    assert second.dropped == {} and second.failures == {}
    to_777 = [m for m in grid.sent if m.metadata.dst_node_id == 777]
    assert len(to_777) == 2  # both phases of round 1
    assert 2 in {e.client for e in second.ledger if e.phase == "train.outer"}

    # a client no node serves, and rediscovery finds none: lost, the phase goes on
    exp = build(config())
    grid = Grid(exp, {n: c for c, n in nodes.items() if c != 5})
    less = {c: n for c, n in nodes.items() if c != 5}
    exp.simulation.backend = FlowerBackend(grid, less, rediscover=lambda clients: {})
    _, record = exp.simulation.step(exp.initial_state, 0)
    assert record.dropped == {"train.inner": [5]}
    assert record.failures == {"train.inner": {5: "no Flower node serves radbo client 5"}}
    assert all(m.metadata.dst_node_id != 105 for m in grid.sent)


def test_a_client_without_a_node_needs_no_rediscover(flower_identity):
    """Without ``rediscover`` an unserved client is a lost result too."""
    cfg = config()
    nodes = {c: 100 + c for c in range(cfg.fleet.num_clients) if c != 0}
    ((_, record),), grid, _ = flower_run(cfg, nodes=nodes)
    assert record.dropped == {"train.inner": [0]}
    assert record.failures["train.inner"][0] == "no Flower node serves radbo client 0"


# ------------------------------------------------------------------------- exact key sets
def test_every_algorithm_declares_its_exact_update_keys():
    """Every built-in algorithm's client work declares ``update_keys``, and the keys of every
    result of the conformance battery's runs (every algorithm with every estimator it takes)
    are exactly the declared ones."""
    from tests.algorithms.test_algorithm_conformance import CASES
    from tests.algorithms.test_algorithm_conformance import config as case_config

    class Checking(SequentialBackend):  # checks each result against its phase's work
        def __init__(self):
            self.checked = 0

        def run(self, work, runtime, meter, tasks):
            results = super().run(work, runtime, meter, tasks)
            assert work.update_keys is not None, tasks[0].phase
            for task, result in zip(tasks, results, strict=True):
                assert set(result.update) == set(work.update_keys(task)), task.phase
                self.checked += 1
            return results

    for case in CASES:
        exp = build(case_config(case))
        backend = exp.simulation.backend = Checking()
        list(exp.simulation.iterate(exp.initial_state, 2))
        assert backend.checked > 0, case


def test_lost_result_is_a_client_result():
    from radbo.flower.backend import lost_result

    task_like = type("T", (), {"client": 4, "slot": 1, "params": {"w": torch.ones(3)}})
    r = lost_result(task_like, "gone")
    assert isinstance(r, ClientResult)
    assert (r.client, r.slot, r.lost, r.rejected, r.update) == (4, 1, "gone", None, {})
    assert r.cost.bytes_down == 12 and r.cost.flops == r.cost.bytes_up == 0
