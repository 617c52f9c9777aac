"""How the Flower backend waits for a phase's replies: it pushes the messages, then pulls the
replies every ``[flower] poll_interval_s`` seconds until all are in or ``reply_timeout_s`` has
passed. Time is a fake clock injected into the backend: the tests count pulls and sleeps,
never wall-clock time."""

import math

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'radbo[flower]')")

from flwr.app import Message, RecordDict  # noqa: E402

from radbo.config import ConfigError, FlowerConfig, parse_config  # noqa: E402
from radbo.experiment import build  # noqa: E402
from radbo.flower import FlowerBackend  # noqa: E402
from radbo.flower.backend import POLL_INTERVAL_S, exchange  # noqa: E402
from radbo.flower.codec import TaskSender  # noqa: E402
from radbo.flower.nodedata import write_node_data  # noqa: E402
from tests.configs import demo_dict, small_config  # noqa: E402
from tests.flower.test_flower_node import NodeGrid  # noqa: E402
from tests.helpers import assert_same_state  # noqa: E402


class FakeClock:
    """``now`` and ``sleep`` for the backend: sleeping moves the clock, nothing waits."""

    def __init__(self):
        self.t = 0.0
        self.sleeps = []

    def now(self):
        return self.t

    def sleep(self, seconds):
        assert seconds > 0
        self.sleeps.append(seconds)
        self.t += seconds


# ----------------------------------------------------------------------------- exchange


class EchoGrid:
    """Push/pull grid answering each message with an empty reply; node ``n``'s reply is
    missed by the first ``late[n]`` pulls (``math.inf``: never sent). Records each pull's
    time on ``clock``."""

    def __init__(self, clock, late):
        self.clock, self.late = clock, late
        self.waiting = {}
        self.pull_times = []
        self.asked = []

    def push_messages(self, messages):
        ids = []
        for k, msg in enumerate(messages):
            msg_id = f"e{k}"
            msg.metadata.__dict__["_message_id"] = msg_id
            self.waiting[msg_id] = [self.late.get(msg.metadata.dst_node_id, 0), msg]
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids):
        self.pull_times.append(self.clock.t)
        self.asked.append(sorted(message_ids))
        out = []
        for msg_id in message_ids:
            entry = self.waiting[msg_id]
            if entry[0] > 0:
                entry[0] -= 1
            else:
                out.append(Message(RecordDict(), reply_to=self.waiting.pop(msg_id)[1]))
        return out


def _messages(nodes):
    return [Message(RecordDict(), dst_node_id=n, message_type="train") for n in nodes]


@pytest.mark.parametrize(
    ("timeout", "interval", "late", "pull_times"),
    [
        # every reply in at the 4th pull: 3 waits of one interval
        (10.0, 0.25, {1: 0, 2: 3, 3: 1}, [0.0, 0.25, 0.5, 0.75]),
        # node 2 never replies: pulls every interval until the timeout, the last one at it
        (1.0, 0.25, {2: math.inf}, [0.0, 0.25, 0.5, 0.75, 1.0]),
        # an interval that does not divide the timeout: the last wait is cut to end at it
        (1.0, 0.375, {2: math.inf}, [0.0, 0.375, 0.75, 1.0]),
        # an interval longer than the timeout: one pull at the push, one at the timeout
        (0.25, 1.0, {2: math.inf}, [0.0, 0.25]),
        # no timeout: pulls until the last reply is in
        (None, 0.5, {3: 6}, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]),
        # every reply at the first pull: no wait at all
        (5.0, 0.125, {}, [0.0]),
    ],
)
def test_exchange_pulls_every_interval_until_all_replies_or_the_timeout(
    flower_identity, timeout, interval, late, pull_times
):
    clock = FakeClock()
    grid = EchoGrid(clock, late)
    messages = _messages([1, 2, 3])
    replies = exchange(
        grid, messages, timeout=timeout, poll_interval=interval, clock=clock.now, sleep=clock.sleep
    )
    assert grid.pull_times == pull_times
    assert clock.sleeps == [b - a for a, b in zip(pull_times, pull_times[1:], strict=False)]
    answered = {r.metadata.reply_to_message_id for r in replies}
    in_time = len(pull_times) - 1  # the pulls a reply may miss and still arrive
    assert answered == {
        m.metadata.message_id for m in messages if late.get(m.metadata.dst_node_id, 0) <= in_time
    }
    # a pull asks only for the replies still missing
    assert grid.asked[0] == ["e0", "e1", "e2"]
    for asked, after in zip(grid.asked, grid.asked[1:], strict=False):
        assert set(after) <= set(asked)


