"""AutoBackend: each workload family runs stacked or one by one, as it chose once.

``choose = "size"`` (the default): from one client's FLOPs per aten operation, counted once per
family; no clock is read, so the choices and the results are the same on every run.
``choose = "timing"``: a fake clock decides the timing, so the tests are exact: the first group
of a family warms up one by one, the second is measured (stacked, then one by one; the
one-by-one results are used), later ones run the recorded side. One by one is the sequential
backend bitwise; stacked is the batched backend bitwise, and agrees with sequential to float64
rounding (``tests/simulation/test_batched.py`` states the bound).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radbo.client import Cohort
from radbo.config import RuntimeConfig
from radbo.experiment import build
from radbo.simulation import AutoBackend, BatchedBackend
from radbo.simulation.auto import CPU_MAX_FLOPS_PER_OP, operation_size
from tests.configs import small_config
from tests.helpers import assert_same_state
from tests.simulation.test_batched import (  # the fixture ``cohorts`` spies on Cohort.stack
    FULL,
    assert_runs_agree,
    cohorts,
    trajectory,
)

__all__ = ["cohorts"]


def kind(family: str) -> str:
    """The work of a family: its name without the group size (``AutoBackend.work_kind``)."""
    return family.rsplit(" x", 1)[0]


def ticking(stacked: float, single: float):
    """A clock under which every measured stacked run takes ``stacked`` seconds and every
    one-by-one run ``single`` (the backend reads it at start, middle and end)."""
    steps = [stacked, single, 0.0]
    now = [0.0]
    calls = [0]

    def clock() -> float:
        value = now[0]
        now[0] += steps[calls[0] % 3]
        calls[0] += 1
        return value

    return clock


def test_a_family_measured_faster_one_by_one_is_the_sequential_run_bitwise(cohorts):
    """float32, so any stacked kernel would show in the bits: none is used after round 1."""
    overrides = dict(rounds=3)
    seq = trajectory(overrides)
    backend = AutoBackend(choose="timing", clock=ticking(stacked=2.0, single=1.0))
    auto = trajectory(overrides, backend)
    for (sa, ra), (sb, rb) in zip(seq, auto, strict=True):
        assert_same_state(sa, sb)
        assert ra.ledger == rb.ledger
    assert backend.plan and set(backend.plan.values()) == {"one_by_one"}
    assert all(t == (2.0, 1.0) for t in backend.timings.values())
    # each family measured once: one stacked run per family, in round 1 (its second group)
    assert len(cohorts) == len(backend.plan)


def test_a_family_measured_faster_stacked_runs_stacked_from_then_on(cohorts):
    seq = trajectory(FULL)
    backend = AutoBackend(choose="timing", clock=ticking(stacked=1.0, single=2.0))
    auto = trajectory(FULL, backend)
    assert set(backend.plan.values()) == {"stacked"}
    # round 0 warms up, round 1 measures (one stacked run per family, results one by one)
    assert_same_state(seq[0][0], auto[0][0])
    assert_same_state(seq[1][0], auto[1][0])
    measured = len(backend.plan)
    assert len(cohorts) > measured  # round 2 ran stacked
    assert_runs_agree(seq, auto)  # float64: to rounding, ledgers exactly


def test_a_given_plan_is_followed_without_measuring(cohorts):
    first = AutoBackend(choose="timing", clock=ticking(stacked=1.0, single=2.0))
    trajectory(FULL, first)
    calls: list[float] = []

    def clock() -> float:
        calls.append(0.0)
        return 0.0

    again = AutoBackend(choose="timing", plan=dict(first.plan), clock=clock)
    cohorts.clear()
    trajectory(FULL, again)
    assert calls == [] and again.plan == first.plan
    assert len(cohorts) > 0  # stacked from round 0


def test_groups_smaller_than_min_group_run_one_by_one_and_are_not_measured(cohorts):
    backend = AutoBackend(choose="timing", min_group=1000, clock=ticking(stacked=1.0, single=2.0))
    trajectory(FULL, backend)
    assert backend.plan == {} and cohorts == []


@pytest.mark.parametrize("choose", ["timing", "size"])
def test_the_plan_is_in_the_engine_state_and_restored(choose):
    """With the timings or the counts it was made from (3 rounds: the timing measures in
    round 1)."""
    exp = build(small_config(**FULL))
    clock = ticking(stacked=1.0, single=2.0)
    exp.simulation.backend = AutoBackend(choose=choose, clock=clock)
    list(exp.simulation.iterate(exp.initial_state, 3))
    tensors, data = exp.simulation.state_dict()
    assert data["backend"]["plan"] == exp.simulation.backend.plan
    fresh = build(small_config(**FULL))
    fresh.simulation.backend = AutoBackend()
    fresh.simulation.load_state_dict(tensors, data)
    saved, restored = exp.simulation.backend, fresh.simulation.backend
    assert restored.plan == saved.plan and saved.plan
    assert (restored.timings, restored.sizes) == (saved.timings, saved.sizes)
    assert bool(saved.sizes) == (choose == "size")
    assert bool(saved.timings) == (choose == "timing")


@pytest.mark.parametrize(
    "state, message",
    [
        ({"plan": {"f": "sideways"}, "timings": {}}, "'stacked' or 'one_by_one'"),
        ({"plan": [], "timings": {}}, "a 'plan', 'timings', 'sizes' and 'limits' mapping"),
        ({"plan": {}, "timings": {"f": [1.0]}}, "pairs of seconds"),
        ({"plan": {}, "sizes": {"f": [1.5, 2]}}, "pairs of counts"),
        ({"plan": {}, "sizes": {"f": [True, 2]}}, "pairs of counts"),
        ({"plan": {}, "sizes": []}, "'sizes' and 'limits' mapping"),
        ({"plan": {}, "limits": []}, "'sizes' and 'limits' mapping"),
        ({"plan": {}, "limits": {"f": 0}}, "counts of at least 1"),
        ({"plan": {}, "limits": {"f": 2.0}}, "counts of at least 1"),
    ],
)
def test_a_bad_saved_state_is_refused_and_leaves_the_engine_as_it_was(state, message):
    exp = build(small_config(**FULL))
    exp.simulation.backend = AutoBackend(plan={"kept": "stacked"})
    tensors, data = exp.simulation.state_dict()
    with pytest.raises(ValueError, match=message):
        exp.simulation.load_state_dict(tensors, {**data, "backend": state})
    assert exp.simulation.backend.plan == {"kept": "stacked"}


def test_settings_are_checked():
    with pytest.raises(ValueError, match="min_group must be >= 2"):
        AutoBackend(min_group=1)
    with pytest.raises(ValueError, match="'size' or 'timing'"):
        AutoBackend(choose="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_flops_per_op must be >= 0"):
        AutoBackend(max_flops_per_op=float("nan"))
    with pytest.raises(ValueError, match="'stacked' or 'one_by_one'"):
        AutoBackend(plan={"f": "both"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="counts of at least 1"):
        AutoBackend(limits={"f": 0})


def test_auto_backend_from_the_config():
    exp = build(small_config(rounds=1, runtime={"backend": "auto"}))
    assert isinstance(exp.simulation.backend, AutoBackend)
    assert exp.simulation.backend.choose == "size"
    exp = build(small_config(rounds=1, runtime={"backend": "auto", "auto_choice": "timing"}))
    assert exp.simulation.backend.choose == "timing"


def test_auto_sized_is_the_default_backend():
    assert RuntimeConfig().backend == "auto" and RuntimeConfig().auto_choice == "size"


# -- choose = "size" --------------------------------------------------------------------------


def test_operation_size_counts_flops_and_operations_exactly():
    a, b = torch.ones(4, 3), torch.ones(3, 5)
    # one matrix product (2 * 4 * 3 * 5 FLOPs), then relu and sum: no FLOPs, one operation each
    assert operation_size(lambda: (a @ b).relu().sum()) == (120, 3)
    assert operation_size(lambda: a + 1) == (0, 1)


def test_small_operations_stack_every_family_bitwise_as_the_batched_backend(cohorts):
    """The demo MLP (float32, full models): every family averages far below 1e6 FLOPs per
    operation, so each is stacked from its first group on, and the run is the batched
    backend's bitwise; no clock is read."""
    overrides = dict(rounds=3, fleet={"capacities": [1.0]}, mask={"policy": "none"})
    batched = trajectory(overrides, BatchedBackend())
    stacked_by_batched = len(cohorts)
    cohorts.clear()

    def clock() -> float:
        raise AssertionError("the size rule reads no clock")

    backend = AutoBackend(clock=clock)
    auto = trajectory(overrides, backend)
    for (sa, ra), (sb, rb) in zip(batched, auto, strict=True):
        assert_same_state(sa, sb)
        assert ra.ledger == rb.ledger
    assert backend.plan and set(backend.plan.values()) == {"stacked"}
    assert backend.sizes.keys() == {kind(f) for f in backend.plan} and backend.timings == {}
    for flops, operations in backend.sizes.values():
        assert 0 < flops <= CPU_MAX_FLOPS_PER_OP * operations
    assert len(cohorts) == stacked_by_batched


