"""Tests of radbo.masks: structure plan, index sets, submodels, scatter, policies.

Invariants (SPEC "Masks"): sub == full[kept]; scatter(extract(full)) == full; full mask == dense
model; masked-full-model training == extracted-submodel training.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from radbo.masks import (
    ImportancePolicy,
    LeadingPolicy,
    MaskPolicy,
    StructurePlan,
    dense_mask,
    extract,
    index_set_numel,
    kept_count,
    restrict,
    scatter,
)
from radbo.models import MLP, BilevelModel, SmallCNN
from radbo.typing import IndexSet, Params
from tests.helpers import OpLog

MODELS: dict[str, Callable[[], BilevelModel]] = {
    "mlp_2hidden": lambda: MLP(64, [32, 16], 10),
    "mlp_wide": lambda: MLP(64, [128], 10),
    "cnn": lambda: SmallCNN(),
}
POLICIES: dict[str, Callable[[], MaskPolicy]] = {
    "leading": LeadingPolicy,
    "importance": ImportancePolicy,
}
RATIOS = [1.0, 0.5, 0.25]


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Fill every floating tensor (BN running stats too) with distinct random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                values = 0.5 * torch.randn(tensor.shape, generator=gen)
                if name.endswith("running_var"):
                    values = values.abs() + 0.5
                tensor.copy_(values)
    return model


def _setup(model_name: str, seed: int = 0) -> tuple[BilevelModel, StructurePlan]:
    model = _randomize(MODELS[model_name](), seed)
    plan = StructurePlan(model, model.example_input(1), model.output_layers)
    return model, plan


_PLANS: dict[str, tuple[BilevelModel, StructurePlan]] = {}


def _shared(model_name: str) -> tuple[BilevelModel, StructurePlan]:
    """A plan shared by read-only tests (building one traces the model)."""
    if model_name not in _PLANS:
        _PLANS[model_name] = _setup(model_name)
    return _PLANS[model_name]


def _index_set(
    plan: StructurePlan, policy_name: str, ratio: float, round: int = 0
) -> tuple[dict[str, Tensor], IndexSet]:
    policy = POLICIES[policy_name]()
    kept = policy(
        plan,
        {g: ratio for g in plan.groups},
        round=round,
        client=0,
        generator=torch.Generator().manual_seed(0),
    )
    return kept, plan.index_sets(kept)


def _fancy(tensor: Tensor, entry: tuple[Tensor | None, ...]) -> Tensor:
    """Cartesian-product indexing by broadcast advanced indices (independent of index_select)."""
    if tensor.ndim == 0:
        return tensor.clone()
    axes = []
    for dim, idx in enumerate(entry):
        axis = torch.arange(tensor.shape[dim]) if idx is None else idx
        shape = [1] * tensor.ndim
        shape[dim] = -1
        axes.append(axis.reshape(shape))
    return tensor[tuple(axes)]


def _input(model: BilevelModel, batch: int, seed: int) -> Tensor:
    return torch.randn(batch, *model.input_shape, generator=torch.Generator().manual_seed(seed))


CASES = [(m, p, r) for m in MODELS for p in POLICIES for r in RATIOS]

# Equivalence checks (submodel vs masked full model) run in float64: both sides sum the same
# nonzero terms, in different orders, so they agree up to rounding. Bound from the operation
# count: an inner product of n terms errs by at most n * eps * sum|terms|, eps = 2**-53 =
# 1.1e-16. Here n <= 32 * 3 * 3 = 288 (SmallCNN's second conv), at most 6 such layers are
# chained (forward and backward of 3), and the randomised weights (0.5 * N(0, 1)) keep every
# sum|terms| below ~100, so differences stay below 288 * 6 * 100 * 1.1e-16 = 2e-11.
# Measured (every test below, default / AVX2 / AVX-512 kernels): at most 1.8e-15 / 1.8e-15 /
# 1.8e-15, the residual-concat net's; the others 0 to 3e-17.
ATOL_F64 = 1e-10


# ---------------------------------------------------------------- plan structure
def test_plan_groups_and_tensors_of_small_cnn() -> None:
    # Arrange
    _, plan = _shared("cnn")

    # Act
    groups = plan.groups
    first = plan.group_tensors("body.0")
    last = plan.group_tensors("body.3")

    # Assert
    assert groups == {"body.0": 16, "body.3": 32}
    assert first == {
        "body.0.weight",
        "body.0.bias",
        "body.1.weight",
        "body.1.bias",
        "body.1.running_mean",
        "body.1.running_var",
        "body.3.weight",
    }
    assert "head.weight" in last and "head.bias" not in last


@pytest.mark.parametrize("training", [True, False])
def test_plan_restores_training_mode(training: bool) -> None:
    # Arrange
    model = MLP(8, [4], 3).train(training)

    # Act
    StructurePlan(model, model.example_input(1), model.output_layers)

    # Assert
    assert all(m.training == training for m in model.modules())


def test_unknown_output_layer_is_a_clear_error() -> None:
    model = MLP(8, [4], 3)
    with pytest.raises(ValueError, match="not a submodule"):
        StructurePlan(model, model.example_input(1), ["classifier"])


@pytest.mark.parametrize("model_name", list(MODELS))
def test_index_sets_cover_every_state_tensor(model_name: str) -> None:
    # Arrange
    model, plan = _shared(model_name)
    state = model.state_dict()

    # Act
    _, idx = _index_set(plan, "leading", 0.5)

    # Assert
    assert set(idx) == set(state)
    for key, tensor in state.items():
        assert len(idx[key]) == tensor.ndim
        for entry in idx[key]:
            assert entry is None or (
                entry.dtype == torch.long and bool((entry[1:] > entry[:-1]).all())
            )
    for key in state:
        if key.endswith("num_batches_tracked") or key.startswith("head.bias"):
            assert idx[key] == (None,) * state[key].ndim
        if key == "head.weight":
            assert idx[key][0] is None  # classes are never pruned


# ---------------------------------------------------------------- sub == full[kept]
@pytest.mark.parametrize(("model_name", "policy_name", "ratio"), CASES)
def test_submodel_state_is_extract_and_fancy_indexing(
    model_name: str, policy_name: str, ratio: float
) -> None:
    # Arrange
    model, plan = _shared(model_name)
    full = model.state_dict()
    _, idx = _index_set(plan, policy_name, ratio)

    # Act
    sub_state = plan.submodel(idx).state_dict()
    extracted = extract(full, idx)

    # Assert
    assert set(sub_state) == set(full)
    for key, tensor in full.items():
        assert torch.equal(sub_state[key], extracted[key]), key
        assert torch.equal(sub_state[key], _fancy(tensor, idx[key])), key
        assert sub_state[key].numel() == index_set_numel(idx, {key: tensor.shape})[key]


@pytest.mark.parametrize(("model_name", "policy_name", "ratio"), CASES)
def test_scatter_of_extract_is_identity_and_zero_outside_mask(
    model_name: str, policy_name: str, ratio: float
) -> None:
    # Arrange
    model, plan = _shared(model_name)
    full = model.state_dict()
    _, idx = _index_set(plan, policy_name, ratio)
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    masks = dense_mask(idx, {k: v.shape for k, v in full.items()})

    # Act
    back = scatter(extract(full, idx), idx, full)
    into_zeros = scatter(extract(full, idx), idx, zeros)

    # Assert
    for key, tensor in full.items():
        assert torch.equal(back[key], tensor), key
        assert back[key] is not tensor
        assert torch.equal(into_zeros[key], torch.where(masks[key], tensor, zeros[key])), key
        assert torch.equal(zeros[key], torch.zeros_like(tensor))  # base not mutated


@pytest.mark.parametrize(("model_name", "policy_name", "ratio"), CASES)
def test_index_sets_are_cartesian_and_submodel_runs(
    model_name: str, policy_name: str, ratio: float
) -> None:
    # Arrange
    model, plan = _shared(model_name)
    shapes = plan.shapes
    _, idx = _index_set(plan, policy_name, ratio)

    # Act
    masks = dense_mask(idx, shapes)
    counts = index_set_numel(idx, shapes)
    out = plan.submodel(idx)(model.example_input(4))

    # Assert
    for key, mask in masks.items():
        assert int(mask.sum()) == counts[key]
        product = torch.ones((), dtype=torch.bool)
        for dim in range(mask.ndim):
            others = [d for d in range(mask.ndim) if d != dim]
            axis = mask.any(dim=others) if others else mask
            expected = torch.arange(mask.shape[dim]) if idx[key][dim] is None else idx[key][dim]
            assert torch.equal(axis.nonzero().squeeze(1), expected), (key, dim)
            product = product.unsqueeze(-1) & axis
        assert torch.equal(product.reshape(mask.shape), mask), key
    assert out.shape == (4, 10)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_random_kept_sets_in_any_order(model_name: str) -> None:
    # Arrange
    model, plan = _shared(model_name)
    full = model.state_dict()
    gen = torch.Generator().manual_seed(7)
    kept = {}
    for group, channels in plan.groups.items():
        size = int(torch.randint(1, channels + 1, (1,), generator=gen))
        kept[group] = torch.randperm(channels, generator=gen)[:size]  # unsorted on purpose

    # Act
    idx = plan.index_sets(kept)
    sub_state = plan.submodel(idx).state_dict()

    # Assert
    for group, channels_kept in kept.items():
        root_weight = idx[f"{group}.weight"][0]
        if channels_kept.numel() == plan.groups[group]:
            assert root_weight is None  # a whole group stays whole
        else:
            assert torch.equal(root_weight, torch.sort(channels_kept).values)
    for key, tensor in full.items():
        assert torch.equal(sub_state[key], _fancy(tensor, idx[key])), key
    assert torch.equal(scatter(extract(full, idx), idx, full)["head.weight"], full["head.weight"])


# ---------------------------------------------------------------- full mask == dense
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("training", [False, True])
def test_full_ratio_is_the_dense_model(model_name: str, policy_name: str, training: bool) -> None:
    # Arrange
    model, plan = _setup(model_name)
    x = _input(model, 8, seed=1)
    _, idx = _index_set(plan, policy_name, 1.0)
    model.train(training)
    sub = plan.submodel(idx)

    # Act
    out_sub = sub(x)
    out_full = model(x)

    # Assert: bitwise in float32, as both run the same modules' code on tensors of the same
    # shapes (r = 1 keeps every channel), so the same kernels in the same order, on any CPU
    assert idx == plan.full_index_set()
    assert sub.training == training
    assert torch.equal(out_sub, out_full)
    for key, tensor in model.state_dict().items():  # running stats updated identically
        assert torch.equal(sub.state_dict()[key], tensor), key


# ---------------------------------------------------------------- masked full == submodel
@pytest.mark.float_sensitive
def test_mlp_submodel_equals_full_model_with_dropped_outgoing_weights_zeroed() -> None:
    # Arrange: only the next layer's weights from dropped hidden units are zeroed.
    model, plan = _setup("mlp_2hidden")
    kept, idx = _index_set(plan, "importance", 0.5)
    model.double()
    x = _input(model, 16, seed=2).double()
    masked = MLP(64, [32, 16], 10).double()
    masked.load_state_dict(model.state_dict())
    with torch.no_grad():
        drop1 = torch.ones(32, dtype=torch.bool)
        drop1[kept["body.0"]] = False
        drop2 = torch.ones(16, dtype=torch.bool)
        drop2[kept["body.2"]] = False
        masked.body[2].weight[:, drop1] = 0.0
        masked.head.weight[:, drop2] = 0.0

    # Act
    out_sub = plan.submodel(idx).double()(x)
    out_masked = masked(x)

    # Assert
    torch.testing.assert_close(out_sub, out_masked, rtol=0, atol=ATOL_F64)
    assert not torch.allclose(model(x), out_masked, atol=1e-3)  # the mask did something


@pytest.mark.float_sensitive
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("training", [False, True])
def test_full_model_zeroed_outside_mask_computes_submodel_logits(
    model_name: str, training: bool
) -> None:
    # Arrange
    model, plan = _setup(model_name)
    _, idx = _index_set(plan, "leading", 0.5)
    full = model.double().state_dict()
    masks = dense_mask(idx, plan.shapes)
    masked = {k: torch.where(masks[k], v, torch.zeros_like(v)) for k, v in full.items()}
    model.load_state_dict(masked)
    sub = plan.submodel(idx, full).double()
    model.train(training)
    sub.train(training)
    x = _input(model, 8, seed=3).double()

    # Act
    out_masked = model(x)
    out_sub = sub(x)

    # Assert
    torch.testing.assert_close(out_sub, out_masked, rtol=0, atol=ATOL_F64)


def test_cnn_flatten_coupling_maps_channels_to_pool_blocks() -> None:
    # Arrange
    model, plan = _shared("cnn")
    pool = 2
    kept = {"body.3": torch.tensor([31, 0, 5, 17])}

    # Act
    idx = plan.index_sets(kept)

    # Assert
    expected = torch.cat([c * pool * pool + torch.arange(pool * pool) for c in [0, 5, 17, 31]])
    assert torch.equal(idx["head.weight"][1], expected)
    assert idx["head.weight"][0] is None
    assert torch.equal(idx["body.4.running_mean"][0], torch.tensor([0, 5, 17, 31]))
    assert idx["body.3.weight"][1] is None  # body.0 is whole
    assert torch.equal(plan.submodel(idx).head.weight, model.head.weight[:, expected])


# ---------------------------------------------------------------- policies
def test_leading_policy_on_mlp_gives_weight_prefix() -> None:
    # Arrange
    model, plan = _shared("mlp_2hidden")

    # Act
    kept, idx = _index_set(plan, "leading", 0.5)
    sub = extract(model.state_dict(), idx)

    # Assert
    assert torch.equal(kept["body.0"], torch.arange(16))
    assert torch.equal(kept["body.2"], torch.arange(8))
    assert torch.equal(sub["body.0.weight"], model.body[0].weight.detach()[:16, :])
    assert torch.equal(sub["body.2.weight"], model.body[2].weight.detach()[:8, :16])
    assert torch.equal(sub["body.2.bias"], model.body[2].bias.detach()[:8])
    assert torch.equal(sub["head.weight"], model.head.weight.detach()[:, :8])
    assert torch.equal(sub["head.bias"], model.head.bias.detach())


def _hand_set_mlp(row_norms: list[float], head: float) -> tuple[MLP, StructurePlan]:
    model = MLP(4, [len(row_norms)], 3)
    with torch.no_grad():
        model.body[0].weight.copy_(torch.tensor(row_norms)[:, None] * torch.tensor([1.0, 0, 0, 0]))
        model.body[0].bias.fill_(100.0)  # biases are not part of the magnitude
        model.head.weight.fill_(head)
    return model, StructurePlan(model, model.example_input(1), model.output_layers)


@pytest.mark.parametrize("head", [1.0, 0.0])
def test_importance_policy_keeps_largest_norm_units(head: float) -> None:
    # Arrange: row norms known; equal head columns (or a zero head) do not change the order.
    _, plan = _hand_set_mlp([1.0, 5.0, -3.0, 0.5, 4.0, 2.0], head)
    policy = ImportancePolicy()
    gen = torch.Generator()

    # Act
    kept = policy(plan, {"body.0": 0.5}, round=0, client=0, generator=gen)
    scores = plan.group_scores()

    # Assert
    assert torch.equal(kept["body.0"], torch.tensor([1, 2, 4]))
    assert bool(torch.isfinite(scores["body.0"]).all())


def test_importance_policy_breaks_ties_by_lower_index() -> None:
    # Arrange
    _, plan = _hand_set_mlp([2.0, 5.0, 3.0, 5.0, 1.0, 5.0], 1.0)

    # Act
    kept = ImportancePolicy()(
        plan, {"body.0": 1 / 3}, round=0, client=0, generator=torch.Generator()
    )

    # Assert
    assert torch.equal(kept["body.0"], torch.tensor([1, 3]))


def test_importance_scores_are_cached_per_round() -> None:
    # Arrange
    model, plan = _hand_set_mlp([1.0, 5.0, 3.0, 0.5], 1.0)
    policy = ImportancePolicy()
    gen = torch.Generator()
    first = policy(plan, {"body.0": 0.25}, round=0, client=0, generator=gen)
    new_state = {k: v.clone() for k, v in model.state_dict().items()}
    new_state["body.0.weight"][0, 0] = 10.0

    # Act
    plan.load_state(new_state)
    same_round = policy(plan, {"body.0": 0.25}, round=0, client=1, generator=gen)
    next_round = policy(plan, {"body.0": 0.25}, round=1, client=0, generator=gen)

    # Assert
    assert torch.equal(first["body.0"], torch.tensor([1]))
    assert torch.equal(same_round["body.0"], torch.tensor([1]))
    assert torch.equal(next_round["body.0"], torch.tensor([0]))
    assert model.body[0].weight[0, 0].item() == 10.0  # load_state wrote into the model


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("ratio", RATIOS)
def test_policy_conformance(policy_name: str, ratio: float) -> None:
    # Arrange
    _, plan = _shared("cnn")
    policy = POLICIES[policy_name]()
    ratios = {"body.3": ratio}

    # Act
    a = policy(plan, ratios, round=3, client=1, generator=torch.Generator().manual_seed(0))
    b = policy(plan, ratios, round=3, client=1, generator=torch.Generator().manual_seed(0))

    # Assert
    assert isinstance(policy, MaskPolicy)
    assert set(a) == {"body.3"}
    assert torch.equal(a["body.3"], b["body.3"])
    assert a["body.3"].numel() == kept_count(32, ratio)
    assert torch.equal(a["body.3"], torch.unique(a["body.3"]))  # sorted, no duplicates


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kept", "match"),
    [
        ({"body.9": torch.tensor([0])}, "unknown group 'body.9'"),
        ({"body.0": torch.tensor([0, 16])}, r"must lie in \[0, 16\)"),
        ({"body.0": torch.tensor([-1, 2])}, r"must lie in \[0, 16\)"),
        ({"body.0": torch.tensor([3, 3])}, "duplicate"),
        ({"body.0": torch.tensor([], dtype=torch.long)}, "at least one channel"),
        ({"body.0": torch.tensor([0.0, 1.0])}, "integer indices"),
        ({"body.0": torch.tensor([[0, 1]])}, "1-D"),
    ],
)
def test_bad_kept_sets_are_clear_errors(kept: dict[str, Tensor], match: str) -> None:
    _, plan = _shared("cnn")
    with pytest.raises(ValueError, match=match):
        plan.index_sets(kept)


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5])
def test_bad_ratios_are_clear_errors(ratio: float) -> None:
    _, plan = _shared("cnn")
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        kept_count(16, ratio)
    for policy in (LeadingPolicy(), ImportancePolicy()):
        with pytest.raises(ValueError, match=r"in \(0, 1\]"):
            policy(plan, {"body.0": ratio}, round=0, client=0, generator=torch.Generator())


def test_policy_with_unknown_group_is_a_clear_error() -> None:
    _, plan = _shared("cnn")
    with pytest.raises(ValueError, match="unknown group 'head'"):
        LeadingPolicy()(plan, {"head": 0.5}, round=0, client=0, generator=torch.Generator())


def test_submodel_refuses_pruning_the_output_layer() -> None:
    # Arrange
    _, plan = _shared("mlp_wide")
    idx = plan.full_index_set()
    idx["head.weight"] = (torch.arange(5), None)

    # Act / Assert
    with pytest.raises(ValueError, match="no prunable group slices"):
        plan.submodel(idx)


# ---------------------------------------------------------------- small hand-computed cases
def test_kept_count_rounds_up_and_clamps() -> None:
    assert [kept_count(10, r) for r in (1.0, 0.5, 0.25, 0.3, 0.01)] == [10, 5, 3, 3, 1]
    assert kept_count(1, 0.25) == 1


def test_index_helpers_on_a_hand_made_index_set() -> None:
    # Arrange
    full = {"w": torch.arange(24.0).reshape(4, 6), "b": torch.arange(4.0), "s": torch.tensor(1.0)}
    idx: IndexSet = {"w": (torch.tensor([1, 3]), torch.tensor([0, 5])), "b": (None,), "s": ()}
    shapes = {k: v.shape for k, v in full.items()}

    # Act
    sub = extract(full, idx)
    counts = index_set_numel(idx, shapes)
    masks = dense_mask(idx, shapes)
    only_w = restrict(idx, ["w"])
    sub["b"][0] = -1.0

    # Assert
    assert sub["w"].tolist() == [[6.0, 11.0], [18.0, 23.0]]
    assert full["b"][0].item() == 0.0  # extract never aliases
    assert counts == {"w": 4, "b": 4, "s": 1}
    assert int(masks["w"].sum()) == 4 and bool(masks["w"][3, 5]) and not bool(masks["w"][0, 0])
    assert set(only_w) == {"w"}
    with pytest.raises(ValueError, match="no entry for tensor"):
        extract({"v": torch.zeros(2)}, idx)
    with pytest.raises(ValueError, match="shape"):
        scatter({"w": torch.zeros(3, 2)}, idx, full)


# ---------------------------------------------------------------- training equivalence
def _sgd_full_masked(
    model: nn.Module, params: Params, masks: Params, x: Tensor, y: Tensor, lr: float
) -> Params:
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(model, leaves, (x,)), y)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {
        k: (p - lr * g * masks[k]).detach() for (k, p), g in zip(leaves.items(), grads, strict=True)
    }


def _sgd(model: nn.Module, params: Params, x: Tensor, y: Tensor, lr: float) -> Params:
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = nn.functional.cross_entropy(functional_call(model, leaves, (x,)), y)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {k: (p - lr * g).detach() for (k, p), g in zip(leaves.items(), grads, strict=True)}


@pytest.mark.float_sensitive
@pytest.mark.parametrize("model_name", ["mlp_2hidden", "cnn"])
@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_sgd_step_on_submodel_equals_masked_full_step(
    model_name: str, policy_name: str, ratio: float
) -> None:
    # Arrange: the full model zeroed outside the mask is the submodel embedded in full size.
    model, plan = _setup(model_name)
    _, idx = _index_set(plan, policy_name, ratio)
    full = model.double().state_dict()
    masks = dense_mask(idx, plan.shapes)
    masked = {k: torch.where(masks[k], v, torch.zeros_like(v)) for k, v in full.items()}
    names = [n for n, _ in model.named_parameters()]
    sub = plan.submodel(idx, masked).double()
    model.load_state_dict(masked)
    model.train()
    sub.train()
    x = _input(model, 16, seed=4).double()
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(5))
    lr = 0.1

    # Act
    full_after = _sgd_full_masked(model, {n: masked[n] for n in names}, masks, x, y, lr)
    sub_after = _sgd(sub, extract({n: masked[n] for n in names}, idx), x, y, lr)
    back = scatter(sub_after, idx, {n: masked[n] for n in names})

    # Assert
    for name in names:
        torch.testing.assert_close(back[name], full_after[name], rtol=0, atol=ATOL_F64)
    assert any(not torch.equal(back[n], masked[n]) for n in names)  # the step moved something


# ---------------------------------------------------------------- residual / concat coupling
class _ResidualConcat(nn.Module):
    """Residual add, channel concat, a depthwise conv and a flatten into the head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.res = nn.Conv2d(8, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 6, 1)
        self.right = nn.Conv2d(8, 4, 1)
        self.depthwise = nn.Conv2d(10, 10, 3, padding=1, groups=10)
        self.head = nn.Linear(10 * 4, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.bn(self.stem(x)))
        h = h + self.res(h)
        z = self.depthwise(torch.cat([self.left(h), self.right(h)], 1))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(z, 2), 1))


