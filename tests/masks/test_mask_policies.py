"""Tests of the rolling, random and coverage mask policies and of the coverage report.

Hand cases (FedRolex windows, tracker counts), a reference cross-check (factorised holder counts
== ``coverage_weighted_mean(...).count``), RABO's C_x^* experiment (Fig. 3: capacity 1/4,
C_x^* in {1, 2}) on the MLP and ResNet-18, and one conformance battery for every registered policy.
"""

from __future__ import annotations

import doctest
import json
import math
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import radbo.masks.coverage_report
import radbo.masks.policies.coverage
import radbo.masks.policies.random
import radbo.masks.policies.rolling
from radbo.aggregation import coverage_weighted_mean
from radbo.masks.coverage_report import CoverageTracker
from radbo.masks.index import extract
from radbo.masks.policies import POLICIES as REGISTERED
from radbo.masks.policies import (
    CoveragePolicy,
    FiarsePolicy,
    ImportancePolicy,
    LeadingPolicy,
    MaskPolicy,
    OAPPolicy,
    RandomPolicy,
    RollingPolicy,
    RoundPreparedPolicy,
)
from radbo.masks.structure import StructurePlan, kept_count
from radbo.models import MLP, BilevelModel, ResNet18
from radbo.typing import IndexSet, Params
from tests.helpers import OpLog

MODELS: dict[str, Callable[[], BilevelModel]] = {
    "mlp8": lambda: MLP(8, [8], 3),
    "mlp64": lambda: MLP(64, [128], 10),
    "mlp784": lambda: MLP(784, [200], 10),
    "resnet18": lambda: ResNet18(),
    # Same coupling structure as ResNet-18 (stages 8/16/32/64 wide): cheap to aggregate.
    "resnet18_narrow": lambda: ResNet18(widths=(8, 16, 32, 64)),
}
_PLANS: dict[str, tuple[BilevelModel, StructurePlan]] = {}


def _plan(name: str) -> tuple[BilevelModel, StructurePlan]:
    """A plan per model, built once for the module (read-only use)."""
    if name not in _PLANS:
        torch.manual_seed(0)  # test-side only: the library never seeds globally
        model = MODELS[name]()
        _PLANS[name] = (model, StructurePlan(model, model.example_input(1), model.output_layers))
    return _PLANS[name]


def _x_shapes(model: BilevelModel) -> dict[str, torch.Size]:
    """Shapes of the outer variables x: every state tensor except the classifier ``head.*``."""
    return {k: v.shape for k, v in model.state_dict().items() if not k.startswith("head.")}


def _coverage_kept(
    policy: CoveragePolicy,
    plan: StructurePlan,
    ratios: Sequence[dict[str, float]],
    round: int,
) -> list[dict[str, Tensor]]:
    """Prepare the round for clients 0..n-1 and return their kept channels."""
    clients = list(range(len(ratios)))
    policy.prepare(clients, ratios)
    return [
        policy(plan, ratios[c], round=round, client=c, generator=torch.Generator()) for c in clients
    ]


def _coverage_round(
    policy: CoveragePolicy,
    plan: StructurePlan,
    ratios: Sequence[dict[str, float]],
    round: int,
) -> list[IndexSet]:
    """Prepare the round for clients 0..n-1 and return their index sets."""
    return [plan.index_sets(kept) for kept in _coverage_kept(policy, plan, ratios, round)]


def _aggregated_counts(
    model: BilevelModel, index_sets: Sequence[IndexSet], shapes: dict[str, torch.Size]
) -> Params:
    """Holder counts from the server's own aggregation of zero updates."""
    state = {k: v for k, v in model.state_dict().items() if k in shapes}
    updates = [
        {k: torch.zeros_like(v) for k, v in extract(state, idx).items()} for idx in index_sets
    ]
    return coverage_weighted_mean(updates, index_sets, shapes).count


