"""Clients that drop out mid-round: left out of aggregation, charged for what they did."""

import pytest
import torch

from radbo.experiment import build
from tests.configs import small_config


def rounds(exp, n):
    return list(exp.simulation.iterate(exp.initial_state, n))


def same_model(a, b, sim) -> None:
    ma, mb = sim.algorithm.model_state(a), sim.algorithm.model_state(b)
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k


def test_single_phase_dropout_is_exactly_weight_zero():
    """ShroFBO has one phase: a client that always drops is a client of weight 0.

    Bitwise, and exact on every kernel: coverage_weighted_mean accumulates the clients one
    after another in float64, and a weight-0 client adds exact zeros there."""
    cfg = small_config(algorithm={"name": "shrofbo"}, fleet={"capacities": [1.0, 0.5]})
    dropping = build(cfg)
    dropping.simulation.dropout = [1.0 if c == 2 else 0.0 for c in range(10)]
    reference = build(cfg)
    reference.simulation.weights = [0.0 if c == 2 else 1.0 for c in range(10)]

    got, want = rounds(dropping, 3), rounds(reference, 3)
    for (state, record), (ref_state, _) in zip(got, want, strict=True):
        same_model(state, ref_state, dropping.simulation)
        hit = 2 in record.clients
        assert record.dropped == ({"train": [2]} if hit else {})
        assert record.metrics["dropped_clients"] == int(hit)
        for entry in record.ledger:
            if entry.client == 2:
                assert entry.bytes_up == 0 and entry.bytes_down > 0 and entry.flops > 0
            else:
                assert entry.bytes_up > 0


def test_two_phase_dropout_leaves_the_later_phases():
    cfg = small_config(fleet={"capacities": [1.0, 0.5]})
    exp = build(cfg)
    exp.simulation.dropout = [1.0 if c in (1, 4) else 0.0 for c in range(10)]
    phases = [p.name for p in exp.simulation.algorithm.phases()]
    seen_phases = set()
    for _, record in rounds(exp, 4):
        drops = exp.simulation.dropouts(record.round, record.clients, len(phases))
        assert set(drops) == {c for c in (1, 4) if c in record.clients}
        assert record.dropped == {
            phases[p]: sorted(c for c, q in drops.items() if q == p) for p in set(drops.values())
        }
        for c, p in drops.items():
            seen_phases.add(p)
            entries = [e for e in record.ledger if e.client == c]
            # present up to and including its drop phase, with no upload in that phase
            assert [e.phase for e in entries] == phases[: p + 1]
            assert entries[-1].bytes_up == 0
        others = {e.client for e in record.ledger if e.phase == phases[-1]}
        assert others == set(record.clients) - {c for c, p in drops.items() if p < len(phases) - 1}
    assert seen_phases == {0, 1}  # both phases occur over these rounds


def test_no_dropout_list_equals_zeros_and_draws_are_reproducible():
    cfg = small_config(fleet={"capacities": [1.0, 0.5]})
    a, b = build(cfg), build(cfg)
    b.simulation.dropout = [0.0] * 10
    for (sa, ra), (sb, rb) in zip(rounds(a, 2), rounds(b, 2), strict=True):
        same_model(sa, sb, a.simulation)
        assert ra.dropped == rb.dropped == {}

    # Two runs draw the same dropouts ...
    c, d = build(cfg), build(cfg)
    c.simulation.dropout = d.simulation.dropout = [0.3] * 10
    got = [r.dropped for _, r in rounds(c, 2)]
    assert got == [r.dropped for _, r in rounds(d, 2)]
    assert any(got)
    # ... which come from the round's own random stream, independent of the training: over
    # 100 rounds x 10 clients each drops with probability 0.3 (binomial mean 300, sd 14.5)
    phases = len(c.simulation.algorithm.phases())
    draws = [c.simulation.dropouts(q, range(10), phases) for q in range(100)]
    assert draws == [d.simulation.dropouts(q, range(10), phases) for q in range(100)]
    assert draws[:3] != [c.simulation.dropouts(q, range(10), phases) for q in range(1, 4)]
    total = sum(len(drops) for drops in draws)
    assert 200 < total < 400
    assert {p for drops in draws for p in drops.values()} == set(range(phases))


@pytest.mark.parametrize(
    ("dropout", "message"),
    [
        ([0.1] * 3, "got 10 clients but 3 dropout probabilities"),
        ([1.5] * 10, r"in \[0, 1\], got 1.5"),
    ],
)
def test_bad_dropout_is_refused(dropout, message):
    exp = build(small_config())
    sim = exp.simulation
    with pytest.raises(ValueError, match=message):
        type(sim)(
            algorithm=sim.algorithm,
            runtime=sim.runtime,
            clients=sim.clients,
            budgets=sim.budgets,
            shapes=sim.shapes,
            dropout=dropout,
        )