def test_exchange_without_push_and_pull_asks_send_and_receive(flower_identity):
    class Legacy:
        def __init__(self):
            self.calls = []

        def send_and_receive(self, messages, *, timeout=None):
            self.calls.append((len(messages), timeout))
            return [Message(RecordDict(), reply_to=m) for m in messages]

    clock = FakeClock()
    grid = Legacy()
    messages = _messages([1, 2])
    for n, m in enumerate(messages):
        m.metadata.__dict__["_message_id"] = f"x{n}"
    replies = exchange(grid, messages, timeout=7.0, clock=clock.now, sleep=clock.sleep)
    assert grid.calls == [(2, 7.0)] and clock.sleeps == []
    assert [r.metadata.reply_to_message_id for r in replies] == ["x0", "x1"]


def test_exchange_does_not_wait_for_messages_the_grid_could_not_push(flower_identity):
    class Refusing(EchoGrid):
        def push_messages(self, messages):
            return [None for _ in messages]  # as Flower marks a message it could not push

    clock = FakeClock()
    grid = Refusing(clock, {})
    assert exchange(grid, _messages([1]), timeout=5.0, clock=clock.now, sleep=clock.sleep) == []
    assert grid.pull_times == [] and clock.sleeps == []
    assert exchange(grid, [], timeout=5.0, clock=clock.now, sleep=clock.sleep) == []


def test_poll_interval_must_be_positive(flower_identity):
    with pytest.raises(ValueError, match="poll_interval = 0; give seconds > 0"):
        exchange(EchoGrid(FakeClock(), {}), _messages([1]), timeout=1.0, poll_interval=0)
    with pytest.raises(ValueError, match=r"FlowerBackend: poll_interval = -1\.0; give a number"):
        FlowerBackend(object(), {}, poll_interval=-1.0)


# ----------------------------------------------------------------------------- the backend


