"""The zoo's functional forward passes (``BilevelModel.functional_forward``) against
``torch.func.functional_call``: the same aten ops in the same order, so outputs, gradients,
second-order products and BatchNorm buffers are bitwise equal, on full models and pruned
skeletons, in training and eval mode, under ``torch.vmap``, and over whole runs (sequential and
batched backends, BatchNorm aggregated and static). Where there is no functional form (a hook,
an unknown layer, a subclass overriding ``forward``, names that do not match), ``forward``
falls back to ``functional_call``.

Bitwise equality between the two paths holds on any CPU because both dispatch the same aten
ops on tensors of the same shapes, dtypes and strides, so whichever kernels
``ATEN_CPU_CAPABILITY`` selects run on both (float32 included); it fails only if one path
changes an op, a layout or an order of evaluation. The module is marked ``float_sensitive``
(issue 25) so that CI checks this under every kernel the machine offers; measured bitwise equal
under the default, AVX2 and AVX-512 kernels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

import radbo
import radbo.problem as problem_module
from radbo.masks import LeadingPolicy, StructurePlan
from radbo.models import (
    CNN7,
    MLP,
    VSMLP,
    BilevelModel,
    Conv4,
    FeatureL2Logistic,
    ResNet12,
    ResNet18,
    SmallCNN,
    VSResNet18,
)
from radbo.problem import calibrate_batchnorm, forward, module_calls_only
from radbo.typing import Params
from tests.configs import small_config

pytestmark = pytest.mark.float_sensitive

ZOO: dict[str, Callable[[], BilevelModel]] = {
    "mlp": lambda: MLP(64, [32, 16], 10),
    "vs_mlp": lambda: VSMLP(64, [16], 10),
    "logistic": lambda: FeatureL2Logistic(64, 10),
    "cnn7": lambda: CNN7(10, 1, 16),
    "conv4": lambda: Conv4(1, 8, 8, 5),
    "cnn": lambda: SmallCNN(1, 8, [4, 8], 10),
    "resnet18": lambda: ResNet18(10, 3, 9, [4, 8, 8, 8]),
    "vs_resnet18": lambda: VSResNet18(10, 3, 9, [4, 8, 8, 8]),
    "resnet12": lambda: ResNet12(5, 1, 16, width_scale=0.05),
}


def randomized(model: BilevelModel, dtype: torch.dtype, seed: int = 0) -> BilevelModel:
    """``model`` in ``dtype`` with every floating tensor (BN statistics too) random."""
    model = model.to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                values = 0.5 * torch.randn(t.shape, generator=gen, dtype=dtype)
                t.copy_(values.abs() + 0.5 if name.endswith("running_var") else values)
    return model


def split(model: nn.Module, state: Params) -> tuple[Params, Params, Params]:
    """(x, y, buffers): fresh leaves that require grad, and fresh buffers."""
    assert isinstance(model, BilevelModel)
    outer, inner = set(model.outer_param_names()), set(model.inner_param_names())
    x = {k: v.detach().clone().requires_grad_() for k, v in state.items() if k in outer}
    y = {k: v.detach().clone().requires_grad_() for k, v in state.items() if k in inner}
    b = {k: v.clone() for k, v in state.items() if k not in outer and k not in inner}
    return x, y, b


def derivatives(
    module: nn.Module, state: Params, inputs: Tensor
) -> tuple[list[Tensor | None], Params]:
    """Output, gradient of a scalar in (x, y), the y-y and x-y second-order products along a
    fixed direction, and the buffers after the pass."""
    x, y, b = split(module, state)
    out = forward(module, x, y, b, inputs)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum()
    loss = loss + (out * out).sum()
    leaves = [*x.values(), *y.values()]
    grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    grads = tuple(
        torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)
    )
    gy = grads[len(x) :]
    v = [torch.cos(torch.arange(g.numel(), dtype=g.dtype)).reshape(g.shape) for g in gy]
    dot = sum((g * w).sum() for g, w in zip(gy, v, strict=True))
    assert isinstance(dot, Tensor)
    second = torch.autograd.grad(dot, leaves, allow_unused=True)
    return [out, *grads, *second], b


def assert_same(a: list[Tensor | None], b: list[Tensor | None]) -> None:
    assert len(a) == len(b)
    for i, (s, t) in enumerate(zip(a, b, strict=True)):
        assert (s is None) == (t is None), i
        if s is not None:
            assert t is not None and s.dtype == t.dtype and torch.equal(s, t), i


def both_paths(module: nn.Module, state: Params, inputs: Tensor) -> None:
    """The functional form is taken, and every number equals functional_call's bitwise."""
    assert isinstance(module, BilevelModel)
    assert module.functional_forward(dict(state), inputs) is not None
    fast, fast_buffers = derivatives(module, state, inputs)
    with module_calls_only():
        slow, slow_buffers = derivatives(module, state, inputs)
    assert_same(fast, slow)
    assert fast_buffers.keys() == slow_buffers.keys()
    for k in fast_buffers:
        assert torch.equal(fast_buffers[k], slow_buffers[k]), k
        # training mode moved the running statistics (both paths alike)
        if module.training and k.endswith("num_batches_tracked"):
            assert int(fast_buffers[k]) == int(state[k]) + 1


