"""FIARSE's and OAP's mask policies: hand-computed selections on a tiny MLP, and a run each.

The tiny model is ``MLP(2, [4, 4], 2)``: group ``body.0`` (4 channels) slices
``body.0.weight[c, :]``, ``body.0.bias[c]`` and ``body.2.weight[:, c]`` (7 connections per
channel); group ``body.2`` (4 channels) slices ``body.2.weight[c, :]``, ``body.2.bias[c]`` and
``head.weight[:, c]`` (7 as well). Every value below is dyadic, so the sums are exact.
"""

from __future__ import annotations

import doctest

import pytest
import torch

import radbo.masks.policies.fiarse
import radbo.masks.policies.oap
from radbo.experiment import run
from radbo.masks.policies import POLICIES, FiarsePolicy, OAPPolicy
from radbo.masks.structure import StructurePlan
from radbo.models import MLP
from tests.configs import small_config
from tests.untrained import untrained_metrics


def _tiny(head: list[list[float]], bias2: list[float]) -> StructurePlan:
    """The tiny MLP with ``body.2.weight`` all 0.5 (2 per channel of either group) and the
    given ``body.0`` rows; ``head`` and ``bias2`` set the second group's magnitudes."""
    model = MLP(2, [4, 4], 2).double()
    plan = StructurePlan(model, model.example_input().double(), model.output_layers)
    state = model.state_dict()
    state["body.0.weight"] = torch.tensor(
        [[3.0, -1.0], [0.5, -0.5], [-2.0, 3.0], [0.25, 0.25]], dtype=torch.float64
    )
    state["body.0.bias"] = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    state["body.2.weight"] = torch.full((4, 4), 0.5, dtype=torch.float64)
    state["body.2.bias"] = torch.tensor(bias2, dtype=torch.float64)
    state["head.weight"] = torch.tensor(head, dtype=torch.float64)
    plan.load_state(state)
    return plan


def _select(policy: object, plan: StructurePlan, ratios: dict[str, float], round: int = 0):
    kept = policy(plan, ratios, round=round, client=0, generator=torch.Generator())  # type: ignore[operator]
    return {group: k.tolist() for group, k in kept.items()}


# ---------------------------------------------------------------- FIARSE
def test_fiarse_channel_magnitudes_by_hand() -> None:
    # Arrange: sums of |w| over each channel's 7 connections
    #   body.0: c0 3+1+1+2 = 7, c1 .5+.5+0+2 = 3, c2 2+3+2+2 = 9, c3 .25+.25+0+2 = 2.5
    #   body.2: c0 0+4+4+2 = 10, c1 .5+.5+0+2 = 3, c2 .25+.25+.25+2 = 2.75, c3 0+0+.5+2 = 2.5
    plan = _tiny(head=[[4.0, 0.5, 0.25, 0.0], [-4.0, 0.0, 0.25, 0.5]], bias2=[0, 0.5, -0.25, 0])

    # Act
    magnitudes = plan.channel_magnitudes()

    # Assert
    assert magnitudes["body.0"].tolist() == [7 / 7, 3 / 7, 9 / 7, 2.5 / 7]
    assert magnitudes["body.2"].tolist() == [10 / 7, 3 / 7, 2.75 / 7, 2.5 / 7]


def test_fiarse_keeps_the_largest_channels_of_the_whole_model_at_capacity_one_half() -> None:
    # Arrange: with k0, k1 channels kept, the tiny MLP keeps
    #   3 k0 + k0 k1 + 3 k1 + 2 connections (body.0 2 k0 + k0, body.2 k0 k1 + k1, head 2 k1 + 2),
    # 18 at the uniform r = 1/2 (2, 2). Each group's best comes first (body.0 c2: 9, body.2 c0:
    # 10; 9 connections), then the model-wide order: body.0 c0 (7; 13), then body.0 c1 and
    # body.2 c1 tied at 3, the tie to the earlier group (body.0 c1; 17), then body.2 c1 (23 > 18:
    # stop). The threshold is 3/7: per-layer top-2 would have kept [0, 2] and [0, 1].
    plan = _tiny(head=[[4.0, 0.5, 0.25, 0.0], [-4.0, 0.0, 0.25, 0.5]], bias2=[0, 0.5, -0.25, 0])

    # Act
    half = _select(FiarsePolicy(), plan, {"body.0": 0.5, "body.2": 0.5})
    three_quarters = _select(FiarsePolicy(), plan, {"body.0": 0.75, "body.2": 0.75})
    quarter = _select(FiarsePolicy(), plan, {"body.0": 0.25, "body.2": 0.25})

    # Assert
    assert half == {"body.0": [0, 1, 2], "body.2": [0]}
    assert plan.connections_kept({"body.0": [0, 1, 2], "body.2": [0]}) == 17
    # (3, 3) keeps 29 = the uniform 3/4's 29; the next, body.0 c3, would make 35
    assert three_quarters == {"body.0": [0, 1, 2], "body.2": [0, 1, 2]}
    assert quarter == {"body.0": [2], "body.2": [0]}  # the uniform (1, 1): each group's best


