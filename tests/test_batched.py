"""BatchedBackend: same-shape clients trained together under vmap, equal to the sequential path.

Equality achieved (CPU, float32): **bitwise with one intra-op thread** (the module fixture
below sets it; Ray's one-CPU actors run that way too). With several threads the batched and
unbatched matrix products split their sums differently, so states agree to within float32
rounding instead (max |diff| 1.2e-6 after 3 rounds on 2 threads;
``test_several_threads_agree_to_float32_rounding``); ledgers stay exactly equal. States (x, y, buffers) after every round are
compared with ``torch.equal``, ledgers (FLOPs, bytes, counts, simulated times) and round
metrics with ``==``, every client result's update with ``torch.equal``. The batched inner
phase's gradients and iterates come out bitwise equal to the sequential ones; the one value
vmap changed -- the forward value of cross-entropy's batch mean, reduced in another order --
is the reported ``inner_loss``, which the backend therefore recomputes per client exactly as
``client_inner`` does. If a future torch build changes that, these tests say so.
"""

import dataclasses
import functools

import pytest
import torch

from radbo.cost import FlopMeter
from radbo.experiment import build
from radbo.problem import ClientData
from radbo.simulation import BatchedBackend, SequentialBackend
from radbo.simulation import batched as batched_module
from radbo.client import ClientResult, ClientTask, run_measured
from radbo.simulation import full_index_set
from tests.configs import small_config

FULL = dict(rounds=3, fleet={"capacities": [1.0]}, mask={"policy": "none"})
MASKED = dict(rounds=3)  # the demo fleet: 4 clients at r = 1, 3 at 1/2, 3 at 1/4, importance