def _factorised_counts(
    index_sets: Sequence[IndexSet], shapes: dict[str, torch.Size]
) -> dict[str, Tensor]:
    """Holder counts as sums of per-dimension indicators (exact when <= 2 dims are pruned).

    A client holds the Cartesian product of its per-dimension index sets, so the count of a
    tensor pruned along dims a < b is ``V_a^T V_b`` (V_d: clients x size indicators), broadcast
    along the other dims. Much cheaper than aggregating full-size ResNet-18 updates.
    """
    n = len(index_sets)
    out: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        indicators: dict[int, Tensor] = {}
        for d, size in enumerate(shape):
            entries = [idx[name][d] for idx in index_sets]
            if all(e is None for e in entries):
                continue
            v = torch.zeros(n, size, dtype=torch.float64)
            for c, e in enumerate(entries):
                if e is None:
                    v[c] = 1.0
                else:
                    v[c, e] = 1.0
            indicators[d] = v
        dims = sorted(indicators)
        if not dims:
            count = torch.full((), n, dtype=torch.float64)
        elif len(dims) == 1:
            count = indicators[dims[0]].sum(0)
        elif len(dims) == 2:
            count = indicators[dims[0]].T @ indicators[dims[1]]
        else:
            raise NotImplementedError(f"{name}: more than two pruned dimensions")
        view = [shape[d] if d in indicators else 1 for d in range(len(shape))]
        out[name] = count.round().to(torch.int64).reshape(view).expand(shape)
    return out


# ---------------------------------------------------------------- rolling (FedRolex)
@pytest.mark.parametrize(
    ("round", "stride", "expected"),
    [(0, 1, [0, 1, 2]), (6, 1, [0, 6, 7]), (7, 1, [0, 1, 7]), (9, 1, [1, 2, 3]), (3, 2, [0, 6, 7])],
)
def test_rolling_window_hand_cases(round: int, stride: int, expected: list[int]) -> None:
    # Arrange: one group of C = 8 channels, k = 3
    _, plan = _plan("mlp8")
    assert plan.groups == {"body.0": 8}

    # Act
    kept = RollingPolicy(stride)(
        plan, {"body.0": 3 / 8}, round=round, client=5, generator=torch.Generator()
    )

    # Assert: window {(start + j) % 8 : j < 3}, start = round * stride % 8, returned sorted
    assert kept["body.0"].tolist() == expected
    assert kept["body.0"].dtype == torch.long


@pytest.mark.parametrize(("stride", "ratio"), [(1, 1 / 128), (3, 1 / 32), (16, 1 / 8), (5, 0.5)])
def test_rolling_covers_every_channel_within_ceil_c_over_stride_rounds(
    stride: int, ratio: float
) -> None:
    # Arrange: C = 128 and k >= stride
    _, plan = _plan("mlp64")
    policy = RollingPolicy(stride)
    channels = plan.groups["body.0"]
    rounds = math.ceil(channels / stride)

    # Act
    windows = [
        policy(plan, {"body.0": ratio}, round=q, client=0, generator=torch.Generator())["body.0"]
        for q in range(rounds)
    ]

    # Assert
    assert torch.equal(torch.unique(torch.cat(windows)), torch.arange(channels))
    if kept_count(channels, ratio) == stride:  # the window tiles the ring: one round fewer misses
        assert torch.unique(torch.cat(windows[:-1])).numel() == channels - stride


def test_rolling_windows_of_one_round_are_nested_across_capacities() -> None:
    _, plan = _plan("mlp64")
    policy = RollingPolicy()
    small = policy(plan, {"body.0": 0.25}, round=100, client=0, generator=torch.Generator())
    large = policy(plan, {"body.0": 0.5}, round=100, client=1, generator=torch.Generator())
    assert set(small["body.0"].tolist()) <= set(large["body.0"].tolist())


@pytest.mark.parametrize("stride", [0, -1, 1.5, True])
def test_rolling_rejects_a_bad_stride(stride: object) -> None:
    with pytest.raises(ValueError, match="stride must be a positive integer"):
        RollingPolicy(stride)  # type: ignore[arg-type]


