"""Structured-mask conformance battery over radbo's model zoo, and the zoo's architectures.

Every model (MLP 784-200-10 and 64-128-10, SmallCNN, CNN7, a narrow ResNet-12 at 3x32x32,
ResNet-18) x policy (leading, importance, rolling, random, coverage, fiarse) x capacity ratio
r in {1, 1/2, 1/4, 1/8} (every prunable group keeps ``kept_count(C, r)`` channels; fiarse's
groups keep no more connections than that together) must satisfy SPEC "Masks":

* the physical submodel's tensors are ``extract(full, idx)``, which is ``full`` indexed by the
  Cartesian product of the kept indices (checked against plain advanced indexing);
* ``scatter(extract(full, idx), idx, full) == full`` bitwise, and scatter writes nowhere else;
* index sets are Cartesian products: ``dense_mask`` equals the product mask built by advanced
  indexing, and the root layer of each group keeps exactly the policy's channels;
* r = 1 is the dense model (``torch.equal`` of outputs, eval mode); submodels run forward;
* one SGD step on the extracted submodel, scattered back, equals one step on the masked full
  model (see :func:`test_sgd_step_on_submodel_equals_masked_full_step`);
* ``leading`` reproduces HeteroFL's slicing ``W[:k_out, :k_in]`` of every ResNet-18 layer.

Models are randomised (BatchNorm affine parameters and running statistics included) so that no
check passes by symmetry; plans, policies and index sets are built once per model and shared
by the read-only tests.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

from radbo.masks import (
    CoveragePolicy,
    FiarsePolicy,
    ImportancePolicy,
    LeadingPolicy,
    MaskPolicy,
    RandomPolicy,
    RollingPolicy,
    RoundPreparedPolicy,
    StructurePlan,
    dense_mask,
    extract,
    index_set_numel,
    kept_count,
    scatter,
)
from radbo.models import CNN7, MLP, BilevelModel, ResNet12, ResNet18, SmallCNN
from radbo.typing import IndexSet, Params

MODELS: dict[str, Callable[[], BilevelModel]] = {
    "mlp_mnist": lambda: MLP(784, [200], 10),
    "mlp_digits": lambda: MLP(64, [128], 10),
    "small_cnn": SmallCNN,
    "cnn7": CNN7,
    "resnet12_narrow": lambda: ResNet12(
        classes=5, in_channels=3, image_size=32, widths=(16, 32, 48, 64)
    ),
    "resnet18": ResNet18,
}
POLICIES: dict[str, Callable[[], MaskPolicy]] = {
    "leading": LeadingPolicy,
    "importance": ImportancePolicy,
    "rolling": lambda: RollingPolicy(stride=3),  # called at round 7: a wrapped window
    "random": RandomPolicy,
    "coverage": lambda: CoveragePolicy(k=1, num_clients=1),
    "fiarse": FiarsePolicy,  # widths differ by layer: one model-wide threshold
}
#: Policies with one model-wide threshold (FIARSE): groups keep different fractions, within
#: the connections of the uniform-width submodel (each group at kept_count(C, r)).
POOLED = {"fiarse"}
RATIOS = [1.0, 0.5, 0.25, 0.125]
CASES = [(m, p, r) for m in MODELS for p in POLICIES for r in RATIOS]
BATCH = 2


# ---------------------------------------------------------------- shared set-up
@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Run this module single-threaded, restoring the thread count afterwards.

    Its tensors are small (batch 2 to 4), so intra-op threads buy nothing, and on a loaded
    2-core machine OpenMP oversubscription made the module about 10x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randomize_batchnorm(model: nn.Module, seed: int) -> nn.Module:
    """Give every BatchNorm distinct affine parameters and running statistics.

    Conv and linear layers keep their (random, scale-preserving) default initialisation, so
    activations stay O(1) through ResNet-18 and float32 comparisons stay meaningful.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(1.0 + 0.2 * torch.randn(c, generator=gen))
                m.bias.copy_(0.2 * torch.randn(c, generator=gen))
                m.running_mean.copy_(0.2 * torch.randn(c, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(c, generator=gen))
    return model


@functools.cache
def _setup(model_name: str) -> tuple[BilevelModel, StructurePlan]:
    """The shared (read-only) model and its plan; tests that train use copies."""
    with torch.random.fork_rng():  # seed the default initialisation without leaking the seed
        torch.manual_seed(0)
        model = MODELS[model_name]()
    model = _randomize_batchnorm(model, seed=1).eval()
    return model, StructurePlan(model, model.example_input(1), model.output_layers)


@functools.cache
def _policy(model_name: str, policy_name: str) -> MaskPolicy:
    """One policy per model, so importance scores are computed once (they are cached per round)."""
    return POLICIES[policy_name]()


@functools.cache
def _index_sets(
    model_name: str, policy_name: str, ratio: float
) -> tuple[dict[str, Tensor], IndexSet]:
    _, plan = _setup(model_name)
    policy = _policy(model_name, policy_name)
    ratios = {g: ratio for g in plan.groups}
    if isinstance(policy, RoundPreparedPolicy):
        policy.prepare([0], [ratios])
    kept = policy(plan, ratios, round=7, client=0, generator=torch.Generator().manual_seed(0))
    return kept, plan.index_sets(kept)


def _input(model: BilevelModel, batch: int, seed: int) -> Tensor:
    return torch.randn(batch, *model.input_shape, generator=torch.Generator().manual_seed(seed))


def _float64(state: Params) -> Params:
    """A float64 copy of ``state`` (integer buffers such as ``num_batches_tracked`` kept)."""
    return {k: v.double() if v.is_floating_point() else v.clone() for k, v in state.items()}


def _classes(model: BilevelModel) -> int:
    head = model.get_submodule(model.output_layers[0])
    assert isinstance(head, nn.Linear)
    return head.out_features


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


def _product_mask(shape: torch.Size, entry: tuple[Tensor | None, ...]) -> Tensor:
    """The mask that is True exactly on the Cartesian product of ``entry`` (advanced indexing)."""
    mask = torch.zeros(shape, dtype=torch.bool)
    if len(shape) == 0:
        return torch.ones((), dtype=torch.bool)
    axes = []
    for dim, idx in enumerate(entry):
        axis = torch.arange(shape[dim]) if idx is None else idx
        view = [1] * len(shape)
        view[dim] = -1
        axes.append(axis.reshape(view))
    mask[tuple(axes)] = True
    return mask


# ---------------------------------------------------------------- extraction invariants
@pytest.mark.parametrize(("model_name", "policy_name", "ratio"), CASES)
def test_submodel_state_is_extract_and_fancy_indexing(
    model_name: str, policy_name: str, ratio: float
) -> None:
    # Arrange
    model, plan = _setup(model_name)
    _, idx = _index_sets(model_name, policy_name, ratio)
    full = model.state_dict()

    # Act
    sub_state = plan.submodel(idx).state_dict()
    extracted = extract(full, idx)

    # Assert
    assert list(sub_state) == list(full)
    for key, tensor in full.items():
        assert torch.equal(sub_state[key], extracted[key]), key
        assert torch.equal(extracted[key], _fancy(tensor, idx[key])), key


@pytest.mark.parametrize(("model_name", "policy_name", "ratio"), CASES)
def test_scatter_of_extract_is_identity_and_touches_only_the_mask(
    model_name: str, policy_name: str, ratio: float
) -> None:
    # Arrange
    model, plan = _setup(model_name)
    _, idx = _index_sets(model_name, policy_name, ratio)
    full = model.state_dict()
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    masks = dense_mask(idx, plan.shapes)

    # Act
    back = scatter(extract(full, idx), idx, full)
    into_zeros = scatter(extract(full, idx), idx, zeros)

    # Assert
    for key, tensor in full.items():
        assert torch.equal(back[key], tensor), key
        assert torch.equal(into_zeros[key], torch.where(masks[key], tensor, zeros[key])), key


@pytest.mark.parametrize(("model_name", "policy_name", "ratio"), CASES)
def test_index_sets_are_cartesian_products_of_the_policy_choice(
    model_name: str, policy_name: str, ratio: float
) -> None:
    # Arrange
    model, plan = _setup(model_name)
    kept, idx = _index_sets(model_name, policy_name, ratio)
    shapes = plan.shapes

    # Act
    masks = dense_mask(idx, shapes)
    counts = index_set_numel(idx, shapes)

    # Assert: every entry is a sorted, duplicate-free, in-range LongTensor or None ...
    for key, entry in idx.items():
        for dim, axis in enumerate(entry):
            if axis is not None:
                assert axis.dtype == torch.long and axis.ndim == 1, (key, dim)
                assert torch.equal(axis, torch.unique(axis)), (key, dim)
                assert 0 <= int(axis.min()) and int(axis.max()) < shapes[key][dim], (key, dim)
        # ... the dense mask is the product mask, and the kept count is the product of sizes
        assert torch.equal(masks[key], _product_mask(shapes[key], entry)), key
        assert int(masks[key].sum()) == counts[key], key
    # Each group's root layer keeps exactly the policy's channels, and each group keeps
    # kept_count(C, r) of them (a pooled policy: no more connections than that); the
    # classifier's outputs are never pruned.
    for group, channels in plan.groups.items():
        expected = torch.sort(kept[group]).values
        got = idx[f"{group}.weight"][0]
        assert torch.equal(torch.arange(channels) if got is None else got, expected), group
        if policy_name not in POOLED:
            assert expected.numel() == kept_count(channels, ratio), group
    uniform = {g: torch.arange(kept_count(channels, ratio)) for g, channels in plan.groups.items()}
    assert plan.connections_kept(kept) <= plan.connections_kept(uniform)
    for layer in model.output_layers:
        assert idx[f"{layer}.weight"][0] is None


@pytest.mark.parametrize("model_name", list(MODELS))
def test_importance_cases_are_not_prefixes_in_disguise(model_name: str) -> None:
    # Arrange
    _, plan = _setup(model_name)

    # Act
    kept, _ = _index_sets(model_name, "importance", 0.5)

    # Assert: the battery's importance cases really exercise scattered (non-prefix) channels.
    prefixes = [torch.equal(k, torch.arange(k.numel())) for k in kept.values()]
    assert not all(prefixes)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_full_ratio_is_the_dense_model(model_name: str, policy_name: str) -> None:
    # Arrange
    model, plan = _setup(model_name)
    _, idx = _index_sets(model_name, policy_name, 1.0)
    x = _input(model, BATCH, seed=2)

    # Act
    sub = plan.submodel(idx).eval()

    # Assert: bitwise in float32, as both run the same modules' code on tensors of the same
    # shapes (r = 1 keeps every channel), so the same kernels in the same order, on any CPU
    assert all(axis is None for entry in idx.values() for axis in entry)
    with torch.no_grad():
        assert torch.equal(sub(x), model.eval()(x))


@pytest.mark.parametrize(("model_name", "policy_name", "ratio"), CASES)
def test_submodel_runs_forward_with_the_full_output_shape(
    model_name: str, policy_name: str, ratio: float
) -> None:
    # Arrange
    model, plan = _setup(model_name)
    _, idx = _index_sets(model_name, policy_name, ratio)
    full_params = sum(p.numel() for p in model.parameters())

    # Act
    sub = plan.submodel(idx).eval()
    with torch.no_grad():
        out = sub(_input(model, BATCH, seed=3))

    # Assert
    assert out.shape == (BATCH, _classes(model))
    assert torch.isfinite(out).all()
    sub_params = sum(p.numel() for p in sub.parameters())
    assert (sub_params == full_params) if ratio == 1.0 else (sub_params < full_params)


# ---------------------------------------------------------------- training equivalence
def _sgd_step(
    module: nn.Module,
    state: Params,
    x: Tensor,
    y: Tensor,
    lr: float,
    grad_masks: Params | None = None,
) -> Params:
    """One SGD step of cross-entropy via ``functional_call``; returns parameters and buffers.

    Buffers are cloned before the call, so train-mode BatchNorm updates the clones' running
    statistics (returned) and never the caller's tensors. With ``grad_masks`` each gradient is
    multiplied by its mask before the update.
    """
    names = {n for n, _ in module.named_parameters()}
    leaves = {k: v.detach().clone().requires_grad_(k in names) for k, v in state.items()}
    loss = nn.functional.cross_entropy(functional_call(module, leaves, (x,)), y)
    params = [k for k in leaves if k in names]
    grads = torch.autograd.grad(loss, [leaves[k] for k in params])
    out = {k: v.detach() for k, v in leaves.items()}
    for k, g in zip(params, grads, strict=True):
        if grad_masks is not None:
            g = g * grad_masks[k]
        out[k] = (leaves[k] - lr * g).detach()
    return out


# Rounding bound of one float64 SGD step, from the operation count. An inner product of n
# terms carries an error of at most γ_n * sum|terms| (γ_n ~ n * u, u = unit_roundoff(float64)
# = 2**-53 = 1.1e-16); the longest reductions here are ResNet-18's 3x3x512 = 4608-term
# convolutions (and their weight gradients over batch x 4 x 4 positions), and forward plus
# backward chain about 2 * 21 such layers. BatchNorm keeps every activation O(1), so the
# worst-case error of a gradient is about 4608 * 42 * 1.1e-16 = 2e-11; lr = 0.1 scales it to
# 2e-12 per parameter. The tolerance is that bound with a factor 50 for BatchNorm's 1/sigma
# amplification, and it is still 9 orders of magnitude below the size of the steps (0.1 to
# 1.8). Measured over all 60 cases: at most 3.8e-16 (default), 4.3e-16 (AVX2), 4.2e-16
# (AVX-512) kernels, 2e5 x below the tolerance.
_STEP_ATOL = 1e-10


@pytest.mark.float_sensitive
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("bn_mode", ["train", "eval"])
def test_sgd_step_on_submodel_equals_masked_full_step(
    model_name: str, policy_name: str, bn_mode: str
) -> None:
    """At r = 1/2: step on ``extract(full)``, scattered back == step on the masked full model.

    The reference is the submodel embedded at full size: the full model with every coordinate
    outside the index set set to zero (RABO's m ⊙ x), one SGD step with each gradient
    multiplied by its mask. Both BatchNorm modes are exact references:

    * train mode (batch statistics): a dropped channel's pre-BN output is exactly 0 (its conv
      rows and bias are zero, its inputs from dropped channels are zero), so its batch mean and
      variance are 0, its normalised value 0, and with gamma = beta = 0 it outputs 0 and passes
      0 back (the backward through BN carries a factor gamma). Kept channels' batch statistics
      are per channel, so they match the submodel's. Only beta of dropped channels gets a
      nonzero gradient (sum of the upstream gradient), which the mask removes. Running
      statistics of kept channels are compared too.
    * eval mode (running statistics): a dropped channel outputs (0 - 0) / sqrt(0 + eps) * 0 + 0.

    Dropped coordinates then stay at their old values after scatter (checked against the
    unmasked full state).

    Precision: float64 (states, inputs and hence the whole step; ``_sgd_step`` passes every
    parameter and buffer through ``functional_call``, so the modules' own float32 tensors are
    never used). The two sides sum the same nonzero terms in different orders (the submodel's
    convolutions are smaller, and float32 kernels differ between CPUs: ResNet-18 reached 9.8e-4
    in float32 on one CPU), so they agree only up to rounding. Tolerance ``atol = _STEP_ATOL``,
    ``rtol = 0``, see there.
    """
    # Arrange
    model, plan = _setup(model_name)
    _, idx = _index_sets(model_name, policy_name, 0.5)
    full = _float64(model.state_dict())
    masks = dense_mask(idx, plan.shapes)
    masked = {k: torch.where(masks[k], v, torch.zeros_like(v)) for k, v in full.items()}
    training = bn_mode == "train"
    net = copy.deepcopy(model).train(training)
    sub = plan.submodel(idx, full).train(training)
    x = _input(model, BATCH, seed=4).double()
    y = torch.randint(0, _classes(model), (BATCH,), generator=torch.Generator().manual_seed(5))
    lr = 0.1

    # Act
    full_after = _sgd_step(net, masked, x, y, lr, grad_masks=masks)
    sub_after = _sgd_step(sub, extract(full, idx), x, y, lr)
    back = scatter(sub_after, idx, full)

    # Assert
    for key in full:
        expected = torch.where(masks[key], full_after[key], full[key])
        torch.testing.assert_close(back[key], expected, rtol=0, atol=_STEP_ATOL, msg=key)
    params = [n for n, _ in model.named_parameters()]
    assert any(not torch.equal(back[n], full[n]) for n in params)  # the step moved something
    if training and any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
        assert any(not torch.equal(back[k], full[k]) for k in full if "running_mean" in k)


# ---------------------------------------------------------------- HeteroFL prefix slicing
@pytest.mark.parametrize("ratio", RATIOS)
def test_leading_policy_is_heterofl_prefix_slicing_on_resnet18(ratio: float) -> None:
    """HeteroFL (Diao et al., ICLR 2021) keeps ``W[:ceil(r C_out), :ceil(r C_in)]`` of each layer.

    The stem's input channels (the image's 3) and the classifier's outputs (10) stay whole;
    BatchNorm tensors are prefixes of length ``ceil(r C)``.
    """
    # Arrange
    model, plan = _setup("resnet18")
    _, idx = _index_sets("resnet18", "leading", ratio)
    full = model.state_dict()

    # Act
    sub = plan.submodel(idx)
    sub_state = sub.state_dict()

    # Assert
    checked = 0
    for name, layer in model.named_modules():
        if isinstance(layer, nn.Conv2d | nn.Linear):
            w = full[f"{name}.weight"]
            k_out = w.shape[0] if name == "head" else kept_count(w.shape[0], ratio)
            k_in = w.shape[1] if name == "stem.0" else kept_count(w.shape[1], ratio)
            assert torch.equal(sub_state[f"{name}.weight"], w[:k_out, :k_in]), name
            sub_layer = sub.get_submodule(name)
            in_attr = "in_channels" if isinstance(layer, nn.Conv2d) else "in_features"
            assert getattr(sub_layer, in_attr) == k_in, name
            checked += 1
        elif isinstance(layer, nn.BatchNorm2d):
            k = kept_count(layer.num_features, ratio)
            for t in ("weight", "bias", "running_mean", "running_var"):
                assert torch.equal(sub_state[f"{name}.{t}"], full[f"{name}.{t}"][:k]), name
    assert checked == 21  # 17 3x3 convs, 3 1x1 shortcuts, the head
    assert torch.equal(sub_state["head.bias"], full["head.bias"])


# ---------------------------------------------------------------- the architectures
def _resnet12_params(widths: tuple[int, ...], in_channels: int, classes: int) -> int:
    """Closed form: per block three 3x3 convs, a 1x1 shortcut and four BNs, then the head."""
    total, c_in = 0, in_channels
    for c in widths:
        total += 9 * c_in * c + 2 * 9 * c * c + c_in * c + 4 * 2 * c
        c_in = c
    return total + c_in * classes + classes


def test_resnet12_default_is_the_rfs_metaoptnet_backbone() -> None:
    # Arrange
    model = ResNet12(classes=5)

    # Act
    n_params = sum(p.numel() for p in model.parameters())
    blocks = list(model.layers)

    # Assert: 12.4 M parameters, as reported for MetaOptNet / RFS's ResNet-12.
    assert n_params == _resnet12_params((64, 160, 320, 640), 3, 5) == 12_427_525
    assert [b.conv3.out_channels for b in blocks] == [64, 160, 320, 640]
    assert model.input_shape == (3, 84, 84) and model.feature_dim == 640
    assert all(isinstance(b.relu, nn.LeakyReLU) and b.relu.negative_slope == 0.1 for b in blocks)
    assert all(b.conv1.bias is None and b.shortcut[0].kernel_size == (1, 1) for b in blocks)
    assert model.inner_param_names() == ["head.weight", "head.bias"]
    assert len(model.outer_param_names()) == 4 * (3 + 1) * 3  # conv + BN weight + BN bias


@pytest.mark.parametrize(
    ("in_channels", "image_size", "final_size"), [(1, 28, 1), (3, 32, 2), (3, 84, 5)]
)
def test_resnet12_halves_the_resolution_per_block(
    in_channels: int, image_size: int, final_size: int
) -> None:
    # Arrange
    model = ResNet12(classes=5, in_channels=in_channels, image_size=image_size, width_scale=0.1)

    # Act
    with torch.no_grad():
        features = model.layers(model.example_input(2))
        logits = model(model.example_input(2))

    # Assert
    assert features.shape == (2, 64, final_size, final_size)  # round(640 * 0.1)
    assert logits.shape == (2, 5)


def test_resnet12_plan_has_three_groups_per_block_and_couples_the_residual() -> None:
    # Arrange
    _, plan = _setup("resnet12_narrow")
    kept, idx = _index_sets("resnet12_narrow", "importance", 0.5)

    # Act
    groups = set(plan.groups)

    # Assert: conv1 and conv2 of each block, and its residual group (conv3 + shortcut).
    assert groups == {f"layers.{b}.{n}" for b in range(4) for n in ("conv1", "conv2", "shortcut.0")}
    for b in range(4):
        out3, short = idx[f"layers.{b}.conv3.weight"][0], idx[f"layers.{b}.shortcut.0.weight"][0]
        assert torch.equal(out3, short)
        if b < 3:  # the next block's conv1 and shortcut read the same channels
            assert torch.equal(idx[f"layers.{b + 1}.conv1.weight"][1], out3)
            assert torch.equal(idx[f"layers.{b + 1}.shortcut.0.weight"][1], out3)
    assert torch.equal(idx["head.weight"][1], idx["layers.3.conv3.weight"][0])


def test_cnn7_is_fednest_lenet5() -> None:
    # Arrange
    model = CNN7()

    # Act
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.endswith("weight")}

    # Assert: FedNest's CNNCifar (ucr-optml/FedNest, models/Nets.py).
    assert shapes == {
        "features.0.weight": (6, 3, 5, 5),
        "features.3.weight": (16, 6, 5, 5),
        "body.0.weight": (120, 400),
        "body.2.weight": (84, 120),
        "head.weight": (10, 84),
    }
    assert sum(p.numel() for p in model.parameters()) == 62_006
    assert model.inner_param_names() == ["head.weight", "head.bias"]


