"""x and y masked independently; index sets shared by clients with the same choice."""

import torch
from torch import nn

from radbo.client import ClientBudget
from radbo.masks import LeadingPolicy, StructurePlan
from radbo.masks.assigner import SubmodelAssigner
from radbo.models import BilevelModel


class TwoLayerHead(BilevelModel):
    """Backbone (x) 16 -> 32; head (y) 32 -> 24 -> 10: y has a prunable group of its own."""

    inner_modules = ("head",)
    output_layers = ("head.2",)
    input_shape = (16,)

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 10))

    def forward(self, x):
        return self.head(self.body(x))


def _assign(mask_x: bool, mask_y: bool, r: float = 0.5):
    model = TwoLayerHead()
    plan = StructurePlan(model, model.example_input(1), model.output_layers)
    assigner = SubmodelAssigner(plan, LeadingPolicy(), model.outer_param_names(), mask_x, mask_y)
    assigner.prepare(model.state_dict(), 0, [0], [ClientBudget(capacity=r)])
    return assigner.assign(ClientBudget(capacity=r), 0, 0, torch.Generator())


def test_mask_y_only_keeps_all_of_x_and_prunes_the_inner_group():
    idx = _assign(mask_x=False, mask_y=True)

    assert idx["body.0.weight"] == (None, None)
    assert idx["head.0.weight"][1] is None  # the head's input = x's output, kept whole
    assert idx["head.0.weight"][0].tolist() == list(range(12))  # y's own group at r = 1/2
    assert idx["head.2.weight"][1].tolist() == list(range(12))


def test_mask_x_only_prunes_x_and_its_coupled_head_columns_but_not_y_group():
    idx = _assign(mask_x=True, mask_y=False)

    assert idx["body.0.weight"][0].tolist() == list(range(16))
    assert idx["head.0.weight"][0] is None
    assert idx["head.0.weight"][1].tolist() == list(range(16))


def test_clients_with_the_same_choice_share_index_sets():
    model = TwoLayerHead()
    plan = StructurePlan(model, model.example_input(1), model.output_layers)
    assigner = SubmodelAssigner(plan, LeadingPolicy(), model.outer_param_names())
    budgets = [ClientBudget(capacity=0.5), ClientBudget(capacity=0.5), ClientBudget(capacity=1.0)]
    assigner.prepare(model.state_dict(), 0, [0, 1, 2], budgets)

    sets = [assigner.assign(b, c, 0, torch.Generator()) for c, b in enumerate(budgets)]

    assert sets[0] is sets[1]
    assert sets[2] is not sets[0]