# ---------------------------------------------------------------- random
def test_random_policy_is_reproducible_from_the_generator_seed() -> None:
    # Arrange
    _, plan = _plan("resnet18")
    ratios = {g: 0.25 for g in plan.groups}
    policy = RandomPolicy()

    def draw(seed: int, mapping: dict[str, float]) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return policy(plan, mapping, round=0, client=0, generator=gen)

    # Act
    a, b, other = draw(7, ratios), draw(7, ratios), draw(8, ratios)
    reversed_order = draw(7, dict(reversed(list(ratios.items()))))

    # Assert
    for group, channels in plan.groups.items():
        assert torch.equal(a[group], b[group])
        assert torch.equal(a[group], reversed_order[group])  # groups drawn in plan order
        assert a[group].numel() == kept_count(channels, 0.25)
        assert torch.equal(a[group], torch.unique(a[group]))  # distinct and sorted
    assert any(not torch.equal(a[g], other[g]) for g in plan.groups)


def test_random_policy_is_uniform_over_channels() -> None:
    # Arrange: C = 8, k = 2, 4000 draws -> each channel expected 1000 times
    _, plan = _plan("mlp8")
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(8)

    # Act
    for _ in range(4000):
        kept = RandomPolicy()(plan, {"body.0": 0.25}, round=0, client=0, generator=gen)
        counts[kept["body.0"]] += 1

    # Assert: binomial sd = sqrt(4000 * 0.25 * 0.75) ~ 27; allow 5 sd
    assert counts.sum() == 8000
    assert (counts - 1000).abs().max() < 5 * 27.4


# ---------------------------------------------------------------- coverage
def test_coverage_k2_on_mlp_trains_all_of_x_with_exactly_two_clients_each_round() -> None:
    # Arrange: RABO Fig. 3 -- 8 clients at capacity 1/4, C_x* = 2
    model, plan = _plan("mlp784")
    shapes = _x_shapes(model)
    assert set(shapes) == {"body.0.weight", "body.0.bias"}
    ratios = [{g: 0.25 for g in plan.groups}] * 8
    policy = CoveragePolicy(k=2, num_clients=8)
    tracker = CoverageTracker(shapes)

    for q in range(5):
        # Act
        index_sets = _coverage_round(policy, plan, ratios, q)
        count = _aggregated_counts(model, index_sets, shapes)
        report = tracker.update(count)

        # Assert
        assert report.min_coverage == 2
        assert report.untrained_fraction == 0.0
        assert report.histogram == [0, 0, 200 * 785]
        kept = [idx["body.0.bias"][0] for idx in index_sets]
        for team in range(4):  # clients t and t + 4 replicate each other's segment
            assert torch.equal(kept[team], kept[team + 4])
        assert torch.equal(torch.sort(torch.cat(kept[:4])).values, torch.arange(200))
    assert tracker.as_dict()["min_coverage"] == 2


def test_coverage_k1_on_mlp_tiles_x_with_four_clients() -> None:
    # Arrange: 4 clients at 1/4, C_x* = 1
    model, plan = _plan("mlp784")
    shapes = _x_shapes(model)
    ratios = [{g: 0.25 for g in plan.groups}] * 4
    policy = CoveragePolicy(k=1, num_clients=4)

    for q in range(5):
        # Act
        count = _aggregated_counts(model, _coverage_round(policy, plan, ratios, q), shapes)
        report = CoverageTracker(shapes).update(count)

        # Assert
        assert report.min_coverage == 1
        assert report.untrained_fraction == 0.0


def test_factorised_counts_equal_the_aggregated_counts() -> None:
    # Reference cross-check of the cheap counter used on full-width ResNet-18 below.
    for name in ("mlp64", "resnet18_narrow"):
        model, plan = _plan(name)
        shapes = _x_shapes(model)
        gen = torch.Generator().manual_seed(1)
        ratios = [{g: r for g in plan.groups} for r in (1.0, 0.5, 0.5, 0.25, 0.25, 0.125)]
        index_sets = [
            plan.index_sets(RandomPolicy()(plan, rs, round=0, client=c, generator=gen))
            for c, rs in enumerate(ratios)
        ]
        index_sets += _coverage_round(CoveragePolicy(2, 4), plan, ratios[1:5], 3)
        expected = _aggregated_counts(model, index_sets, shapes)
        got = _factorised_counts(index_sets, shapes)
        for key in shapes:
            assert torch.equal(got[key], expected[key]), (name, key)