def test_fiarse_budget_counts_connections_so_a_wide_layers_channel_costs_more() -> None:
    # Arrange: MLP(8, [4, 4], 2) keeps 9 k0 + k0 k1 + 3 k1 + 2 connections, 30 at r = 1/2. Every
    # body.0 channel slices 13 connections (8 + 1 + 4), every body.2 channel 7 (4 + 1 + 2).
    #   body.0 rows all 1, .25, .5, .125 (sums 8 a + 2 = 10, 4, 6, 3): means 10/13, 4/13, ...
    #   body.2 head columns 4, 3, 2, 1 (sums 2 + 2 h = 10, 8, 6, 4):  means 10/7, 8/7, 6/7, 4/7
    model = MLP(8, [4, 4], 2).double()
    plan = StructurePlan(model, model.example_input().double(), model.output_layers)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    state["body.0.weight"] = torch.tensor([1.0, 0.25, 0.5, 0.125]).double()[:, None].expand(4, 8)
    state["body.2.weight"] = torch.full((4, 4), 0.5, dtype=torch.float64)
    state["head.weight"] = torch.tensor([4.0, 3.0, 2.0, 1.0]).double()[None, :].expand(2, 4)
    plan.load_state(state)
    ratios = {"body.0": 0.5, "body.2": 0.5}

    # Act
    kept = _select(FiarsePolicy(), plan, ratios)
    state["head.weight"] = state["head.weight"] / 8  # body.2 now below body.0 but for its best
    plan.load_state(state)
    other = _select(FiarsePolicy(), plan, ratios)

    # Assert: best channels (1, 1) = 15, then body.2 c1, c2, c3: (1, 2) 19, (1, 3) 23, (1, 4) 27,
    # then body.0 c2 would make (2, 4) 40 > 30: five channels where the uniform keeps four
    assert kept == {"body.0": [0], "body.2": [0, 1, 2, 3]}
    # head / 8: body.2 means 3/7, 2.75/7, 2.5/7, 2.25/7; the order after the best channels is
    # body.0 c2 (6/13; (2, 1) 25), body.2 c1 (2.75/7; (2, 2) 30), body.2 c2 ((2, 3) 35 > 30)
    assert other == {"body.0": [0, 2], "body.2": [0, 1]}


def test_fiarse_keeps_each_groups_best_channel_even_below_the_threshold() -> None:
    # Arrange: body.2 has no head weights or bias: every channel sums to 2 (< 2.5, the smallest
    # of body.0). A plain threshold would keep body.0's channels and empty body.2.
    plan = _tiny(head=[[0.0] * 4, [0.0] * 4], bias2=[0, 0, 0, 0])

    # Act
    kept = _select(FiarsePolicy(), plan, {"body.0": 0.5, "body.2": 0.5})

    # Assert: body.2 keeps its (tied, so lowest) channel 0; body.0 c2, c0, c1 (17 connections;
    # c3 would make 21 > 18)
    assert kept == {"body.0": [0, 1, 2], "body.2": [0]}


def test_fiarse_keeps_a_group_at_ratio_one_whole_and_pools_the_rest() -> None:
    plan = _tiny(head=[[4.0, 0.5, 0.25, 0.0], [-4.0, 0.0, 0.25, 0.5]], bias2=[0, 0.5, -0.25, 0])

    # budget: (4, 2) keeps 28; body.2 c0, c1 -> 28, c2 would make 35
    kept = _select(FiarsePolicy(), plan, {"body.2": 0.5, "body.0": 1.0})

    assert kept == {"body.2": [0, 1], "body.0": [0, 1, 2, 3]}
    assert list(kept) == ["body.2", "body.0"]  # the order of ``ratios``