def test_large_operations_run_one_by_one_bitwise_as_the_sequential_backend(cohorts):
    """With the limit below every family's FLOPs per operation each runs one by one: the
    sequential backend bitwise (float32), no stacked cohort."""
    sequential = trajectory(dict(rounds=3))
    backend = AutoBackend(max_flops_per_op=1.0)
    auto = trajectory(dict(rounds=3), backend)
    for (sa, ra), (sb, rb) in zip(sequential, auto, strict=True):
        assert_same_state(sa, sb)
        assert ra.ledger == rb.ledger
    assert backend.plan and set(backend.plan.values()) == {"one_by_one"}
    assert cohorts == []


def test_the_limit_is_inclusive_and_the_choice_is_the_same_every_run():
    """A family exactly at the limit stacks, one FLOP per operation below it does not; two
    runs with one limit make the same plan from the same counts."""
    first = AutoBackend()
    trajectory(FULL, first)
    again = AutoBackend()
    trajectory(FULL, again)
    assert again.plan == first.plan and again.sizes == first.sizes
    work, (flops, operations) = next(iter(first.sizes.items()))
    family = next(f for f in first.plan if kind(f) == work)
    at = AutoBackend(max_flops_per_op=flops / operations)
    trajectory(FULL, at)
    assert at.plan[family] == "stacked"
    below = AutoBackend(max_flops_per_op=(flops - 1) / operations)
    trajectory(FULL, below)
    assert below.plan[family] == "one_by_one"