def test_coverage_k2_on_resnet18_holds_every_trained_coordinate_twice() -> None:
    # Arrange
    model, plan = _plan("resnet18")
    shapes = _x_shapes(model)
    ratios = [{g: 0.25 for g in plan.groups}] * 8
    policy = CoveragePolicy(k=2, num_clients=8)
    tracker = CoverageTracker(shapes)

    # Act
    reports = []
    for q in range(5):
        index_sets = _coverage_round(policy, plan, ratios, q)
        if q == 0:  # the server's aggregation agrees with the factorised counts
            count = _aggregated_counts(model, index_sets, shapes)
            assert all(
                torch.equal(count[k], c) for k, c in _factorised_counts(index_sets, shapes).items()
            )
        else:
            count = _factorised_counts(index_sets, shapes)
        reports.append(tracker.update(count))

    # Assert: C_x* = 2 each round; only the block diagonal of hidden convs is trained in a round
    # (a client's in-channels are its previous group's out-channels), the rest over rounds.
    assert [r.min_coverage for r in reports] == [2] * 5
    for r in reports:
        assert set(r.histogram[1:]) <= {0, r.histogram[2], r.histogram[8]}  # counts 0, 2, 8 only
        assert r.histogram[1] == 0
        assert 0.70 < r.untrained_fraction < 0.76
    never = [r.never_trained_fraction for r in reports]
    assert never[0] == reports[0].untrained_fraction
    assert all(b < a for a, b in zip(never, never[1:], strict=False))
    assert never[-1] < 0.4


def test_coverage_union_rotates_so_every_channel_is_trained() -> None:
    # Arrange: 2 clients at 1/4 with k = 2 hold one segment of 32 of the 128 channels
    _, plan = _plan("mlp64")
    ratios = [{"body.0": 0.25}] * 2
    policy = CoveragePolicy(k=2, num_clients=2)

    # Act
    segments = []
    for q in range(4):
        policy.prepare([0, 1], ratios)
        a = policy(plan, ratios[0], round=q, client=0, generator=torch.Generator())
        b = policy(plan, ratios[1], round=q, client=1, generator=torch.Generator())
        assert torch.equal(a["body.0"], b["body.0"])
        segments.append(a["body.0"])

    # Assert: consecutive rounds continue where the last ended: ceil(128 / 32) = 4 rounds
    assert torch.equal(torch.sort(torch.cat(segments)).values, torch.arange(128))


def test_coverage_rings_are_staggered_so_cross_layer_weights_get_trained() -> None:
    # Arrange: RABO Fig. 3's odd case -- 5 clients at 1/4 with k = 2 form 2 teams, so a round
    # trains half of each layer's channels. With one ring start shared by all layers, the
    # hidden-to-hidden weights joining one layer's first half to the next layer's second half
    # were never trained (32 % of x here after 40 rounds); staggered starts reach them.
    model = MLP(16, [32, 32], 4)
    plan = StructurePlan(model, model.example_input(), model.output_layers)
    shapes = _x_shapes(model)
    ratios = [{g: 0.25 for g in plan.groups}] * 5
    policy = CoveragePolicy(k=2, num_clients=5)
    tracker = CoverageTracker(shapes)

    # Act
    reports = [
        tracker.update(_factorised_counts(_coverage_round(policy, plan, ratios, q), shapes))
        for q in range(40)
    ]

    # Assert: every round still holds every trained coordinate twice; within one sweep
    # (ceil(32 / 16) = 2 rounds) every channel of every group is trained; over 40 rounds all
    # but a sliver of x is (the layout is integer arithmetic on string-seeded draws: exact).
    assert all(r.min_coverage == 2 for r in reports)
    for q in (0, 2, 4):
        policy.prepare(range(5), ratios)
        union = [
            torch.cat([policy.layout(plan, r)[c][g] for r in (q, q + 1) for c in range(5)])
            for g in plan.groups
        ]
        assert all(torch.equal(torch.unique(u), torch.arange(32)) for u in union)
    assert reports[-1].never_trained_fraction < 0.01