class PhaseGrid(NodeGrid):
    """NodeGrid recording the destination nodes of each push (one push per phase)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phases = []

    def push_messages(self, messages):
        self.phases.append([m.metadata.dst_node_id for m in messages])
        return super().push_messages(messages)


@pytest.fixture(scope="module")
def node_data(tmp_path_factory):
    config = small_config(rounds=1, baseline={"enabled": False}, flower={"data": "node"})
    return config, write_node_data(config, tmp_path_factory.mktemp("nodes"))


def _flower(config, folders, clock, *, timeout, interval, late=None, silent=()):
    """``config`` run on NodeGrid nodes 500 + c with the backend on ``clock``; ``late``:
    client -> pulls its replies miss, ``silent``: clients whose node never replies."""
    exp = build(config)
    nodes = {c: 500 + c for c in range(config.fleet.num_clients)}
    grid = PhaseGrid(
        {n: {"partition-id": c, "data-root": str(folders[c])} for c, n in nodes.items()},
        silent={nodes[c] for c in silent},
        late={nodes[c]: k for c, k in (late or {}).items()},
    )
    sender = TaskSender(config.model_dump_json(), send_data=False)
    sender.stateful = set(nodes.values())
    exp.simulation.backend = FlowerBackend(
        grid,
        nodes,
        sender=sender,
        timeout=timeout,
        poll_interval=interval,
        clock=clock.now,
        sleep=clock.sleep,
    )
    return exp, grid, nodes


@pytest.mark.float_sensitive  # bitwise equal to the engine: see tests.flower.test_flower.same_tensor
def test_late_replies_are_all_collected_and_the_run_equals_the_engine(node_data, flower_identity):
    """Nodes replying after 0-3 missed pulls: every reply is collected, the round equals the
    engine's, and each phase pulls once more than its latest node's missed pulls, one
    interval apart."""
    config, folders = node_data
    ref = build(config)
    (ref_state, ref_record), *_ = ref.simulation.iterate(ref.initial_state, 1)

    clock = FakeClock()
    late = {c: c % 4 for c in range(config.fleet.num_clients)}
    exp, grid, nodes = _flower(config, folders, clock, timeout=60.0, interval=0.25, late=late)
    (state, record), *_ = exp.simulation.iterate(exp.initial_state, 1)

    assert_same_state(state, ref_state)
    assert record.ledger == ref_record.ledger and record.metrics == ref_record.metrics
    assert record.failures == {} and record.dropped == ref_record.dropped
    by_node = {n: late[c] for c, n in nodes.items()}
    assert len(grid.phases) == 2  # RABO: train.inner, then train.outer
    waits = [max(by_node[n] for n in phase) for phase in grid.phases]
    assert max(waits) == 3
    assert grid.pulls == sum(w + 1 for w in waits)
    assert clock.sleeps == [0.25] * sum(waits)


def test_a_late_and_a_silent_node_are_lost_after_the_timeout(node_data, flower_identity):
    """A node replying only after 8 pulls (2 s at 0.25 s) and one that never replies are
    dropped clients of the phase after the 1-s timeout: 5 pulls (at 0, 0.25, .., 1 s); the
    others' replies are used."""
    config, folders = node_data
    ref = build(config)
    (_, ref_record), *_ = ref.simulation.iterate(ref.initial_state, 1)
    first = sorted({e.client for e in ref_record.ledger if e.phase == "train.inner"})
    slow, mute = first[0], first[1]

    clock = FakeClock()
    exp, grid, nodes = _flower(
        config, folders, clock, timeout=1.0, interval=0.25, late={slow: 8}, silent=[mute]
    )
    (_, record), *_ = exp.simulation.iterate(exp.initial_state, 1)

    inner = grid.phases[0]
    assert {nodes[slow], nodes[mute]} <= set(inner)
    assert record.failures["train.inner"] == {
        slow: f"no reply from Flower node {nodes[slow]} within 1 s",
        mute: f"no reply from Flower node {nodes[mute]} within 1 s",
    }
    assert sorted(record.dropped["train.inner"]) == [slow, mute]
    # the inner phase waited exactly the timeout; the outer phase (without the dropped
    # clients) got every reply at its first pull
    assert not {nodes[slow], nodes[mute]} & set(grid.phases[1])
    assert grid.pulls == 5 + 1
    assert clock.sleeps == [0.25] * 4 and clock.t == 1.0
    others = {e.client for e in record.ledger if e.phase == "train.inner" and e.bytes_up > 0}
    assert others == set(first) - {slow, mute}


# ----------------------------------------------------------------------------- the config


def test_poll_interval_config_is_bounded_and_left_out_of_dumps_at_its_default():
    assert FlowerConfig().poll_interval_s == POLL_INTERVAL_S == 0.1
    assert FlowerConfig(poll_interval_s=0.05, reply_timeout_s=0.05).poll_interval_s == 0.05
    data = demo_dict()
    for bad, why in (
        (0, "greater than 0"),
        (-1.0, "greater than 0"),
        (float("nan"), "finite number"),
    ):
        with pytest.raises(ConfigError, match=why):
            parse_config({**data, "flower": {"poll_interval_s": bad}})
    with pytest.raises(
        ConfigError,
        match="poll_interval_s = 5 exceeds reply_timeout_s = 2: set poll_interval_s at most "
        "reply_timeout_s",
    ):
        parse_config({**data, "flower": {"poll_interval_s": 5, "reply_timeout_s": 2}})
    # a [flower] section without the field dumps as before it existed (old results and
    # checkpoints still compare equal); a value other than the default is dumped
    node = parse_config({**data, "flower": {"data": "node"}})
    assert "poll_interval_s" not in node.model_dump()["flower"]
    assert "flower" not in parse_config(data).model_dump()
    tuned = parse_config({**data, "flower": {"data": "node", "poll_interval_s": 0.25}})
    assert tuned.model_dump()["flower"]["poll_interval_s"] == 0.25
    assert parse_config(tuned.model_dump()) == tuned