def test_fiarse_follows_the_global_model_round_by_round() -> None:
    # Arrange
    plan = _tiny(head=[[4.0, 0.5, 0.25, 0.0], [-4.0, 0.0, 0.25, 0.5]], bias2=[0, 0.5, -0.25, 0])
    policy = FiarsePolicy()
    ratios = {"body.0": 0.25, "body.2": 0.25}
    before = _select(policy, plan, ratios, round=3)
    state = plan.model.state_dict()
    state["head.weight"] = torch.tensor([[0.0, 0.0, 0.0, 8.0], [0.0, 0.0, 0.0, 8.0]]).double()

    # Act
    plan.load_state(state)
    same_round = _select(policy, plan, ratios, round=3)
    next_round = _select(policy, plan, ratios, round=4)

    # Assert: scored once per round (cached), then from the new global model
    assert before == same_round == {"body.0": [2], "body.2": [0]}
    assert next_round == {"body.0": [2], "body.2": [3]}


# ---------------------------------------------------------------- OAP
def test_oap_prunes_each_layer_by_its_own_filters_magnitude() -> None:
    # Arrange: body.0 filters (rows of body.0.weight) have mean |w| 2, 0.5, 2.5, 0.25; the
    # bias and the next layer do not count. body.2's rows have mean |w| 1, 1.5, 1, 0.5.
    plan = _tiny(head=[[4.0, 0.5, 0.25, 0.0], [-4.0, 0.0, 0.25, 0.5]], bias2=[0, 0.5, -0.25, 0])
    state = plan.model.state_dict()
    state["body.0.bias"] = torch.tensor([0.0, 100.0, 0.0, 0.0], dtype=torch.float64)
    state["body.2.weight"] = torch.tensor(
        [[1, -1, 1, 1], [0, 0, 0, 6], [2, -2, 0, 0], [0.5, 0.5, 0.5, 0.5]], dtype=torch.float64
    )
    plan.load_state(state)

    # Act
    half = _select(OAPPolicy(), plan, {"body.0": 0.5, "body.2": 0.5})
    quarter = _select(OAPPolicy(), plan, {"body.0": 0.25, "body.2": 0.75})

    # Assert: every layer keeps kept_count(4, r); the tie of rows 0 and 2 goes to row 0
    assert half == {"body.0": [0, 2], "body.2": [0, 1]}
    assert quarter == {"body.0": [2], "body.2": [0, 1, 2]}


def test_oap_masks_change_with_the_round_not_with_the_client() -> None:
    plan = _tiny(head=[[4.0, 0.5, 0.25, 0.0], [-4.0, 0.0, 0.25, 0.5]], bias2=[0, 0.5, -0.25, 0])
    policy = OAPPolicy()
    ratios = {"body.0": 0.25}
    first = policy(plan, ratios, round=0, client=0, generator=torch.Generator())
    other = policy(plan, ratios, round=0, client=7, generator=torch.Generator().manual_seed(3))
    state = plan.model.state_dict()
    state["body.0.weight"] = state["body.0.weight"].flip(0)
    plan.load_state(state)
    later = policy(plan, ratios, round=1, client=0, generator=torch.Generator())

    assert first["body.0"].tolist() == other["body.0"].tolist() == [2]
    assert later["body.0"].tolist() == [1]  # row 2 moved to row 1


# ---------------------------------------------------------------- registered, in a run
def test_both_policies_are_registered_under_their_toml_names() -> None:
    assert isinstance(POLICIES["fiarse"](None, 4), FiarsePolicy)
    assert isinstance(POLICIES["oap"](None, 4), OAPPolicy)


@pytest.mark.float_sensitive
@pytest.mark.parametrize("policy", ["fiarse", "oap"])
def test_fedavg_with_the_policy_learns_the_digits_demo(policy: str) -> None:
    """``[algorithm] name = "fedavg"`` with ``[mask] policy`` at r = 1/2, 5 rounds of 5 local
    steps. Measured (seed 0, digits): untrained accuracy 0.097 and loss 2.313; after 5 rounds
    fiarse 0.705 / 1.170, oap 0.702 / 1.185 (``leading``, HeteroFL, 0.713 / 1.215). Asserted:
    +0.4 accuracy and -0.5 loss."""
    cfg = small_config(
        rounds=5,
        algorithm={"name": "fedavg", "lr": 0.5, "local_steps": 5},
        mask={"policy": policy},
        fleet={"capacities": [0.5], "devices": None},
        baseline={"enabled": False},
    )
    untrained = untrained_metrics(cfg)

    result = run(cfg, progress=False, save=False)

    assert result.final["test_accuracy"] >= untrained["test_accuracy"] + 0.4
    assert result.final["test_loss"] <= untrained["test_loss"] - 0.5


@pytest.mark.parametrize("module", [radbo.masks.policies.fiarse, radbo.masks.policies.oap])
def test_docstring_examples(module: object) -> None:
    failures, _ = doctest.testmod(module)  # type: ignore[arg-type]
    assert failures == 0