@pytest.mark.float_sensitive
def test_residual_concat_and_depthwise_coupling() -> None:
    # Arrange
    model = _randomize(_ResidualConcat(), seed=11).eval()
    plan = StructurePlan(model, torch.zeros(1, 1, 8, 8), ["head"])
    gen = torch.Generator().manual_seed(0)
    kept = {g: torch.randperm(c, generator=gen)[: c // 2] for g, c in plan.groups.items()}
    full = model.double().state_dict()
    x = torch.randn(3, 1, 8, 8, generator=gen, dtype=torch.float64)

    # Act
    idx = plan.index_sets(kept)
    sub = plan.submodel(idx).double()
    masks = dense_mask(idx, plan.shapes)
    model.load_state_dict(
        {k: torch.where(masks[k], v, torch.zeros_like(v)) for k, v in full.items()}
    )

    # Assert: one group spans stem, BN and the residual branch; the concat splits the other.
    assert len(plan.groups) == 2
    residual = next(g for g in plan.groups if "stem.weight" in plan.group_tensors(g))
    assert torch.equal(idx["stem.weight"][0], idx["res.weight"][0])
    assert torch.equal(idx["res.weight"][1], idx["left.weight"][1])
    assert torch.equal(idx["stem.weight"][0], torch.sort(kept[residual]).values)
    for key, tensor in full.items():
        assert torch.equal(sub.state_dict()[key], _fancy(tensor, idx[key])), key
    torch.testing.assert_close(sub(x), model(x), rtol=0, atol=ATOL_F64)


def _random_entries(gen: torch.Generator, shape: tuple[int, ...], clients: int) -> list:
    """Per-client structured entries for a tensor of ``shape``: each dimension whole, half or
    a quarter of it (sorted random picks), so that several clients select equal shapes."""
    entries = []
    for _ in range(clients):
        entry = []
        for n in shape:
            pick = int(torch.randint(3, (), generator=gen))
            if pick == 0 or n == 1:
                entry.append(None)
            else:
                keep = max(1, n // (2 * pick))
                entry.append(torch.randperm(n, generator=gen)[:keep].sort().values)
        entries.append(tuple(entry))
    return entries


@pytest.mark.parametrize("clients", [1, 2, 9, 40])
def test_extract_many_equals_extract_client_by_client(clients: int) -> None:
    """extract_many gives every client exactly what extract gives it: values, dtype, shape and
    strides, contiguous, in memory of its own (not full's), each client's tensor starting at a
    multiple of 64 bytes as a fresh allocation does (rows of one gathered block are padded to
    that); it works for float, double and integer tensors, 0-d ones, whole and pruned
    dimensions, and gathers each group of equal shapes in a few operations, not per client."""
    from radbo.masks.index import extract, extract_many

    gen = torch.Generator().manual_seed(clients)
    shapes = {"w": (12, 7), "conv": (8, 3, 3, 3), "b": (5,), "s": (), "h": (6, 2), "i": (9,)}
    dtypes = {"h": torch.float64, "i": torch.int64}
    full = {
        k: (torch.randn(s, generator=gen) * 10).to(dtypes.get(k, torch.float32))
        for k, s in shapes.items()
    }
    per = {k: _random_entries(gen, s, clients) for k, s in shapes.items()}
    sets = [{k: per[k][c] for k in shapes} for c in range(clients)]
    many = extract_many(full, sets)
    assert len(many) == clients
    for c in range(clients):
        one = extract(full, sets[c])
        assert list(many[c]) == list(one)
        for k, expected in one.items():
            got = many[c][k]
            assert got.dtype == expected.dtype and got.shape == expected.shape, k
            assert got.is_contiguous() and torch.equal(got, expected), k
            assert got.data_ptr() % 64 == 0, k
            assert got.untyped_storage().data_ptr() != full[k].untyped_storage().data_ptr()

    same = [{"w": (torch.tensor([0, 3, 5]), None)}] * clients  # one group
    with OpLog() as log:  # the operations that are not views: a view launches nothing
        extract_many({"w": full["w"]}, same)
    # the stacked index lists, an arange, the gather, and (these 3 x 7 rows are padded to 64
    # bytes) an empty block and one copy into it, whatever the number of clients
    ops = log.launched
    assert ops == [
        "aten::stack",
        "aten::arange",
        "aten::index.Tensor",
        "aten::empty.memory_format",
        "aten::copy_",
    ], ops