@settings(max_examples=25, deadline=None)
@given(
    capacities=st.lists(st.sampled_from([1.0, 0.5, 0.25, 0.125]), min_size=1, max_size=9),
    k=st.integers(1, 3),
    round=st.integers(0, 50),
)
def test_coverage_with_mixed_capacities_reaches_k_or_refuses(
    capacities: list[float], k: int, round: int
) -> None:
    # Arrange
    model, plan = _plan("resnet18_narrow")
    shapes = _x_shapes(model)
    ratios = [{g: r for g in plan.groups} for r in capacities]
    policy = CoveragePolicy(k=k, num_clients=max(k, len(capacities)))
    largest = max(capacities)
    feasible = capacities.count(largest) >= k  # smaller capacities can nest in larger teams

    # Act / Assert
    if not feasible:
        with pytest.raises(ValueError, match=f"coverage k = {k} needs at least {k} clients"):
            policy.prepare(list(range(len(capacities))), ratios)
        return
    kept = _coverage_kept(policy, plan, ratios, round)
    index_sets = [plan.index_sets(sel) for sel in kept]
    report = CoverageTracker(shapes).update(_factorised_counts(index_sets, shapes))
    assert report.min_coverage >= k
    for c, sel in enumerate(kept):  # every client keeps exactly its capacity
        for group, channels in plan.groups.items():
            assert sel[group].numel() == kept_count(channels, capacities[c])


@pytest.mark.parametrize(
    ("k", "clients", "match"),
    [
        (3, 2, "coverage k = 3 needs at least 3 clients .* this round has 2 clients"),
        (5, 4, "coverage k = 5 needs at least 5 clients .* this round has 4 clients"),
    ],
)
def test_coverage_refuses_unreachable_k_up_front(k: int, clients: int, match: str) -> None:
    _, plan = _plan("mlp784")
    ratios = [{g: 0.25 for g in plan.groups}] * clients
    policy = CoveragePolicy(k=k, num_clients=8)
    with pytest.raises(ValueError, match=match):
        policy.prepare(list(range(clients)), ratios)
    with pytest.raises(ValueError, match=f"coverage k = {k} .* num_clients = {clients}"):
        CoveragePolicy(k=k, num_clients=clients)


def test_coverage_refuses_a_capacity_held_by_fewer_than_k_clients() -> None:
    _, plan = _plan("mlp784")
    ratios = [{"body.0": 0.5}] + [{"body.0": 0.25}] * 3
    with pytest.raises(ValueError, match=r"only 1 client\(s\) \[0\] have ratio 0.5"):
        CoveragePolicy(k=2, num_clients=4).prepare([0, 1, 2, 3], ratios)


def test_coverage_nests_a_lone_smaller_client_in_a_larger_team() -> None:
    # Arrange: clients 0, 1 at 1/2 (one team), client 2 alone at 1/4
    _, plan = _plan("mlp784")
    ratios = [{"body.0": 0.5}, {"body.0": 0.5}, {"body.0": 0.25}]
    policy = CoveragePolicy(k=2, num_clients=3)
    policy.prepare([0, 1, 2], ratios)

    # Act
    kept = [
        policy(plan, ratios[c], round=4, client=c, generator=torch.Generator())["body.0"]
        for c in range(3)
    ]

    # Assert
    assert torch.equal(kept[0], kept[1]) and kept[0].numel() == 100
    assert kept[2].numel() == 50 and set(kept[2].tolist()) <= set(kept[0].tolist())