def test_cnn7_flatten_maps_each_conv_channel_to_a_block_of_fc_columns() -> None:
    # Arrange
    _, plan = _setup("cnn7")
    kept, idx = _index_sets("cnn7", "importance", 0.5)

    # Act
    columns = idx["body.0.weight"][1]

    # Assert: 16 channels x 5 x 5 positions, channel-major as in torch.flatten.
    expected = (kept["features.3"].sort().values[:, None] * 25 + torch.arange(25)).flatten()
    assert torch.equal(columns, expected)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ResNet12(widths=(64, 160, 320)), "4 positive stage widths"),
        (lambda: ResNet12(width_scale=0.0), "width_scale must be positive"),
        (lambda: ResNet12(image_size=8), "image_size must be at least 16"),
        (lambda: ResNet12(classes=0), "classes and in_channels must be positive"),
        (lambda: CNN7(image_size=12), "image_size >= 16"),
        (lambda: CNN7(channels=(6, 16, 32)), "two conv and two hidden"),
        (lambda: CNN7(hidden=(0, 84)), "sizes must be positive"),
    ],
)
def test_bad_sizes_are_clear_errors(factory: Callable[[], nn.Module], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        factory()


def test_zoo_flops_shrink_about_quadratically() -> None:
    """Sanity link to benchmarks/extraction.py: conv-net cost at r = 1/2 is about r^2 of full."""
    from radbo.flops import training_step_flops

    # Arrange
    model, plan = _setup("resnet12_narrow")
    _, idx = _index_sets("resnet12_narrow", "leading", 0.5)

    # Act
    ratio = training_step_flops(plan.submodel(idx), 2) / training_step_flops(model, 2)

    # Assert: all widths halve except the 3 input channels, so between r^2 and r (a ratio of
    # integer FLOP counts taken from shapes: the same on every CPU).
    assert math.isclose(ratio, 0.25, abs_tol=0.03)


@pytest.mark.parametrize("module_name", ["radbo.models.resnet12", "radbo.models.cnn7"])
def test_docstring_examples(module_name: str) -> None:
    import doctest
    import importlib

    failures, tried = doctest.testmod(importlib.import_module(module_name))
    assert tried > 0 and failures == 0
