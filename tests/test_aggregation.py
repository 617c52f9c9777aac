"""Parameter-wise coverage-weighted aggregation (RABO eqs. (6), (8))."""

import torch

from radbo.aggregation import apply_mean, apply_step, coverage_stats, coverage_weighted_mean

SHAPE = {"w": torch.Size([2, 3])}


def _three_clients():
    updates = [
        {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])},  # rows {0,1} x cols {0,1}
        {"w": torch.tensor([[10.0, 20.0]])},  # row {0} x cols {1,2}
        {"w": torch.tensor([[5.0, 7.0]])},  # row {1} x cols {0,1}
    ]
    index_sets = [
        {"w": (None, torch.tensor([0, 1]))},
        {"w": (torch.tensor([0]), torch.tensor([1, 2]))},
        {"w": (torch.tensor([1]), torch.tensor([0, 1]))},
    ]
    return updates, index_sets


def test_hand_computed_three_clients_uniform_weights():
    updates, index_sets = _three_clients()

    agg = coverage_weighted_mean(updates, index_sets, SHAPE)

    expected_mean = torch.tensor([[1.0, 6.0, 20.0], [4.0, 5.5, 0.0]])
    assert torch.equal(agg.mean["w"], expected_mean)
    assert agg.count["w"].tolist() == [[1, 2, 1], [2, 2, 0]]


def test_hand_computed_three_clients_weighted_and_uncovered_unchanged():
    updates, index_sets = _three_clients()
    params = {"w": torch.full((2, 3), 100.0)}

    agg = coverage_weighted_mean(updates, index_sets, SHAPE, weights=[1.0, 1.0, 2.0])
    new = apply_step(params, agg, lr=0.5)

    # (1,0): (3 + 2*5)/3 ; (1,1): (4 + 2*7)/3 ; (1,2): nobody holds it
    expected_mean = torch.tensor([[1.0, 6.0, 20.0], [13.0 / 3.0, 6.0, 0.0]])
    assert torch.allclose(agg.mean["w"], expected_mean)
    assert agg.weight["w"].tolist() == [[1.0, 2.0, 1.0], [3.0, 3.0, 0.0]]
    assert torch.allclose(
        new["w"],
        100.0
        - 0.5
        * expected_mean.masked_fill(
            torch.tensor([[False, False, False], [False, False, True]]), 0.0
        ),
    )
    assert new["w"][1, 2] == 100.0


def test_full_masks_reduce_to_plain_average():
    gen = torch.Generator().manual_seed(0)
    updates = [{"w": torch.randn(2, 3, generator=gen)} for _ in range(4)]
    index_sets = [{"w": (None, None)} for _ in range(4)]

    agg = coverage_weighted_mean(updates, index_sets, SHAPE)

    plain = torch.stack([u["w"] for u in updates]).mean(0)
    assert torch.allclose(agg.mean["w"], plain, atol=1e-7)
    assert (agg.count["w"] == 4).all()


def test_apply_mean_replaces_only_covered_coordinates():
    updates, index_sets = _three_clients()
    agg = coverage_weighted_mean(updates, index_sets, SHAPE)

    out = apply_mean({"w": torch.full((2, 3), -1.0)}, agg)

    assert out["w"].tolist() == [[1.0, 6.0, 20.0], [4.0, 5.5, -1.0]]


def test_coverage_stats_min_over_trained_coordinates():
    updates, index_sets = _three_clients()
    agg = coverage_weighted_mean(updates, index_sets, SHAPE)

    stats = coverage_stats(agg.count, ["w"])

    assert stats.min_coverage == 1
    assert stats.untrained_fraction == 1 / 6
    assert stats.histogram == [1, 2, 3]


def test_shape_mismatch_is_rejected():
    updates = [{"w": torch.zeros(2, 2)}]
    index_sets = [{"w": (None, None)}]
    try:
        coverage_weighted_mean(updates, index_sets, SHAPE)
    except ValueError as err:
        assert "shape" in str(err)
    else:  # pragma: no cover
        raise AssertionError("expected a ValueError")