def test_coverage_requires_prepare_and_matching_ratios() -> None:
    _, plan = _plan("mlp784")
    policy = CoveragePolicy(k=2, num_clients=2)
    gen = torch.Generator()
    with pytest.raises(ValueError, match="client 0 was not prepared"):
        policy(plan, {"body.0": 0.5}, round=0, client=0, generator=gen)
    policy.prepare([0, 1], [{"body.0": 0.5}, {"body.0": 0.5}])
    with pytest.raises(ValueError, match=r"client 9 was not prepared .*prepared: \[0, 1\]"):
        policy(plan, {"body.0": 0.5}, round=0, client=9, generator=gen)
    with pytest.raises(ValueError, match="client 1 was prepared with ratios"):
        policy(plan, {"body.0": 0.25}, round=0, client=1, generator=gen)
    with pytest.raises(ValueError, match="2 clients but 1 ratio mappings"):
        policy.prepare([0, 1], [{"body.0": 0.5}])
    with pytest.raises(ValueError, match="repeated clients"):
        policy.prepare([0, 0], [{"body.0": 0.5}] * 2)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        policy.prepare([0, 1], [{"body.0": 0.0}] * 2)
    with pytest.raises(ValueError, match="positive integer"):
        CoveragePolicy(k=0, num_clients=2)


def test_coverage_layout_depends_only_on_round_and_capacities() -> None:
    _, plan = _plan("resnet18")
    ratios = [{g: 0.25 for g in plan.groups}] * 8
    first, second = CoveragePolicy(2, 8), CoveragePolicy(2, 8)
    first.prepare(range(8), ratios)
    second.prepare(list(reversed(range(8))), list(reversed(ratios)))
    a, b = first.layout(plan, 3), second.layout(plan, 3)
    assert all(torch.equal(a[c][g], b[c][g]) for c in range(8) for g in plan.groups)
    assert any(not torch.equal(a[0][g], first.layout(plan, 4)[0][g]) for g in plan.groups)


# ---------------------------------------------------------------- conformance battery
POLICIES: dict[str, Callable[[], MaskPolicy]] = {
    "leading": LeadingPolicy,
    "importance": ImportancePolicy,
    "rolling": lambda: RollingPolicy(stride=3),
    "random": RandomPolicy,
    "coverage": lambda: CoveragePolicy(k=2, num_clients=2),
    "fiarse": FiarsePolicy,
    "oap": OAPPolicy,
}
#: Policies with one model-wide threshold: groups keep different fractions, within the
#: connections of the uniform-width submodel (each group at kept_count(C, r)).
POOLED = {"fiarse"}


def test_the_battery_covers_every_registered_policy() -> None:
    assert set(POLICIES) == set(REGISTERED)


@pytest.mark.parametrize("model_name", ["mlp64", "resnet18"])
@pytest.mark.parametrize("ratio", [1.0, 0.5, 0.25, 0.125])
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_policy_conformance(policy_name: str, ratio: float, model_name: str) -> None:
    # Arrange
    _, plan = _plan(model_name)
    ratios = {g: ratio for g in plan.groups}

    def select() -> dict[str, Tensor]:
        policy = POLICIES[policy_name]()
        if isinstance(policy, RoundPreparedPolicy):
            policy.prepare([0, 1], [ratios, ratios])
        gen = torch.Generator().manual_seed(11)
        return policy(plan, ratios, round=5, client=1, generator=gen)

    # Act
    a, b = select(), select()

    # Assert
    assert isinstance(POLICIES[policy_name](), MaskPolicy)
    assert set(a) == set(plan.groups)
    uniform = {g: torch.arange(kept_count(channels, ratio)) for g, channels in plan.groups.items()}
    assert plan.connections_kept(a) <= plan.connections_kept(uniform)
    for group, channels in plan.groups.items():
        kept = a[group]
        assert kept.dtype == torch.long
        assert torch.equal(kept, b[group])  # deterministic under the same inputs
        if policy_name not in POOLED:
            assert kept.numel() == kept_count(channels, ratio)
        assert torch.equal(kept, torch.unique(kept))  # sorted, distinct
        assert 0 <= int(kept.min()) and int(kept.max()) < channels
        if ratio == 1.0:
            assert torch.equal(kept, torch.arange(channels))
    plan.index_sets(a)  # a structurally valid selection