def test_a_work_is_counted_once_whatever_its_group_sizes(monkeypatch):
    """The small config meets the full model's inner and outer work in groups of two sizes
    (two families each): one client's operations are counted once per work, and every family
    of it takes its side from that count."""
    import radbo.simulation.auto as auto

    counted: list[int] = []

    def spy(run):
        counted.append(1)
        return operation_size(run)

    monkeypatch.setattr(auto, "operation_size", spy)
    backend = AutoBackend()
    trajectory(dict(rounds=3), backend)
    assert len(counted) == len(backend.sizes)
    assert {kind(f) for f in backend.plan} == backend.sizes.keys()
    assert len(backend.plan) > len(backend.sizes)  # some work met at two group sizes
    for family, side in backend.plan.items():
        flops, operations = backend.sizes[kind(family)]
        assert side == ("stacked" if flops <= CPU_MAX_FLOPS_PER_OP * operations else "one_by_one")


def test_on_a_gpu_every_family_stacks_without_counting(monkeypatch):
    """Off the CPU the rule stacks at once: the family's work is not run to be counted (a
    runtime on the ``meta`` device stands in for a GPU's)."""
    import radbo.simulation.auto as auto

    def no_count(run):
        raise AssertionError("counted on a GPU")

    monkeypatch.setattr(auto, "operation_size", no_count)
    backend = AutoBackend()
    runtime = SimpleNamespace(features=torch.empty(0, device="meta"))
    side = backend._by_size("f", None, runtime, None, None)  # type: ignore[arg-type]
    assert side == "stacked" and backend.sizes == {}


def test_family_names_bucket_the_group_size():
    work = type("W", (), {"run": trajectory})()  # any callable with a qualname stands in
    names = {AutoBackend.family(work, ("k",), n) for n in (8, 9, 15)}  # type: ignore[arg-type]
    assert names == {"trajectory ('k',) x8"}
    assert AutoBackend.work_kind(work, ("k",)) == "trajectory ('k',)"  # type: ignore[arg-type]
    assert kind("trajectory ('k',) x8") == "trajectory ('k',)"


