"""BatchedBackend: clients whose work has the same shapes run as one stacked cohort.

The client work of every algorithm is written once for a cohort (radbo.client); these tests
check the backend's mechanics -- which tasks share a cohort, chunking, clients whose local
step counts differ, plain-function work -- and that a batched run equals the sequential one.
Equivalence is checked in float64 (``[runtime] dtype``), where the only difference is the
order of a few reductions: states agree to 1e-10 relative (float64 rounding of a few hundred
operations per step over 3 rounds is ~1e-13; measured at most 3.3e-14 on default, AVX2
and AVX-512 kernels; see test_algorithm_conformance.py for every algorithm). Ledgers (FLOPs,
bytes, counts, simulated times) are equal exactly: FLOPs are measured on the client alone.
Tests whose outcome depends on rounding carry the ``float_sensitive`` marker.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radbo.client import ClientTask, ClientWork, Cohort, run_measured, stack_key
from radbo.cost import FlopMeter
from radbo.experiment import build
from radbo.problem import ClientData
from radbo.simulation import BatchedBackend, SequentialBackend, full_index_set
from tests.configs import small_config
from tests.tolerances import gamma

F64 = {"runtime": {"dtype": "float64"}}
FULL = dict(rounds=3, fleet={"capacities": [1.0]}, mask={"policy": "none"}, **F64)
MASKED = dict(rounds=3, **F64)  # the demo fleet: 4 clients at r = 1, 3 at 1/2, 3 at 1/4


@pytest.fixture
def cohorts(monkeypatch):
    """Sizes of the stacked cohorts the backend ran (spy on Cohort.stack)."""
    sizes: list[int] = []
    original = Cohort.stack.__func__  # type: ignore[attr-defined]

    def spy(cls, tasks, prepared):
        sizes.append(len(tasks))
        return original(cls, tasks, prepared)

    monkeypatch.setattr(Cohort, "stack", classmethod(spy))
    return sizes


def trajectory(overrides: dict, backend=None):
    exp = build(small_config(**overrides))
    if backend is not None:
        exp.simulation.backend = backend
    return list(exp.simulation.iterate(exp.initial_state, exp.config.rounds))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(a.abs().max()), 1e-300)


def assert_runs_agree(seq, bat, rtol: float = 1e-10) -> None:
    """float64 runs (``F64``): states to ``rtol`` of each tensor's largest magnitude, metrics
    (losses, norms, accuracies) to ``rtol`` or 1e-12 absolute near 0 (measured: at most
    3.3e-14 relative for states and 1.6e-15 absolute for metrics, default/avx2/avx512)."""
    assert len(seq) == len(bat)
    for (sa, ra), (sb, rb) in zip(seq, bat, strict=True):
        for block in ("x", "y", "buffers", "aux"):
            if not hasattr(sa, block):  # FedAvg's state has no estimator state
                continue
            da, db = getattr(sa, block), getattr(sb, block)
            assert da.keys() == db.keys()
            for k in da:
                if da[k].is_floating_point():
                    assert relative(da[k], db[k]) <= rtol, f"{block}.{k}"
                else:
                    assert torch.equal(da[k], db[k]), f"{block}.{k}"
        assert ra.ledger == rb.ledger  # FLOPs, bytes, counts, simulated times: exactly
        assert (ra.clients, ra.rejected, ra.dropped, ra.late, ra.clock_s) == (
            rb.clients,
            rb.rejected,
            rb.dropped,
            rb.late,
            rb.clock_s,
        )
        for key, value in ra.metrics.items():
            if isinstance(value, float):
                assert value == pytest.approx(rb.metrics[key], rel=rtol, abs=1e-12), key
            else:
                assert value == rb.metrics[key], key


@pytest.mark.float_sensitive
def test_full_models_batched_run_agrees_with_sequential(cohorts):
    seq = trajectory(FULL)
    assert cohorts == []
    bat = trajectory(FULL, BatchedBackend())
    assert cohorts and max(cohorts) > 1  # clients with full-size minibatches stacked
    assert_runs_agree(seq, bat)


@pytest.mark.float_sensitive
def test_masked_fleet_batched_run_agrees_with_sequential(cohorts):
    seq = trajectory(MASKED)
    bat = trajectory(MASKED, BatchedBackend())
    assert len(cohorts) >= 3 and max(cohorts) > 1  # clients sharing a submodel shape stacked
    assert_runs_agree(seq, bat)


@pytest.mark.float_sensitive
def test_chunked_cohorts_agree_with_sequential(cohorts):
    seq = trajectory(FULL)
    bat = trajectory(FULL, BatchedBackend(max_group=3))
    assert cohorts and max(cohorts) <= 3
    assert_runs_agree(seq, bat)


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


def both(exp, work, tasks):
    """(sequential results, batched results), each with its own FLOP meter."""
    runtime = exp.simulation.runtime
    seq = SequentialBackend().run(work, runtime, FlopMeter(), tasks)
    bat = BatchedBackend().run(work, runtime, FlopMeter(), tasks)
    return seq, bat


def assert_results_agree(seq, bat, rtol: float = 1e-10) -> None:
    """float64 client results, as :func:`assert_runs_agree` (one round of client work)."""
    assert [r.client for r in seq] == [r.client for r in bat]
    for ra, rb in zip(seq, bat, strict=True):
        assert (ra.slot, ra.cost) == (rb.slot, rb.cost)
        assert ra.update.keys() == rb.update.keys()
        for k in ra.update:
            assert relative(ra.update[k], rb.update[k]) <= rtol, (ra.client, k)
        for k, v in ra.metrics.items():
            assert v == pytest.approx(rb.metrics[k], rel=rtol), (ra.client, k)


def test_a_cohort_of_one_runs_unstacked_and_equals_sequential_exactly(cohorts):
    exp = build(small_config(**FULL))
    work = exp.simulation.algorithm.phases()[0].client
    seq, bat = both(exp, work, inner_tasks(exp, [3]))
    assert cohorts == []  # min_group = 2: a lone client runs as the sequential path does
    assert bat[0].cost.flops > 0
    assert seq[0].cost == bat[0].cost
    assert all(torch.equal(seq[0].update[k], bat[0].update[k]) for k in seq[0].update)


def few_examples_tasks(exp):
    """Inner tasks of the largest client, a client holding half a minibatch, and the largest
    again; with the algorithm and the two minibatch lengths."""
    algo = exp.simulation.algorithm
    big = max(range(len(exp.clients)), key=lambda c: exp.clients[c].inner.numel())
    full = exp.clients[big]
    few = ClientData(inner=full.inner[: algo.batch_size // 2], outer=full.outer)
    return algo, big, inner_tasks(exp, [big, 1, big], data={1: few})


@pytest.mark.float_sensitive
def test_smaller_local_data_is_padded_into_the_same_cohort(cohorts):
    """Cross-entropy on an MLP: the half-size minibatch is padded (targets ignored), one
    cohort of 3, each client's result and ledger its own sequential one."""
    exp = build(small_config(**FULL))
    runtime = exp.simulation.runtime
    assert runtime.pads
    algo, big, tasks = few_examples_tasks(exp)
    work = algo.phases()[0].client
    keys = [stack_key(t, work.prepare(runtime, t), pad=True) for t in tasks]
    assert keys[0] == keys[1] == keys[2]
    seq, bat = both(exp, work, tasks)
    assert cohorts == [3]
    assert [r.client for r in bat] == [big, 1, big]
    assert bat[1].cost.samples == algo.inner_steps * (algo.batch_size // 2)  # unpadded
    assert bat[1].cost.flops != bat[0].cost.flops  # measured per workload, unpadded
    assert_results_agree(seq, bat)


@pytest.mark.float_sensitive
def test_without_padding_smaller_local_data_falls_into_another_cohort(cohorts):
    exp = build(small_config(**FULL))
    runtime = exp.simulation.runtime
    runtime.pads = False  # what a BatchNorm model or a loss that is no mean over examples gets
    algo, big, tasks = few_examples_tasks(exp)
    work = algo.phases()[0].client
    keys = [stack_key(t, work.prepare(runtime, t), pad=False) for t in tasks]
    assert keys[0] == keys[2] != keys[1]
    seq, bat = both(exp, work, tasks)
    assert cohorts == [2]
    assert [r.client for r in bat] == [big, 1, big]  # task order kept across cohorts
    assert bat[1].cost.samples == algo.inner_steps * (algo.batch_size // 2)
    assert bat[1].cost.flops != bat[0].cost.flops  # measured per workload
    assert_results_agree(seq, bat)


@pytest.mark.float_sensitive
def test_clients_with_fewer_local_steps_are_frozen_after_their_last(cohorts):
    """tau_i = 1..5 in one cohort: every client's result is its own sequential result."""
    exp = build(small_config(**FULL, algorithm={"name": "shrofbo"}))
    sim = exp.simulation
    algo = sim.algorithm
    index_set = full_index_set(sim.shapes)
    big = sorted(range(len(exp.clients)), key=lambda c: -exp.clients[c].inner.numel())[:5]
    tasks = [
        ClientTask(
            client=c,
            round=0,
            phase="train",
            params=algo.broadcast(exp.initial_state, index_set),
            index_set=index_set,
            data=sim.clients[c],
            seed=2000 + c,
            budget=dataclasses.replace(sim.budgets[c], local_steps=tau),
            slot=slot,
        )
        for slot, (c, tau) in enumerate(zip(big, [1, 2, 3, 4, 5], strict=True))
    ]
    seq, bat = both(exp, algo.phases()[0].client, tasks)
    assert cohorts == [5]  # different step counts, one cohort
    assert [r.metrics["local_steps"] for r in bat] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert_results_agree(seq, bat)


def test_plain_function_work_runs_one_client_at_a_time(cohorts):
    exp = build(small_config(**FULL))
    work = exp.simulation.algorithm.phases()[0].client
    assert isinstance(work, ClientWork)

    def plain(runtime, task):
        return work(runtime, task)

    tasks = inner_tasks(exp, [0, 1])
    runtime = exp.simulation.runtime
    seq = [run_measured(plain, runtime, FlopMeter(), t) for t in tasks]
    bat = BatchedBackend().run(plain, runtime, FlopMeter(), tasks)
    assert cohorts == []
    assert [r.cost for r in seq] == [r.cost for r in bat]


@pytest.mark.float_sensitive
def test_float32_batched_run_agrees_to_rounding():
    """float32 (the demo's dtype): the stacked kernels sum in another order. Per round a value
    passes through T = 10 inner steps and up to 10 CG iterations, each a chain of reductions
    of at most 128 terms (the hidden width; the batch of 32, the 64 inputs and the 10 clients'
    aggregation are shorter), each within γ_128 of the sum of its terms' absolute values,
    which the ReLU MLP's O(1) weights keep near the value's own scale. Over 3 rounds x 20
    steps, with the two runs rounding independently (x 2), the relative difference is at most
    2 * 3 * (10 + 10) * γ_128 = 9.2e-4 to first order, counting every step's error once (no
    amplification from one step to the next: the measured difference, 2.4e-6 / 3.2e-6 / 3.9e-6
    on default/avx2/avx512, sits 230x below, the margin for it)."""
    overrides = dict(rounds=3)
    seq, bat = trajectory(overrides), trajectory(overrides, BatchedBackend())
    bound = 2 * 3 * (10 + 10) * gamma(128, torch.float32)
    for (sa, ra), (sb, rb) in zip(seq, bat, strict=True):
        assert ra.ledger == rb.ledger
        for block in ("x", "y"):
            for k, t in getattr(sa, block).items():
                assert relative(t, getattr(sb, block)[k]) <= bound, k


def test_backend_settings_are_checked():
    with pytest.raises(ValueError, match="min_group must be >= 1"):
        BatchedBackend(min_group=0)
    with pytest.raises(ValueError, match="max_group must be >= 1"):
        BatchedBackend(max_group=0)


def test_batched_backend_from_the_config():
    exp = build(small_config(rounds=1, runtime={"backend": "batched"}))
    assert isinstance(exp.simulation.backend, BatchedBackend)