def example(model: BilevelModel, batch: int, dtype: torch.dtype) -> Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, *model.input_shape, generator=gen, dtype=dtype)


# --------------------------------------------------------------------------- layer level
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(ZOO))
def test_functional_forward_equals_functional_call_bitwise(name, training, dtype) -> None:
    model = randomized(ZOO[name](), dtype)
    model.train(training)
    both_paths(model, model.state_dict(), example(model, 6, dtype))


@pytest.mark.parametrize("name", ["mlp", "cnn", "conv4", "cnn7"])
def test_pruned_skeleton_uses_its_own_shapes_bitwise(name) -> None:
    """A half-width submodel (Torch-Pruning skeleton, built from a meta copy) takes the
    functional path with the submodel's shapes."""
    model = randomized(ZOO[name](), torch.float64)
    plan = StructurePlan(model, model.example_input(1), model.output_layers)
    kept = LeadingPolicy()(
        plan,
        {g: 0.5 for g in plan.groups},
        round=0,
        client=0,
        generator=torch.Generator().manual_seed(0),
    )
    sub = plan.submodel(plan.index_sets(kept))
    sub.train()
    state = sub.state_dict()
    assert sum(t.numel() for t in state.values()) < sum(
        t.numel() for t in model.state_dict().values()
    )
    both_paths(sub, state, example(model, 5, torch.float64))


@pytest.mark.parametrize("name", ["conv4", "cnn", "resnet18"])
def test_static_batchnorm_calibration_is_bitwise_the_same(name) -> None:
    """Calibration sets ``momentum = None`` (cumulative average, ``1 / num_batches_tracked``)."""
    model = randomized(ZOO[name](), torch.float64)
    x, y, b = split(model, model.state_dict())
    inputs = example(model, 7, torch.float64)
    fast = calibrate_batchnorm(model, x, y, b, inputs)
    with module_calls_only():
        slow = calibrate_batchnorm(model, x, y, b, inputs)
    assert fast.keys() == slow.keys() and fast
    for k in fast:
        assert torch.equal(fast[k], slow[k]), k
    assert all(m.momentum == 0.1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))


@pytest.mark.parametrize("name", ["mlp", "conv4"])
def test_functional_forward_under_vmap_is_bitwise_the_same(name) -> None:
    """Three clients' stacked tensors under ``torch.vmap`` (the batched backend's shape), with
    gradients through the vmapped losses; per-client BN buffers updated alike."""
    model = randomized(ZOO[name](), torch.float64)
    model.train()
    clients = [randomized(ZOO[name](), torch.float64, seed=s).state_dict() for s in (1, 2, 3)]
    stacked = {k: torch.stack([c[k] for c in clients]) for k in clients[0]}
    inputs = torch.stack([example(model, 4, torch.float64) + s for s in range(3)])

    def run() -> tuple[list[Tensor | None], Params]:
        x, y, b = split(model, stacked)

        def one(x_: Params, y_: Params, b_: Params, inp: Tensor) -> Tensor:
            return forward(model, x_, y_, b_, inp).square().sum()

        losses = torch.vmap(one)(x, y, b, inputs)
        grads = torch.autograd.grad(losses.sum(), [*x.values(), *y.values()])
        return [losses, *grads], b

    fast, fast_b = run()
    with module_calls_only():
        slow, slow_b = run()
    assert_same(fast, slow)
    for k in fast_b:
        assert torch.equal(fast_b[k], slow_b[k]), k


# ---------------------------------------------------------------------- when it falls back
def test_a_forward_hook_sends_the_call_through_the_module() -> None:
    model = randomized(ZOO["mlp"](), torch.float64)
    inputs = example(model, 3, torch.float64)
    x, y, b = split(model, model.state_dict())
    seen: list[Tensor] = []
    handle = model.head.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    try:
        assert model.functional_forward(model.state_dict(), inputs) is None
        out = forward(model, x, y, b, inputs)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == (3, 16)
    assert torch.equal(out, forward(model, x, y, b, inputs))


def test_flop_counter_sees_the_same_operations() -> None:
    """FlopCounterMode installs global module hooks: the call goes through the module, and the
    FLOPs are those of the functional form's ops."""
    model = randomized(ZOO["cnn7"](), torch.float64)
    inputs = example(model, 4, torch.float64)
    x, y, b = split(model, model.state_dict())
    with FlopCounterMode(display=False) as counter:
        assert model.functional_forward(model.state_dict(), inputs) is None
        forward(model, x, y, b, inputs)
    with FlopCounterMode(display=False) as direct:
        model._functional_forward(model.state_dict(), inputs)
    assert counter.get_total_flops() == direct.get_total_flops() > 0


