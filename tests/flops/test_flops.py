"""FLOP counting (radbo.flops): exact hand-derived counts, double backward, ResNet-18 ratios.

A linear layer ``in -> out`` on a batch of B costs ``2·B·in·out`` FLOPs for each of: the
forward product, the weight gradient ``∂L/∂W = Gᵀ·h`` and the input gradient ``∂L/∂h = G·W``.
Biases, ReLU, softmax and the loss are elementwise or reductions and are not counted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radbo.flops import count_flops, training_step_flops
from radbo.masks.policies.leading import LeadingPolicy
from radbo.masks.structure import StructurePlan
from radbo.models import MLP, ResNet18, SmallCNN

B = 8


def _linear(batch: int, n_in: int, n_out: int) -> int:
    """FLOPs of one product of a linear layer (forward, weight gradient or input gradient)."""
    return 2 * batch * n_in * n_out


def _real_step(model: nn.Module, batch: int, params: list[torch.Tensor]) -> int:
    """count_flops of a real CPU forward + backward on a random batch (explicit generator)."""
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, *model.input_shape, generator=gen)
    targets = torch.randint(0, 10, (batch,), generator=gen)

    def step() -> None:
        loss = F.cross_entropy(model(inputs), targets)
        torch.autograd.grad(loss, params)

    return count_flops(step)


def test_count_flops_matmul() -> None:
    a, b = torch.ones(4, 3), torch.ones(3, 5)
    assert count_flops(lambda: a @ b) == 2 * 4 * 3 * 5


def test_mlp_step_all_params_exact() -> None:
    # Arrange: 64 -> 32 -> 10. Layer 1: forward + weight grad (its input is data: no input grad).
    # Head: forward + weight grad + input grad (needed by layer 1's weight grad).
    model = MLP(64, [32], 10)
    expected = 2 * _linear(B, 64, 32) + 3 * _linear(B, 32, 10)
    assert expected == 80896

    # Act
    counted = training_step_flops(model, B)
    real = _real_step(model, B, list(model.parameters()))

    # Assert: the meta-device count equals the analytic value and a real CPU step.
    assert counted == expected
    assert real == expected


def test_mlp_step_inner_only_skips_backbone_backward() -> None:
    # Head only (y): layer 1 forward, head forward + weight grad; no input grad, no layer-1 grad.
    model = MLP(64, [32], 10)
    expected = _linear(B, 64, 32) + 2 * _linear(B, 32, 10)
    assert expected == 43008

    assert training_step_flops(model, B, wrt="inner") == expected
    assert _real_step(model, B, list(model.head.parameters())) == expected


def test_mlp_step_outer_only() -> None:
    # Backbone only (x): layer 1 forward + weight grad, head forward + input grad (no weight grad).
    model = MLP(64, [32], 10)
    expected = 2 * _linear(B, 64, 32) + 2 * _linear(B, 32, 10)
    assert training_step_flops(model, B, wrt="outer") == expected
    assert training_step_flops(model, B, wrt="outer", inner_names=["head.weight"]) == (
        # head.bias is now outer too: nothing changes, bias gradients are reductions
        expected
    )


def test_double_backward_single_linear_exact() -> None:
    # Linear d -> k, CE loss. grad with create_graph: forward + weight grad = 2 products.
    # HVP ∂/∂W <∇_W L, u>: backward of the mm Gᵀ·x w.r.t. G (one product), then through the
    # softmax (elementwise) and back to W through z = x·Wᵀ (one product): 2 more products.
    batch, d, k = 8, 6, 5
    layer = nn.Linear(d, k)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, d, generator=gen)
    t = torch.randint(0, k, (batch,), generator=gen)
    u = [torch.randn(k, d, generator=gen), torch.randn(k, generator=gen)]
    params = list(layer.parameters())

    def grad_only() -> None:
        loss = F.cross_entropy(layer(x), t)
        torch.autograd.grad(loss, params, create_graph=True)

    def with_hvp() -> None:
        loss = F.cross_entropy(layer(x), t)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        torch.autograd.grad(grads, params, grad_outputs=u)

    assert count_flops(grad_only) == 2 * _linear(batch, d, k)
    assert count_flops(with_hvp) == 4 * _linear(batch, d, k)


def test_double_backward_on_mlp_head_adds_flops() -> None:
    # Head HVP on MLP(64, [32], 10): 2 extra head-sized products on top of the inner step.
    model = MLP(64, [32], 10)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, 64, generator=gen)
    t = torch.randint(0, 10, (B,), generator=gen)
    head = list(model.head.parameters())
    u = [torch.randn_like(p) for p in head]

    def hvp() -> None:
        loss = F.cross_entropy(model(x), t)
        grads = torch.autograd.grad(loss, head, create_graph=True)
        torch.autograd.grad(grads, head, grad_outputs=u)

    first_order = training_step_flops(model, B, wrt="inner")
    second_order = count_flops(hvp)
    assert second_order > first_order
    assert second_order == first_order + 2 * _linear(B, 32, 10)


def test_meta_count_matches_real_cnn_step() -> None:
    # Convolutions: the shape-only meta count equals a real CPU forward + backward.
    model = SmallCNN()
    assert training_step_flops(model, 4) == _real_step(model, 4, list(model.parameters()))


def test_module_without_example_input_needs_input_shape() -> None:
    model = nn.Sequential(nn.Linear(5, 3))
    assert training_step_flops(model, 2, input_shape=(5,)) == 2 * _linear(2, 5, 3)
    with pytest.raises(ValueError, match="input_shape"):
        training_step_flops(model, 2)
    with pytest.raises(ValueError, match="batch_size"):
        training_step_flops(MLP(4, [3], 2), 0)
    with pytest.raises(ValueError, match="wrt"):
        training_step_flops(MLP(4, [3], 2), 1, wrt="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not parameters"):
        training_step_flops(MLP(4, [3], 2), 1, wrt="inner", inner_names=["nope"])


def test_training_step_flops_leaves_module_untouched() -> None:
    model = SmallCNN()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    training_step_flops(model, 4)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN stats not moved
    assert all(p.grad is None for p in model.parameters())


def test_resnet18_submodel_flops_scale_as_r_squared() -> None:
    # HeteroFL-style leading submodels of ResNet-18: conv FLOPs scale with in x out channels.
    model = ResNet18()
    plan = StructurePlan(model, model.example_input(1), model.output_layers)

    def submodel(r: float) -> nn.Module:
        kept = LeadingPolicy()(
            plan, dict.fromkeys(plan.groups, r), round=0, client=0, generator=torch.Generator()
        )
        return plan.submodel(plan.index_sets(kept))

    full = training_step_flops(model, 2)
    half = training_step_flops(submodel(0.5), 2) / full
    quarter = training_step_flops(submodel(0.25), 2) / full

    # ratios of integer FLOP counts (from shapes, not from any float result): the same on
    # every CPU and kernel; the bounds state the r² law, not a rounding margin
    assert 0.24 <= half <= 0.27  # measured 0.2505
    assert 0.055 <= quarter <= 0.07  # measured 0.0629


def test_finite_difference_pays_a_gradient_per_coordinate_where_autograd_pays_none() -> None:
    """Exact FLOPs of CG and RAFBO's estimator on a feature-L2 logistic regression.

    y = (W, b) of a ``d -> C`` logistic regression on B samples, x = one log L2 weight per
    feature (only in g). One gradient of g or f with respect to y is the forward and the
    weight-gradient products, ``4·B·d·C``; an autograd HVP in y is the same two products; the
    mixed product ``∇²_xy g · v`` touches x only through the elementwise regularizer, so it
    costs no counted FLOPs. Hence CG(K) = (2 + K)·unit and FD(K, |P|) = (2 + K + |P|)·unit:
    finite differences pay one whole gradient per coordinate of P, autograd nothing for all of
    x (why RAFBO is not cheaper in FLOPs, BENCHMARKS.md).
    """
    from radbo.hypergrad import FiniteDifference, ImplicitCG

    batch, d, classes, iters = 16, 6, 3, 5
    gen = torch.Generator().manual_seed(0)
    inputs, val_inputs = (torch.randn(batch, d, generator=gen, dtype=torch.float64) for _ in "ab")
    targets, val_targets = (torch.randint(0, classes, (batch,), generator=gen) for _ in "ab")
    x = {"log_l2": torch.zeros(d, dtype=torch.float64)}
    y = {
        "weight": 0.1 * torch.randn(classes, d, generator=gen, dtype=torch.float64),
        "bias": torch.zeros(classes, dtype=torch.float64),
    }

    def inner(x, y):
        reg = 0.5 * (torch.exp(x["log_l2"]) * y["weight"].pow(2)).sum()
        return F.cross_entropy(F.linear(inputs, y["weight"], y["bias"]), targets) + reg

    def outer(x, y):
        return F.cross_entropy(F.linear(val_inputs, y["weight"], y["bias"]), val_targets)

    unit = 2 * _linear(batch, d, classes)
    results = []

    def flops(estimator) -> int:
        return count_flops(
            lambda: results.append(
                estimator(outer, inner, x, y, generator=torch.Generator().manual_seed(1))
            )
        )

    assert flops(ImplicitCG(max_iter=iters, tol=0.0)) == (2 + iters) * unit
    assert (results[-1].n_grad, results[-1].n_hvp) == (2, iters + 1)
    for size in (1, 4):
        estimator = FiniteDifference(
            num_coordinates=size, cg_iters=iters, tol=0.0, scheme="forward"
        )
        assert flops(estimator) == (2 + iters + size) * unit
        assert (results[-1].n_grad, results[-1].n_hvp) == (2 + iters + size, 0)
