"""A backend reports a client as lost (its reply never arrived) or its reply as rejected
(failed the backend's checks) without raising: the engine treats the first exactly like a
dropout of that phase, the second exactly like an update failing ``update_problem``, charges
what the backend reports, and lists the reasons in ``RoundRecord.failures``."""

import json
from dataclasses import replace

import pytest
import torch

from radbo.client import ClientResult, CostRecord
from radbo.cost import index_metadata_bytes, tensor_bytes
from radbo.experiment import build
from tests.configs import small_config
from tests.helpers import Recorder, nan_update

ROUNDS = 3
COUNTERS = ("flops", "n_grad", "n_hvp", "samples", "bytes_up")


def lost_result(task, reason):
    """What a backend returns for a reply that never arrived: the bytes sent down, no
    compute, nothing up."""
    cost = CostRecord(bytes_down=tensor_bytes(task.params))
    return ClientResult(client=task.client, update={}, cost=cost, lost=reason)


def rounds(exp, n=ROUNDS):
    return list(exp.simulation.iterate(exp.initial_state, n))


def assert_same_model(a, b, sim):
    ma, mb = sim.algorithm.model_state(a), sim.algorithm.model_state(b)
    assert list(ma) == list(mb)
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k


@pytest.mark.parametrize(
    "overrides",
    [{}, {"algorithm": {"name": "shrofbo"}}],
    ids=["rabo-two-phases", "shrofbo-one-phase"],
)
def test_lost_results_are_dropouts(overrides):
    """A backend marking lost exactly the (client, phase) pairs that ``dropout`` forces out
    gives the dropout run's states, dropped lists and metrics; the lost entries charge the
    bytes sent down and nothing else."""
    cfg = small_config(baseline={"enabled": False}, **overrides)
    forced = (1, 4, 7)
    ref = build(cfg)
    ref.simulation.dropout = [1.0 if c in forced else 0.0 for c in range(cfg.fleet.num_clients)]
    want = rounds(ref)
    names = [p.name for p in ref.simulation.algorithm.phases()]

    def drops(round, clients):
        return ref.simulation.dropouts(round, clients, len(names))

    everyone = range(cfg.fleet.num_clients)  # the draws are per client: sampled or not

    def mark(task, result):
        if drops(task.round, everyone).get(task.client) == names.index(task.phase):
            return lost_result(task, f"node of client {task.client} is gone")
        return None

    exp = build(cfg)
    backend = exp.simulation.backend = Recorder(mark)
    got = rounds(exp)

    seen = 0
    for (state, record), (ref_state, ref_record) in zip(got, want, strict=True):
        assert_same_model(state, ref_state, exp.simulation)
        assert record.clients == ref_record.clients
        assert record.dropped == ref_record.dropped
        assert record.rejected == ref_record.rejected == {}
        assert record.metrics == ref_record.metrics
        assert ref_record.failures == {}
        expected: dict = {}
        for c, p in drops(record.round, record.clients).items():
            expected.setdefault(names[p], {})[c] = f"node of client {c} is gone"
        assert record.failures == expected
        assert len(record.ledger) == len(ref_record.ledger)
        lost = {(c, names[p]) for c, p in drops(record.round, record.clients).items()}
        briefed = set()
        for entry, ref_entry in zip(record.ledger, ref_record.ledger, strict=True):
            assert (entry.client, entry.phase) == (ref_entry.client, ref_entry.phase)
            first = entry.client not in briefed
            briefed.add(entry.client)
            if (entry.client, entry.phase) in lost:
                seen += 1
                task = backend.task_at[record.round, entry.phase, entry.client]
                meta = index_metadata_bytes(task.index_set) if first else 0
                assert entry.bytes_down == tensor_bytes(task.params) + meta
                assert all(getattr(entry, k) == 0 for k in COUNTERS)
                assert ref_entry.flops > 0 and ref_entry.bytes_up == 0
            else:
                assert entry == ref_entry
    assert seen > 0


def test_rejected_results_are_bad_updates():
    """A backend marking chosen replies rejected gives the state, rejected lists, metrics and
    ledger of a backend returning NaN updates for the same replies; the reasons are listed."""
    cfg = small_config(baseline={"enabled": False})
    chosen = {(0, "train.inner", 2), (1, "train.outer", 5), (2, "train.inner", 8)}

    def nan_mark(task, result):
        return nan_update(result) if (task.round, task.phase, task.client) in chosen else None

    def reject_mark(task, result):
        if (task.round, task.phase, task.client) in chosen:
            # the update itself would pass update_problem: only the mark rejects it
            return replace(result, rejected=f"client {task.client} sent an int64 tensor")
        return None

    ref = build(cfg)
    ref.simulation.backend = Recorder(nan_mark)
    exp = build(cfg)
    exp.simulation.backend = Recorder(reject_mark)
    hits = 0
    for (state, record), (ref_state, ref_record) in zip(rounds(exp), rounds(ref), strict=True):
        assert_same_model(state, ref_state, exp.simulation)
        assert record.rejected == ref_record.rejected
        assert record.metrics == ref_record.metrics
        assert record.ledger == ref_record.ledger  # the cost is charged as reported
        assert (record.round_time_s, record.clock_s) == (
            ref_record.round_time_s,
            ref_record.clock_s,
        )
        want: dict = {}
        for q, phase, c in chosen:
            if q == record.round and c in record.clients:
                want.setdefault(phase, {})[c] = f"client {c} sent an int64 tensor"
                hits += 1
        assert record.failures == want
        assert {p: sorted(f) for p, f in want.items()} == record.rejected
        assert ref_record.failures == {}
    assert hits > 0


def test_failures_are_written_only_when_there_are_any():
    """``as_dict`` (results.json's rows) has a ``failures`` entry only when a backend reported
    one, so every other run's results stay byte for byte what they were."""
    cfg = small_config(rounds=1, baseline={"enabled": False})
    exp = build(cfg)
    _, record = exp.simulation.step(exp.initial_state, 0)
    assert "failures" not in record.as_dict()

    def mark(task, result):
        if task.phase == "train.outer" and task.slot == 0:
            return lost_result(task, "timed out after 300 s")
        return None

    exp = build(cfg)
    exp.simulation.backend = Recorder(mark)
    _, record = exp.simulation.step(exp.initial_state, 0)
    row = json.loads(json.dumps(record.as_dict()))
    first = record.clients[0]
    assert row["failures"] == {"train.outer": {str(first): "timed out after 300 s"}}
    assert row["dropped"] == {"train.outer": [first]}
    assert row["dropped_clients"] == 1


def test_a_lost_client_leaves_the_later_phases():
    """Lost in the inner phase, a client receives no outer task (as a dropout)."""
    cfg = small_config(rounds=1, baseline={"enabled": False})

    def mark(task, result):
        if task.phase == "train.inner" and task.slot == 1:
            return lost_result(task, "Flower node unavailable")
        return None

    exp = build(cfg)
    backend = exp.simulation.backend = Recorder(mark)
    _, record = exp.simulation.step(exp.initial_state, 0)
    gone = record.clients[1]
    assert record.dropped == {"train.inner": [gone]}
    assert (0, "train.outer", gone) not in backend.task_at
    assert [e.phase for e in record.ledger if e.client == gone] == ["train.inner"]
