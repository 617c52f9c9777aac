"""Coverage is honest about aggregation weights (issue 15, item 7): a coordinate held only by
clients of weight 0 is never updated by the server, so it counts as uncovered in C^k, in
C_x* / C_y* and in ``untrained_fraction`` -- in the counts (``coverage_counts``), in the
server's mean (``coverage_weighted_mean``), in the round summaries (``CoverageTracker``) and in
the engine's per-round metrics. Runs without zero-weight clients report what they always did.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radbo.aggregation import apply_step, coverage_weighted_mean
from radbo.experiment import build
from radbo.masks.coverage_report import CoverageTracker, coverage_stats
from radbo.masks.index import coverage_counts, dense_mask
from tests.configs import small_config

SHAPES = {"x": torch.Size([4]), "y": torch.Size([2, 3])}
# three clients; client 2 has weight 0 and is the only one holding x[3], y[1, 1] and y[1, 2]
INDEX_SETS = [
    {"x": (torch.tensor([0, 1]),), "y": (None, torch.tensor([0]))},  # y: column 0
    {"x": (torch.tensor([1, 2]),), "y": (torch.tensor([0]), None)},  # y: row 0
    {"x": (torch.tensor([2, 3]),), "y": (None, None)},  # y: all of it
]
WEIGHTS = [1.0, 2.0, 0.0]


def test_counts_leave_zero_weight_clients_out() -> None:
    counts = coverage_counts(INDEX_SETS, SHAPES, WEIGHTS)

    assert counts["x"].tolist() == [1, 2, 1, 0]
    assert counts["y"].tolist() == [[2, 1, 1], [1, 0, 0]]
    # every client counts when they all have weight (or no weights are given)
    everyone = coverage_counts(INDEX_SETS, SHAPES)
    assert everyone["x"].tolist() == [1, 2, 2, 1]
    assert everyone["y"].tolist() == [[3, 2, 2], [2, 1, 1]]
    assert all(
        torch.equal(coverage_counts(INDEX_SETS, SHAPES, [1.0, 5.0, 0.5])[k], everyone[k])
        for k in SHAPES
    )


def test_coverage_stats_count_zero_weight_coordinates_as_untrained() -> None:
    counts = coverage_counts(INDEX_SETS, SHAPES, WEIGHTS)

    x, y = coverage_stats(counts, ["x"]), coverage_stats(counts, ["y"])

    assert (x.min_coverage, x.untrained_fraction, x.histogram) == (1, 1 / 4, [1, 2, 1])
    assert (y.min_coverage, y.untrained_fraction, y.histogram) == (1, 2 / 6, [2, 3, 1])
    everyone = coverage_counts(INDEX_SETS, SHAPES)
    assert coverage_stats(everyone, ["x"]).untrained_fraction == 0.0
    assert coverage_stats(everyone, ["y"]).min_coverage == 1


def test_server_mean_and_step_agree_with_the_counts() -> None:
    f64 = {"dtype": torch.float64}
    updates = [
        {"x": torch.tensor([1.0, 2.0], **f64), "y": torch.tensor([[1.0], [2.0]], **f64)},
        {"x": torch.tensor([4.0, 8.0], **f64), "y": torch.tensor([[3.0, 3.0, 3.0]], **f64)},
        {"x": torch.tensor([100.0, 100.0], **f64), "y": torch.full((2, 3), 100.0, **f64)},
    ]
    params = {"x": torch.zeros(4, **f64), "y": torch.zeros(2, 3, **f64)}

    agg = coverage_weighted_mean(updates, INDEX_SETS, SHAPES, WEIGHTS)
    new = apply_step(params, agg, lr=1.0)

    assert agg.count["x"].tolist() == [1, 2, 1, 0]
    assert agg.covered("x").tolist() == [True, True, True, False]
    # x[1]: (1·2 + 2·4) / 3; the weight-0 client's 100s enter nowhere. Exact in float64:
    # integer sums, then one correctly rounded division, as Python's 10.0 / 3.0
    assert agg.mean["x"].tolist() == [1.0, 10.0 / 3.0, 8.0, 0.0]
    assert new["x"].tolist() == [-1.0, -10.0 / 3.0, -8.0, 0.0]
    assert agg.covered("y").tolist() == [[True, True, True], [True, False, False]]
    assert new["y"].tolist() == [[-7.0 / 3.0, -3.0, -3.0], [-2.0, 0.0, 0.0]]


def test_tracker_never_counts_a_zero_weight_coordinate_as_trained() -> None:
    tracker = CoverageTracker(["x", "y"])
    counts = coverage_counts(INDEX_SETS, SHAPES, WEIGHTS)

    first = tracker.update(counts)
    second = tracker.update(counts)

    assert (first.min_coverage, first.untrained_fraction) == (1, 3 / 10)
    assert second.never_trained_fraction == 3 / 10  # x[3], y[1, 1], y[1, 2], both rounds
    assert second.min_coverage_so_far == 1


# ------------------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def experiment():
    """Two clients every round, leading masks: client 0 trains the whole model, client 1 the
    first half of each hidden layer (RABO on the demo task)."""
    return build(
        small_config(
            fleet={
                "num_clients": 2,
                "clients_per_round": 2,
                "capacities": [1.0, 0.5],
                "devices": None,
            },
            mask={"policy": "leading"},
            rounds=1,
            baseline={"enabled": False},
        )
    )


def _round(experiment, weights):
    simulation = dataclasses.replace(experiment.simulation, weights=weights)
    index_sets = simulation.round_index_sets(
        experiment.initial_state, 0, [0, 1], simulation.round_budgets(0, [0, 1])
    )
    state, record = simulation.step(experiment.initial_state, 0)
    return state, record.metrics, index_sets


def test_engine_reports_coordinates_of_zero_weight_clients_as_uncovered(experiment) -> None:
    init = experiment.initial_state
    state, metrics, index_sets = _round(experiment, [0.0, 1.0])

    shapes = {k: t.shape for k, t in {**init.x, **init.y}.items()}
    half = dense_mask(index_sets[1], shapes)  # what the weight-1 client holds
    for block, params, new in (("x", init.x, state.x), ("y", init.y, state.y)):
        held = torch.cat([half[k].reshape(-1) for k in params])
        untrained = int((~held).sum())
        assert metrics[f"untrained_fraction_{block}"] == untrained / held.numel()
        assert metrics[f"never_trained_fraction_{block}"] == untrained / held.numel()
        assert metrics[f"coverage_{block}_min"] == 1.0
        assert metrics[f"coverage_{block}_histogram"] == [untrained, held.numel() - untrained]
        # and indeed the server left those coordinates alone, bit for bit
        for k in params:
            outside = ~half[k]
            assert torch.equal(new[k][outside], params[k][outside])
            assert not torch.equal(new[k][half[k]], params[k][half[k]])
    # leading masks at r = 1/2 keep half of x's hidden units: 4160 of 8320 (and 650 of 1290 y)
    assert metrics["untrained_fraction_x"] == 0.5
    assert metrics["coverage_y_histogram"] == [640, 650]


def test_engine_coverage_without_zero_weights_is_unchanged(experiment) -> None:
    _, uniform, _ = _round(experiment, None)
    _, weighted, _ = _round(experiment, [1.0, 3.0])

    keys = [k for k in uniform if k.startswith(("coverage_", "untrained_", "never_trained_"))]
    assert keys and all(uniform[k] == weighted[k] for k in keys)
    assert uniform["untrained_fraction_x"] == 0.0 and uniform["coverage_x_min"] == 1.0
    assert uniform["coverage_x_histogram"] == [0, 4160, 4160]
    assert uniform["coverage_y_histogram"] == [0, 640, 650]