class _TanhMLP(MLP):
    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(super().forward(x))


def test_a_subclass_overriding_forward_alone_has_no_functional_form() -> None:
    model = randomized(_TanhMLP(64, [8], 3), torch.float64)
    inputs = example(model, 3, torch.float64)
    x, y, b = split(model, model.state_dict())
    assert model.functional_forward(model.state_dict(), inputs) is None
    assert torch.equal(forward(model, x, y, b, inputs), model(inputs))


def test_a_layer_without_a_rule_has_no_functional_form() -> None:
    model = randomized(MLP(64, [8], 3), torch.float64)
    model.body[1] = nn.Tanh()
    inputs = example(model, 3, torch.float64)
    x, y, b = split(model, model.state_dict())
    assert model.functional_forward(model.state_dict(), inputs) is None
    assert torch.equal(forward(model, x, y, b, inputs), model(inputs))


def test_names_that_do_not_match_get_functional_calls_error() -> None:
    model = randomized(ZOO["mlp"](), torch.float64)
    inputs = example(model, 3, torch.float64)
    x, y, b = split(model, model.state_dict())
    with pytest.raises(RuntimeError, match="Missing key"):
        forward(model, x, {}, b, inputs)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        forward(model, x, y, {"extra": torch.zeros(1)}, inputs)


def test_module_calls_only_restores_the_switch() -> None:
    with pytest.raises(KeyError):
        with module_calls_only():
            assert not problem_module._functional_forms
            raise KeyError("boom")
    assert problem_module._functional_forms


# ------------------------------------------------------------------------------ whole runs
def tensors(value: object, path: str = "") -> Iterator[tuple[str, Tensor]]:
    """Every tensor in a (nested) state: dataclasses, mappings, sequences."""
    if isinstance(value, Tensor):
        yield path, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from tensors(v, f"{path}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            yield from tensors(v, f"{path}[{i}]")


def unclocked(rows: object) -> object:
    """``rows`` without the measured wall-clock times (everything else is deterministic)."""
    if isinstance(rows, dict):
        return {k: unclocked(v) for k, v in rows.items() if "wall" not in k}
    if isinstance(rows, list):
        return [unclocked(v) for v in rows]
    return rows


def assert_runs_identical(a: radbo.RunResult, b: radbo.RunResult) -> None:
    # every metric, FLOPs, bytes and simulated time included, exactly
    assert unclocked(a.rounds) == unclocked(b.rounds)
    assert unclocked([a.final, a.totals, a.ledger]) == unclocked([b.final, b.totals, b.ledger])
    ta, tb = dict(tensors(a.state)), dict(tensors(b.state))
    assert ta.keys() == tb.keys() and ta
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert (a.baseline is None) == (b.baseline is None)
    if a.baseline is not None and b.baseline is not None:
        assert_runs_identical(a.baseline, b.baseline)


@pytest.fixture
def forms_taken(monkeypatch) -> list[int]:
    """How many forward passes took a functional form (spy on BilevelModel)."""
    taken = [0]
    original = BilevelModel.functional_forward

    def spy(self: BilevelModel, state: Params, inputs: Tensor) -> Tensor | None:
        out = original(self, state, inputs)
        taken[0] += out is not None
        return out

    monkeypatch.setattr(BilevelModel, "functional_forward", spy)
    return taken


RUNS = {
    "demo": dict(rounds=3, eval_every=1),
    "demo_batched": dict(rounds=3, eval_every=1, runtime={"backend": "batched"}),
    "cnn_static_bn": dict(
        rounds=2,
        eval_every=1,
        model={"name": "cnn", "channels": [4, 8], "batchnorm": "static"},
        baseline={"enabled": False},
    ),
    "cnn_bn_batched": dict(
        rounds=2,
        eval_every=1,
        model={"name": "cnn", "channels": [4, 8]},
        runtime={"backend": "batched"},
        baseline={"enabled": False},
    ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_whole_run_is_bitwise_the_same_with_and_without_functional_forms(name, forms_taken) -> None:
    config = small_config(**RUNS[name])
    fast = radbo.run(config, progress=False, save=False)
    taken = forms_taken[0]
    assert taken > 0
    with module_calls_only():
        slow = radbo.run(config, progress=False, save=False)
    assert forms_taken[0] == taken  # forced off: no functional form was evaluated
    assert_runs_identical(fast, slow)


def test_functional_call_is_the_reference() -> None:
    """The switch really selects torch.func.functional_call (the path the runs compare to)."""
    model = randomized(ZOO["mlp"](), torch.float64)
    inputs = example(model, 3, torch.float64)
    x, y, b = split(model, model.state_dict())
    with module_calls_only():
        out = forward(model, x, y, b, inputs)
    assert torch.equal(out, functional_call(model, {**x, **y, **b}, (inputs,)))