@pytest.fixture(autouse=True)
def one_thread():
    """Bitwise equality needs one summation order: one intra-op thread for both paths."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def group_sizes(monkeypatch):
    """Sizes of the groups the RABO inner implementation ran (spy on its ``run``)."""
    sizes: list[int] = []
    original = batched_module.RABOInnerBatched.run

    def spy(self, algo, runtime, tasks):
        sizes.append(len(tasks))
        return original(self, algo, runtime, tasks)

    monkeypatch.setattr(batched_module.RABOInnerBatched, "run", spy)
    return sizes


def trajectory(overrides: dict, backend=None):
    exp = build(small_config(**overrides))
    if backend is not None:
        exp.simulation.backend = backend
    rounds = list(exp.simulation.iterate(exp.initial_state, exp.config.rounds))
    return rounds, exp.simulation.flop_meter


def assert_states_equal(a, b) -> None:
    for block in ("x", "y", "buffers", "aux"):
        da, db = getattr(a, block), getattr(b, block)
        assert da.keys() == db.keys()
        for k in da:
            assert torch.equal(da[k], db[k]), f"{block}.{k} differs"


def assert_results_equal(a: list[ClientResult], b: list[ClientResult]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert (ra.client, ra.slot, ra.cost, dict(ra.metrics)) == (
            rb.client,
            rb.slot,
            rb.cost,
            dict(rb.metrics),
        )
        assert ra.update.keys() == rb.update.keys()
        for k in ra.update:
            assert torch.equal(ra.update[k], rb.update[k]), f"client {ra.client}: {k} differs"


def assert_runs_equal(seq, bat) -> None:
    (seq_rounds, seq_meter), (bat_rounds, bat_meter) = seq, bat
    assert len(seq_rounds) == len(bat_rounds)
    for (sa, ra), (sb, rb) in zip(seq_rounds, bat_rounds, strict=True):
        assert_states_equal(sa, sb)
        assert ra.ledger == rb.ledger  # FLOPs, bytes, counts, simulated times: exactly
        assert ra.metrics == rb.metrics
        assert ra.evaluation == rb.evaluation
        assert (ra.clients, ra.rejected, ra.dropped, ra.late, ra.clock_s) == (
            rb.clients,
            rb.rejected,
            rb.dropped,
            rb.late,
            rb.clock_s,
        )
    assert seq_meter.cache == bat_meter.cache


def test_full_models_batched_run_equals_sequential_bitwise(group_sizes):
    seq = trajectory(FULL)
    assert group_sizes == []
    bat = trajectory(FULL, BatchedBackend())
    # every round: all its clients (those available of the ten) in one vmap
    assert group_sizes == [len(r.clients) for _, r in seq[0]]
    assert min(group_sizes) > 1
    assert_runs_equal(seq, bat)


def test_masked_fleet_batched_run_equals_sequential_bitwise(group_sizes):
    seq = trajectory(MASKED)
    bat = trajectory(MASKED, BatchedBackend())
    assert len(group_sizes) >= 3 and max(group_sizes) > 1  # clients sharing a shape batched
    assert_runs_equal(seq, bat)


def test_chunked_groups_equal_sequential(group_sizes):
    seq = trajectory(FULL)
    bat = trajectory(FULL, BatchedBackend(max_group=4))
    chunks = lambda n: [4] * (n // 4) + ([n % 4] if n % 4 else [])  # noqa: E731
    assert group_sizes == [k for _, r in seq[0] for k in chunks(len(r.clients))]
    assert_runs_equal(seq, bat)


def inner_tasks(exp, clients: list[int], data: dict[int, ClientData] | None = None):
    sim, algo = exp.simulation, exp.simulation.algorithm
    index_set = full_index_set(sim.shapes)
    return [
        ClientTask(
            client=c,
            round=0,
            phase="train.inner",
            params=algo.broadcast_inner(exp.initial_state, index_set),
            index_set=index_set,
            data=(data or {}).get(c, sim.clients[c]),
            seed=1000 + c,
            budget=sim.budgets[c],
            slot=slot,
        )
        for slot, c in enumerate(clients)
    ]


def both(exp, client_fn, tasks):
    """(sequential results, batched results), each with its own FLOP meter."""
    runtime = exp.simulation.runtime
    seq = SequentialBackend().map(
        functools.partial(run_measured, client_fn, runtime, FlopMeter()), tasks
    )
    bat = BatchedBackend().map(
        functools.partial(run_measured, client_fn, runtime, FlopMeter()), tasks
    )
    return seq, bat


def test_group_of_one_equals_sequential(group_sizes):
    exp = build(small_config(**FULL))
    seq, bat = both(exp, exp.simulation.algorithm.client_inner, inner_tasks(exp, [3]))
    assert group_sizes == [1]
    assert bat[0].cost.flops > 0
    assert_results_equal(seq, bat)


def test_smaller_local_data_falls_into_another_group(group_sizes):
    exp = build(small_config(**FULL))
    algo = exp.simulation.algorithm
    small = exp.simulation.clients[1]
    few = ClientData(inner=small.inner[: algo.batch_size // 2], outer=small.outer)
    tasks = inner_tasks(exp, [0, 1, 2], data={1: few})
    impl = batched_module.batched_impl(algo.client_inner)
    keys = [impl.group_key(algo, exp.simulation.runtime, t) for t in tasks]
    assert keys[0] == keys[2] != keys[1]
    seq, bat = both(exp, algo.client_inner, tasks)
    assert sorted(group_sizes) == [1, 2]
    assert [r.client for r in bat] == [0, 1, 2]  # task order kept across groups
    assert bat[1].cost.samples == algo.inner_steps * (algo.batch_size // 2)
    assert bat[1].cost.flops != bat[0].cost.flops  # measured per workload, like run_measured
    assert_results_equal(seq, bat)


def test_phase_without_batched_implementation_runs_sequentially(group_sizes):
    exp = build(small_config(**FULL))
    algo = exp.simulation.algorithm
    tasks = [dataclasses.replace(t, phase="train.outer") for t in inner_tasks(exp, [0, 1, 2])]
    tasks = [
        dataclasses.replace(t, params=algo.broadcast_outer(exp.initial_state, t.index_set))
        for t in tasks
    ]
    assert batched_module.batched_impl(algo.client_outer) is None
    seq, bat = both(exp, algo.client_outer, tasks)
    assert group_sizes == []
    assert_results_equal(seq, bat)
    # a function that is not the engine's measured client function passes straight through
    plain = lambda task: algo.client_inner(exp.simulation.runtime, task)  # noqa: E731
    tasks = inner_tasks(exp, [0, 1])
    assert_results_equal(SequentialBackend().map(plain, tasks), BatchedBackend().map(plain, tasks))
    assert group_sizes == []


def test_models_with_buffers_are_not_batched():
    exp = build(small_config(**FULL))
    algo = dataclasses.replace(exp.simulation.algorithm, buffer_names=("bn.running_mean",))
    impl = batched_module.RABOInnerBatched()
    task = inner_tasks(exp, [0])[0]
    assert impl.group_key(algo, exp.simulation.runtime, task) is None


def test_several_threads_agree_to_float32_rounding():
    torch.set_num_threads(2)  # the autouse fixture restores the count afterwards
    seq, bat = trajectory(FULL), trajectory(FULL, BatchedBackend())
    for (sa, ra), (sb, rb) in zip(seq[0], bat[0], strict=True):
        assert ra.ledger == rb.ledger
        for block in ("x", "y"):
            for k, t in getattr(sa, block).items():
                torch.testing.assert_close(getattr(sb, block)[k], t, rtol=1.3e-6, atol=1e-5)
