"""FedScale-style over-commitment and phase deadlines on the virtual clock."""

import math

import pytest

from radbo.experiment import build
from tests.configs import small_config


def one_round(cfg, **sim):
    exp = build(cfg)
    for key, value in sim.items():
        setattr(exp.simulation, key, value)
    _, record = next(exp.simulation.iterate(exp.initial_state, 1))
    return exp.simulation, record


def by_phase(record, phase):
    return {e.client: e for e in record.ledger if e.phase == phase}


def test_overcommit_samples_more_and_keeps_the_first_k_arrivals():
    cfg = small_config(fleet={"clients_per_round": 4, "capacities": [1.0, 0.5, 0.25]})
    sim, record = one_round(cfg, overcommit=0.5)
    assert len(record.clients) == math.ceil(4 * 1.5)
    inner = by_phase(record, "train.inner")
    assert set(inner) == set(record.clients)  # everyone sampled did the first phase
    ranked = sorted(inner, key=lambda c: (inner[c].time_s, c))
    assert record.late == {"train.inner": sorted(ranked[4:])}
    # only the first four to arrive go on to the outer phase
    outer = by_phase(record, "train.outer")
    assert sorted(outer) == sorted(ranked[:4])
    # the inner phase ends with the fourth arrival. Times are Python float64 from integer
    # FLOPs and bytes over device rates (no torch kernel: the same on every CPU); the round
    # time is a sum of two of them, one rounding, far inside approx's default rel 1e-6
    fourth = inner[ranked[3]].time_s
    assert record.round_time_s == pytest.approx(fourth + max(e.time_s for e in outer.values()))
    assert record.metrics["late_clients"] == 2


def test_deadline_discards_late_results_and_bounds_the_phase():
    cfg = small_config(fleet={"capacities": [1.0, 0.5, 0.25]})
    _, free = one_round(cfg)
    times = sorted(e.time_s for e in free.ledger if e.phase == "train.inner")
    deadline = (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2
    sim, record = one_round(cfg, phase_deadline_s=deadline)
    inner = by_phase(record, "train.inner")
    late = sorted(c for c, e in inner.items() if e.time_s > deadline)
    assert late and record.late.get("train.inner") == late
    outer = by_phase(record, "train.outer")
    assert set(outer) == set(inner) - set(late)
    outer_late = sorted(c for c, e in outer.items() if e.time_s > deadline)
    assert record.late.get("train.outer", []) == outer_late
    outer_time = deadline if outer_late else max(e.time_s for e in outer.values())
    assert record.round_time_s == pytest.approx(deadline + outer_time)  # float64: one rounding


def test_no_overcommit_no_deadline_changes_nothing():
    cfg = small_config(fleet={"capacities": [1.0, 0.5]})
    _, a = one_round(cfg)
    _, b = one_round(cfg, overcommit=0.0, phase_deadline_s=None)
    assert a.late == b.late == {} and a.round_time_s == b.round_time_s
    assert [e.client for e in a.ledger] == [e.client for e in b.ledger]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"overcommit": -0.1}, "overcommit must be >= 0"),
        ({"phase_deadline_s": 0.0}, "phase_deadline_s"),
    ],
)
def test_bad_values(kw, message):
    exp = build(small_config())
    sim = exp.simulation
    with pytest.raises(ValueError, match=message):
        type(sim)(
            algorithm=sim.algorithm,
            runtime=sim.runtime,
            clients=sim.clients,
            budgets=sim.budgets,
            shapes=sim.shapes,
            **kw,
        )


def test_config_keys_reach_the_engine_and_the_totals():
    from radbo.experiment import run

    cfg = small_config(
        rounds=2,
        fleet={"clients_per_round": 4, "overcommit": 0.5},
        baseline={"enabled": False},
    )
    exp = build(cfg)
    assert exp.simulation.overcommit == 0.5 and exp.simulation.phase_deadline_s is None
    result = run(cfg, progress=False, save=False)
    late = sum(len(c) for r in result.rounds for c in r["late"].values())
    assert result.totals["late_results"] == late > 0