# -- a stack that does not fit in the device's memory -----------------------------------------


@pytest.fixture
def device_fits(monkeypatch):
    """``device_fits(n)``: stacking more than ``n`` clients raises ``torch.OutOfMemoryError``,
    as a GPU whose memory holds ``n`` clients' work would; the returned list records the
    sizes of the stacks that failed."""
    failed: list[int] = []

    def fits(n: int) -> list[int]:
        original = Cohort.stack.__func__  # type: ignore[attr-defined]

        def stack(cls, tasks, prepared):
            if len(tasks) > n:
                failed.append(len(tasks))
                raise torch.OutOfMemoryError(f"{len(tasks)} clients do not fit")
            return original(cls, tasks, prepared)

        monkeypatch.setattr(Cohort, "stack", classmethod(stack))
        return failed

    return fits


def test_a_stack_that_runs_out_of_memory_is_halved_until_it_fits(device_fits, caplog):
    """The full-model fleet's groups of 10, 8 and 9 clients are one family per phase. On a
    device that holds 4 clients the first group fails at 10 and at 5, and runs in chunks of 2;
    the later groups are chunked from the start. So the run is the batched backend's with
    ``max_group = 2`` bit for bit, and it failed twice per family."""
    failed = device_fits(4)
    backend = AutoBackend()
    with caplog.at_level("WARNING", logger="radbo.simulation.auto"):
        auto = trajectory(FULL, backend)
    assert failed == [10, 5, 10, 5]
    assert set(backend.plan.values()) == {"stacked"} and len(backend.plan) == 2
    assert backend.limits == dict.fromkeys(backend.plan, 2)
    assert sum("ran out of device memory" in r.getMessage() for r in caplog.records) == 4
    chunked = trajectory(FULL, BatchedBackend(max_group=2))
    for (sa, ra), (sb, rb) in zip(chunked, auto, strict=True):
        assert_same_state(sa, sb)
        assert ra.ledger == rb.ledger and ra.metrics == rb.metrics


def test_where_no_two_clients_fit_every_client_runs_alone_as_sequential(device_fits):
    """float32, the masked demo fleet: every stack fails until the limit is 1, and each client
    then runs alone, the sequential backend bit for bit."""
    failed = device_fits(1)
    backend = AutoBackend()
    auto = trajectory(dict(rounds=3), backend)
    assert failed and set(backend.limits.values()) == {1}
    assert backend.limits.keys() == backend.plan.keys()
    for (sa, ra), (sb, rb) in zip(trajectory(dict(rounds=3)), auto, strict=True):
        assert_same_state(sa, sb)
        assert ra.ledger == rb.ledger


def test_one_client_that_does_not_fit_raises(monkeypatch):
    def single(cls, task, prepared):
        raise torch.OutOfMemoryError("one client does not fit")

    monkeypatch.setattr(Cohort, "single", classmethod(single))
    with pytest.raises(torch.OutOfMemoryError, match="one client"):
        trajectory(FULL, AutoBackend(limits={}, plan={}, min_group=1000))


def test_the_limits_are_in_the_engine_state_and_a_resumed_run_chunks_as_before(device_fits):
    """Saved after round 1 and restored into a fresh engine, the limits chunk the later
    groups without another failure; the resumed run is the uninterrupted one bitwise."""
    failed = device_fits(4)
    exp = build(small_config(**FULL))
    exp.simulation.backend = AutoBackend()
    whole = list(exp.simulation.iterate(exp.initial_state, 3))
    assert failed == [10, 5, 10, 5]
    first = build(small_config(**FULL))
    first.simulation.backend = AutoBackend()
    state, record = first.simulation.step(first.initial_state, 0)
    tensors, data = first.simulation.state_dict()
    assert data["backend"]["limits"] == first.simulation.backend.limits != {}
    fresh = build(small_config(**FULL))
    fresh.simulation.backend = AutoBackend()
    fresh.simulation.load_state_dict(tensors, data)
    failed.clear()
    resumed = list(fresh.simulation.iterate(state, 2, start_round=1, clock_s=record.clock_s))
    assert failed == []
    for (sa, ra), (sb, rb) in zip(whole[1:], resumed, strict=True):
        assert_same_state(sa, sb)
        assert ra.ledger == rb.ledger
