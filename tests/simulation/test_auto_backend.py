"""AutoBackend: each workload family runs stacked or one by one, from a timing made once.

A fake clock decides the timing, so the tests are exact: the first group of a family warms up
one by one, the second is measured (stacked, then one by one; the one-by-one results are used),
later ones run the recorded side. One by one is the sequential backend bitwise; stacked agrees
with it to float64 rounding (``tests/simulation/test_batched.py`` states the bound).
"""

from __future__ import annotations

import pytest

from radbo.experiment import build
from radbo.simulation import AutoBackend
from tests.configs import small_config
from tests.helpers import assert_same_state
from tests.simulation.test_batched import (  # the fixture ``cohorts`` spies on Cohort.stack
    FULL,
    assert_runs_agree,
    cohorts,
    trajectory,
)

__all__ = ["cohorts"]


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
    backend = AutoBackend(clock=ticking(stacked=2.0, single=1.0))
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
    backend = AutoBackend(clock=ticking(stacked=1.0, single=2.0))
    auto = trajectory(FULL, backend)
    assert set(backend.plan.values()) == {"stacked"}
    # round 0 warms up, round 1 measures (one stacked run per family, results one by one)
    assert_same_state(seq[0][0], auto[0][0])
    assert_same_state(seq[1][0], auto[1][0])
    measured = len(backend.plan)
    assert len(cohorts) > measured  # round 2 ran stacked
    assert_runs_agree(seq, auto)  # float64: to rounding, ledgers exactly


def test_a_given_plan_is_followed_without_measuring(cohorts):
    first = AutoBackend(clock=ticking(stacked=1.0, single=2.0))
    trajectory(FULL, first)
    calls: list[float] = []

    def clock() -> float:
        calls.append(0.0)
        return 0.0

    again = AutoBackend(plan=dict(first.plan), clock=clock)
    cohorts.clear()
    trajectory(FULL, again)
    assert calls == [] and again.plan == first.plan
    assert len(cohorts) > 0  # stacked from round 0


def test_groups_smaller_than_min_group_run_one_by_one_and_are_not_measured(cohorts):
    backend = AutoBackend(min_group=1000, clock=ticking(stacked=1.0, single=2.0))
    trajectory(FULL, backend)
    assert backend.plan == {} and cohorts == []


def test_the_plan_is_in_the_engine_state_and_restored():
    exp = build(small_config(**FULL))
    exp.simulation.backend = AutoBackend(clock=ticking(stacked=1.0, single=2.0))
    list(exp.simulation.iterate(exp.initial_state, 3))
    tensors, data = exp.simulation.state_dict()
    assert data["backend"]["plan"] == exp.simulation.backend.plan
    fresh = build(small_config(**FULL))
    fresh.simulation.backend = AutoBackend()
    fresh.simulation.load_state_dict(tensors, data)
    assert fresh.simulation.backend.plan == exp.simulation.backend.plan
    assert fresh.simulation.backend.timings == exp.simulation.backend.timings


@pytest.mark.parametrize(
    "state, message",
    [
        ({"plan": {"f": "sideways"}, "timings": {}}, "'stacked' or 'one_by_one'"),
        ({"plan": [], "timings": {}}, "a 'plan' and 'timings' mapping"),
        ({"plan": {}, "timings": {"f": [1.0]}}, "pairs of seconds"),
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
    with pytest.raises(ValueError, match="'stacked' or 'one_by_one'"):
        AutoBackend(plan={"f": "both"})  # type: ignore[dict-item]


def test_auto_backend_from_the_config():
    exp = build(small_config(rounds=1, runtime={"backend": "auto"}))
    assert isinstance(exp.simulation.backend, AutoBackend)


def test_family_names_bucket_the_group_size():
    work = trajectory  # any callable with a qualname stands in for ClientWork.run here
    names = {
        AutoBackend.family(type("W", (), {"run": work})(), ("k",), n)  # type: ignore[arg-type]
        for n in (8, 9, 15)
    }
    assert names == {"trajectory ('k',) x8"}
