"""radbo on Flower: the codec, the FlowerBackend against an in-process fake Grid, and a
Flower simulation (Ray) that must reproduce the in-process engine bit for bit."""

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'radbo[flower]')")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402

from radbo.experiment import build, run  # noqa: E402
from radbo.flower import (  # noqa: E402
    FlowerBackend,
    client_work,
    decode_result,
    decode_task,
    encode_result,
    encode_task,
    message_type,
    run_on_flower,
)
from radbo.flower.apps import CONFIG_KEY  # noqa: E402
from tests.configs import small_config  # noqa: E402
from tests.helpers import Recorder, assert_same_state, same_tensor  # noqa: E402


def same_params(a, b):
    """Bitwise: the codec is exact."""
    return list(a) == list(b) and all(same_tensor(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def recorded():
    """Tasks and results of round 0 of the masked RABO demo (both phases)."""
    exp = build(small_config(rounds=1, baseline={"enabled": False}))
    backend = Recorder()
    exp.simulation.backend = backend
    exp.simulation.step(exp.initial_state, 0)
    return backend


def test_codec_round_trip_is_exact(recorded):
    assert {t.phase for t in recorded.tasks} == {"train.inner", "train.outer"}
    # masked submodels: some index sets keep part of a dimension, some keep all of it
    dims = [i for t in recorded.tasks for idx in t.index_set.values() for i in idx]
    assert any(i is None for i in dims) and any(i is not None for i in dims)
    for task in recorded.tasks:
        back = decode_task(encode_task(task))
        for f in ("client", "round", "phase", "seed", "budget", "slot"):
            assert getattr(back, f) == getattr(task, f), f
        assert same_params(back.params, task.params)
        assert list(back.index_set) == list(task.index_set)
        for name, idx in task.index_set.items():
            assert len(back.index_set[name]) == len(idx)
            for i, j in zip(idx, back.index_set[name], strict=True):
                assert (i is None and j is None) or same_tensor(i, j)
        assert same_tensor(back.data.inner, task.data.inner)
        assert same_tensor(back.data.outer, task.data.outer)
    for result in recorded.results:
        back = decode_result(encode_result(result))
        assert back.client == result.client and back.slot == result.slot
        assert back.cost == result.cost and back.cost.flops > 0
        assert dict(back.metrics) == dict(result.metrics)
        assert same_params(back.update, result.update)


def test_message_types():
    assert message_type("train.inner") == "train.inner"
    assert message_type("train.outer") == "train.outer"
    assert message_type("train") == "train"
    assert message_type("train.local") == "train.local"
    for other in ("inner.3", "phe.init", "phe.2", "phe.final", "train.unknown"):
        assert message_type(other) == "train.radbo"


class FakeGrid:
    """An in-process Grid: each node runs radbo's client handler as client ``partition``.

    Like Flower's grids it sets each message's id when pushing; it answers in reverse order
    (so the backend must reorder) and can drop or fail the reply to one client.
    """

    def __init__(self, partitions, drop=None, fail=None):
        self.partitions = partitions  # node id -> radbo client id
        self.sent, self.drop, self.fail = [], drop, fail

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for n, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"m{len(self.sent)}-{n}"
            self.sent.append(msg)
            client = self.partitions[msg.metadata.dst_node_id]
            if client == self.drop:
                continue
            if client == self.fail:
                replies.append(Message(Error(code=7, reason="boom"), reply_to=msg))
                continue
            context = Context(
                0, msg.metadata.dst_node_id, {"partition-id": client}, RecordDict(), {}
            )
            replies.append(client_work(msg, context))
        return replies[::-1]


@pytest.mark.float_sensitive
def test_flower_backend_with_fake_grid_matches_engine(flower_identity):
    config = small_config(rounds=1, baseline={"enabled": False})
    ref = build(config)
    ref_state, ref_record = ref.simulation.step(ref.initial_state, 0)

    exp = build(config)
    nodes = {c: 1000 + 7 * c for c in range(config.fleet.num_clients)}
    grid = FakeGrid({n: c for c, n in nodes.items()})
    exp.simulation.backend = FlowerBackend(
        grid, nodes, extra={CONFIG_KEY: config.model_dump_json()}
    )
    state, record = exp.simulation.step(exp.initial_state, 0)

    assert_same_state(state, ref_state)
    assert record.ledger == ref_record.ledger
    clients = record.clients
    types = [m.metadata.message_type for m in grid.sent]
    assert types == ["train.inner"] * len(clients) + ["train.outer"] * len(clients)
    assert [m.metadata.dst_node_id for m in grid.sent] == [nodes[c] for c in clients] * 2
    # results come back in task order although the grid answers in reverse
    assert [e.client for e in record.ledger] == clients * 2


def test_flower_backend_reports_missing_and_failed_replies(recorded, flower_identity):
    """A missing reply, an error reply and a client without a node are lost results (dropped
    clients of the phase), not errors that end the run."""
    config = small_config(rounds=1, baseline={"enabled": False})
    runtime = build(config).simulation.runtime
    tasks = [t for t in recorded.tasks if t.phase == "train.inner"][:3]
    nodes = list(range(config.fleet.num_clients))
    extra = {CONFIG_KEY: config.model_dump_json()}
    grid = FakeGrid(dict(enumerate(nodes)), drop=tasks[1].client, fail=tasks[2].client)
    out = FlowerBackend(grid, nodes, extra=extra, timeout=5).run(None, runtime, None, tasks)
    assert out[0].lost is None and out[0].rejected is None
    assert out[1].lost == f"no reply from Flower node {tasks[1].client} within 5 s"
    assert out[2].lost.endswith("code 7: boom")
    out = FlowerBackend(grid, {}, extra=extra).run(None, runtime, None, tasks)
    assert all(r.lost.startswith("no Flower node serves radbo client") for r in out)


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_flower_simulation_matches_engine():
    """RABO with masks on the demo fleet, 2 rounds on Flower's Ray runtime (one SuperNode per
    client) gives bitwise the state, ledger and per-round records of ``radbo.experiment.run``.

    Slow (20-30 s on 2 cores, nearly all of it starting Ray and Flower: 3 SuperNodes and 1
    round take as long). The fake-grid tests above run the same FlowerBackend in-process."""
    config = small_config(rounds=2, baseline={"enabled": False})
    # Bitwise equality needs the same float summation order everywhere: Ray gives each
    # SuperNode one CPU (one intra-op thread), so the in-process run uses one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = run(config, progress=False, save=False)
        got = run_on_flower(
            config,
            num_supernodes=config.fleet.num_clients,
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    finally:
        torch.set_num_threads(threads)
    assert_same_state(got.state, ref.state)
    assert got.ledger == ref.ledger
    assert len(got.rounds) == len(ref.rounds) == 2
    for a, b in zip(got.rounds, ref.rounds, strict=True):
        a, b = dict(a), dict(b)
        a.pop("wall_time_s"), b.pop("wall_time_s")
        assert a == b
    assert got.final == ref.final
    # FLOPs are measured on the nodes, so the server's own meter measured nothing
    skip = {"flop_measurements"}
    assert {k: v for k, v in got.totals.items() if k not in skip} == {
        k: v for k, v in ref.totals.items() if k not in skip
    }
    assert got.totals_by_tier == ref.totals_by_tier


@pytest.mark.parametrize(
    "overrides",
    [
        {"algorithm": {"name": "shrofbo"}},
        {
            "algorithm": {
                "name": "fedmbo",
                "inner_steps": 2,
                "neumann_terms": 3,
                "clients_per_phase": 3,
            },
            "mask": {"policy": "none"},
            "fleet": {"capacities": [1.0]},
        },
        {
            "algorithm": {"name": "fedmsa", "local_steps": 2},
            "mask": {"policy": "none"},
            "fleet": {"capacities": [1.0]},
        },
    ],
    ids=["shrofbo", "fedmbo", "fedmsa"],
)
@pytest.mark.float_sensitive
def test_other_algorithms_over_the_fake_grid_match_the_engine(flower_identity, overrides):
    """Per-phase client selection and slots (FedMBO's chains, FedMSA's one local client)
    survive the trip through Flower messages: same state and ledger as the engine."""
    config = small_config(rounds=1, baseline={"enabled": False}, **overrides)
    ref = build(config)
    ref_state, ref_record = ref.simulation.step(ref.initial_state, 0)
    exp = build(config)
    nodes = {c: 500 + c for c in range(config.fleet.num_clients)}
    grid = FakeGrid({n: c for c, n in nodes.items()})
    exp.simulation.backend = FlowerBackend(
        grid, nodes, extra={CONFIG_KEY: config.model_dump_json()}
    )
    state, record = exp.simulation.step(exp.initial_state, 0)
    assert_same_state(state, ref_state)
    assert record.ledger == ref_record.ledger
    assert record.communication_rounds == ref_record.communication_rounds
    assert len(grid.sent) == len(record.ledger)


def _one_case_per_algorithm():
    from tests.algorithms.test_algorithm_conformance import CASES

    seen = {}
    for case, (algorithm, _, _) in CASES.items():
        seen.setdefault(algorithm["name"], case)
    return sorted(seen.values())


@pytest.mark.slow
@pytest.mark.float_sensitive
@pytest.mark.parametrize("case", _one_case_per_algorithm())
def test_every_algorithm_through_run_on_flower_equals_the_engine(case):
    """Each algorithm on Flower's Ray runtime (``run_on_flower``) gives bitwise the state and
    ledger of ``radbo.run`` with one intra-op thread. Slow: Ray and Flower start per case
    (about 20-40 s each on 2 cores)."""
    from tests.algorithms.test_algorithm_conformance import config as conformance_config

    cfg = conformance_config(case)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = run(cfg, progress=False, save=False)
        got = run_on_flower(cfg)
    finally:
        torch.set_num_threads(threads)
    assert_same_state(got.state, ref.state)
    assert got.ledger == ref.ledger
    assert got.final == ref.final