def test_only_the_coverage_policy_needs_prepare() -> None:
    assert isinstance(CoveragePolicy(1, 1), RoundPreparedPolicy)
    others = (LeadingPolicy, ImportancePolicy, RollingPolicy, RandomPolicy, FiarsePolicy, OAPPolicy)
    for make in others:
        assert not isinstance(make(), RoundPreparedPolicy)


# ---------------------------------------------------------------- coverage report
def test_coverage_tracker_hand_counts_over_two_rounds() -> None:
    # Arrange: 6 coordinates in two tensors
    tracker = CoverageTracker(["a", "b"])
    round0 = {"a": torch.tensor([[2, 0], [1, 0]]), "b": torch.tensor([0, 3]), "y": torch.ones(2)}
    round1 = {"a": torch.tensor([[0, 2], [0, 0]]), "b": torch.tensor([2, 2])}

    # Act
    r0 = tracker.update(round0)
    r1 = tracker.update(round1)

    # Assert
    assert (r0.min_coverage, r0.histogram, r0.untrained_fraction) == (1, [3, 1, 1, 1], 0.5)
    assert r0.never_trained_fraction == 0.5  # a[0,1], a[1,1], b[0]
    assert (r1.min_coverage, r1.histogram, r1.untrained_fraction) == (2, [3, 0, 3], 0.5)
    assert r1.never_trained_fraction == pytest.approx(1 / 6)  # only a[1,1] never trained
    assert (r0.min_coverage_so_far, r1.min_coverage_so_far) == (1, 1)  # Definition 3: min over q
    assert (r0.round, r1.round, r1.numel) == (0, 1, 6)
    summary = json.loads(json.dumps(tracker.as_dict()))
    assert summary["min_coverage"] == 1
    assert summary["never_trained_fraction"] == pytest.approx(1 / 6)
    assert [r["histogram"] for r in summary["rounds"]] == [[3, 1, 1, 1], [3, 0, 3]]


def test_coverage_tracker_rejects_bad_counts() -> None:
    tracker = CoverageTracker(["a"])
    with pytest.raises(ValueError, match=r"no entry for tracked tensors \['a'\]"):
        tracker.update({"b": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match="integer tensor"):
        tracker.update({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="negative"):
        tracker.update({"a": torch.tensor([-1, 0])})
    tracker.update({"a": torch.tensor([1, 0])})
    with pytest.raises(ValueError, match=r"shape \(3,\), but earlier rounds had \(2,\)"):
        tracker.update({"a": torch.tensor([1, 0, 0])})
    with pytest.raises(ValueError, match="at least one tensor name"):
        CoverageTracker([])


@pytest.mark.parametrize(
    "module",
    [
        radbo.masks.policies.rolling,
        radbo.masks.policies.random,
        radbo.masks.policies.coverage,
        radbo.masks.coverage_report,
    ],
)
def test_docstring_examples(module: object) -> None:
    failures, _ = doctest.testmod(module)  # type: ignore[arg-type]
    assert failures == 0


def test_importance_selection_is_made_once_per_group_count_and_round() -> None:
    """The clients of a round that keep equally many channels of a group get the same
    selection, made once: a second client of that capacity dispatches no tensor operation; the
    selection equals top_channels of the round's scores; a new round selects afresh."""
    from radbo.masks.policies.importance import top_channels

    _, plan = _plan("mlp64")
    policy = ImportancePolicy()
    gen = torch.Generator().manual_seed(0)
    ratios = {group: 0.5 for group in plan.groups}
    first = policy(plan, ratios, round=3, client=0, generator=gen)
    scores = policy.scores(plan, 3)
    for group, kept in first.items():
        assert torch.equal(kept, top_channels(scores[group], kept.numel()))
    with OpLog() as log:
        second = policy(plan, ratios, round=3, client=1, generator=gen)
    assert log.names == []
    assert all(second[g] is first[g] for g in first)
    quarter = policy(plan, {g: 0.25 for g in plan.groups}, round=3, client=2, generator=gen)
    assert all(quarter[g].numel() < first[g].numel() for g in first)
    later = policy(plan, ratios, round=4, client=0, generator=gen)
    assert all(later[g] is not first[g] and torch.equal(later[g], first[g]) for g in first)
