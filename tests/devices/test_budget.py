"""Device budgets (radbo.devices.budget): memory model vs measured peak, capacity r, steps τ."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from radbo.devices.budget import (
    DEFAULT_LEVELS,
    BudgetPlanner,
    DeviceTooSmallError,
    MemoryEstimate,
    capacity_for,
    estimate_training_memory,
    local_steps_for,
    measure_peak_memory,
)
from radbo.devices.profile import DeviceProfile
from radbo.flops import training_step_flops
from radbo.hypergrad import FiniteDifference, ImplicitCG
from radbo.masks.structure import StructurePlan
from radbo.models import MLP, SmallCNN
from radbo.models.base import BilevelModel
from radbo.problem import Batch, bind_losses
from radbo.tasks import HyperRepresentation

MB = 1_000_000


def _profile(name: str = "dev", **kw: float | int) -> DeviceProfile:
    fields: dict[str, float | int] = dict(
        compute_flops=1e9, memory_bytes=10**9, uplink_bps=1e6, downlink_bps=1e7
    )
    fields.update(kw)
    return DeviceProfile(name=name, **fields)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- measure_peak_memory


@pytest.mark.parametrize("method", ["allocator", "dispatch"])
def test_measure_peak_memory_known_case(method: str) -> None:
    # Three 1 MB tensors, free one, allocate another: never more than 3 MB live at once.
    def three_then_one() -> None:
        a = torch.empty(MB // 4)
        b = torch.empty(MB // 4)
        c = torch.empty(MB // 4)
        del b
        d = torch.empty(MB // 4)
        del a, c, d

    assert measure_peak_memory(three_then_one, method=method) == 3 * MB  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["allocator", "dispatch"])
def test_measure_peak_memory_views_inplace_and_existing(method: str) -> None:
    existing = torch.zeros(MB // 4)

    def views_and_inplace() -> None:
        a = torch.zeros(MB // 4)  # 1 MB
        v = a.view(500, 500)[:10]  # a view: nothing new
        v.add_(1.0)  # in place: nothing new
        existing.mul_(2.0)  # in place on memory that existed before fn: nothing new
        del a, v

    # The allocator also sees the few bytes of the wrapped Python scalars 1.0 and 2.0.
    peak = measure_peak_memory(views_and_inplace, method=method)  # type: ignore[arg-type]
    assert MB <= peak <= MB + 64
    assert measure_peak_memory(lambda: existing.add_(1.0), method=method) <= 64  # type: ignore[arg-type]


def test_measure_peak_memory_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="method"):
        measure_peak_memory(lambda: None, method="rss")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- memory model


def test_estimate_components_by_hand() -> None:
    # MLP 64 -> 32 -> 10, batch 8, float32.
    model = MLP(64, [32], 10)
    weights = (64 * 32 + 32 + 32 * 10 + 10) * 4  # 9640
    x_bytes, y_bytes = (64 * 32 + 32) * 4, (32 * 10 + 10) * 4
    # Saved for backward: the input batch (layer 1's weight grad), the ReLU output (ReLU's
    # backward and the head's weight grad share it), the log-softmax output, the int64 targets
    # and NLL's scalar total weight. The weights themselves are saved too but are not counted
    # twice. Backward working set: twice the largest saved tensor (the input batch).
    saved = 8 * 64 * 4 + 8 * 32 * 4 + 8 * 10 * 4 + 8 * 8 + 4  # 3460
    activations = saved + 2 * 8 * 64 * 4

    est = estimate_training_memory(model, 8, hypergradient="none")
    assert est == MemoryEstimate(weights, weights, 0, activations, 0)
    assert est.total == 2 * weights + activations == 26836

    adam = estimate_training_memory(model, 8, optimizer_slots=2, hypergradient="none")
    assert adam.optimizer_state == 2 * weights
    first = estimate_training_memory(model, 8, hypergradient="first_order")
    assert first.hypergradient == 2 * y_bytes
    fd = estimate_training_memory(model, 8, hypergradient="finite_difference")
    assert fd.hypergradient == 2 * x_bytes + 7 * y_bytes
    # the configured estimator: coordinate_batch = 5 holds 4 more points at once, each a
    # shifted x, a y, its gradient and one backward's activations
    assert estimate_training_memory(model, 8, hypergradient=FiniteDifference()) == fd
    batched = estimate_training_memory(model, 8, hypergradient=FiniteDifference(coordinate_batch=5))
    assert batched.hypergradient == fd.hypergradient + 4 * (x_bytes + 2 * y_bytes + activations)
    implicit = estimate_training_memory(model, 8, hypergradient="implicit")
    # A second set of saved activations, 4|y| CG vectors, ∇f (|x|+|y|), ∇²_xy g·v and the
    # result (2|x|), plus what the create_graph backward saves for double backward (> 0).
    floor = saved + 4 * y_bytes + (x_bytes + y_bytes) + 2 * x_bytes
    assert implicit.hypergradient > floor


def test_estimate_does_not_touch_module_and_validates() -> None:
    model = SmallCNN()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    estimate_training_memory(model, 4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="batch_size"):
        estimate_training_memory(model, 0)
    with pytest.raises(ValueError, match="optimizer_slots"):
        estimate_training_memory(model, 1, optimizer_slots=-1)
    with pytest.raises(ValueError, match="hypergradient"):
        estimate_training_memory(model, 1, hypergradient="exact")  # type: ignore[arg-type]


def _step_and_round(
    model: BilevelModel, batch: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A plain SGD training step, and a bilevel round: that step, then an ImplicitCG call.

    Batches are drawn inside the functions (they are part of the footprint) from an explicit
    generator; the weights exist before and are added by the caller.
    """
    gen = torch.Generator().manual_seed(0)
    params = dict(model.named_parameters())

    def draw() -> Batch:
        return Batch(
            torch.randn(batch, *model.input_shape, generator=gen),
            torch.randint(0, 10, (batch,), generator=gen),
        )

    def step() -> None:
        b = draw()
        F.cross_entropy(model(b.inputs), b.targets).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.01 * p.grad)

    def round_() -> None:
        step()
        x = {n: params[n].detach() for n in model.outer_param_names()}
        y = {n: params[n].detach() for n in model.inner_param_names()}
        outer, inner = bind_losses(
            HyperRepresentation(), model, dict(model.named_buffers()), draw(), draw()
        )
        ImplicitCG(max_iter=5)(outer, inner, x, y)

    return step, round_


@pytest.mark.parametrize(("model", "batch"), [(MLP(64, [128], 10), 64), (SmallCNN(), 32)])
def test_estimate_matches_measured_peak(model: BilevelModel, batch: int) -> None:
    """The memory model is within ±35 % of the measured peak (weights + measured peak).

    Tolerance: the activation term is exact (autograd's saved tensors), but the backward
    working set (2 x the largest saved tensor) is a rule of thumb, backward releases saved
    tensors progressively, and the model adds the hypergradient's buffers to the training
    step's although the two run one after the other. The estimate should err on the high
    side (a budget that fits must really fit), so it must also be at least 95 % of measured.

    Measured on torch 2.13 CPU (allocator method; the dispatch method agrees within 300 B),
    byte for byte the same under the default, AVX2 and AVX-512 kernels (bytes, not rounding):

    ==================  =========  ==========  ====================  =========  ==========
    model, batch        step meas  step est    round (step+CG) meas  round est  est/meas
    ==================  =========  ==========  ====================  =========  ==========
    MLP(64,[128],10),64   158 808    194 644                306 428    377 632  1.23 / 1.23
    SmallCNN, 32        1 349 720  1 387 092              1 969 720  2 287 520  1.03 / 1.16
    ==================  =========  ==========  ====================  =========  ==========
    """
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    step, round_ = _step_and_round(model, batch)

    measured_step = weights + measure_peak_memory(step)
    for p in model.parameters():
        p.grad = None
    measured_round = weights + measure_peak_memory(round_)
    for p in model.parameters():
        p.grad = None
    est_step = estimate_training_memory(model, batch, hypergradient="none").total
    est_round = estimate_training_memory(model, batch, hypergradient="implicit").total

    for est, measured in [(est_step, measured_step), (est_round, measured_round)]:
        assert 0.95 * measured <= est <= 1.35 * measured, (est, measured)


# --------------------------------------------------------------------------- budget functions


def _square(r: float) -> int:
    return int(1000 * r * r)


def test_capacity_for_hand_cases() -> None:
    assert capacity_for(SimpleNamespace(name="a", memory_bytes=300), _square) == 0.5
    assert capacity_for(_profile(memory_bytes=1000), _square) == 1.0
    assert capacity_for(_profile(memory_bytes=250), _square) == 0.5  # boundary fits
    assert capacity_for(_profile(memory_bytes=249), _square) == 0.25
    assert capacity_for(_profile(memory_bytes=300), _square, levels=(0.25, 1.0)) == 0.25


def test_capacity_for_too_small_names_device_and_numbers() -> None:
    with pytest.raises(DeviceTooSmallError) as err:
        capacity_for(_profile("tiny-mcu", memory_bytes=1), _square)
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "tiny-mcu" in message
    assert " 1 bytes" in message  # the device's memory
    assert str(_square(0.0625)) in message and "0.0625" in message  # smallest submodel: 3 B


@pytest.mark.parametrize("levels", [(), (0.0,), (1.5,), (0.5, -0.1), (float("nan"),), (True,)])
def test_capacity_for_validates_levels(levels: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="level"):
        capacity_for(_profile(), _square, levels=levels)


def test_local_steps_for_hand_computed() -> None:
    device = _profile(compute_flops=1e9)
    # a step takes 1e8 / 1e9 = 0.1 s; (2.05 - 0.5) / 0.1 = 15.5 -> 15
    assert local_steps_for(device, 1e8, 2.05, fixed_s=0.5) == 15
    assert local_steps_for(device, 1e8, 2.0, fixed_s=0.5) == 15  # 1.5 / 0.1, float noise
    assert local_steps_for(device, 1e8, 1.0) == 10
    # too slow for one step, or communication alone past the deadline: still one step
    assert local_steps_for(_profile(compute_flops=1e3), 1e8, 2.05) == 1
    assert local_steps_for(device, 1e8, 1.0, fixed_s=5.0) == 1


@pytest.mark.parametrize(
    ("step", "deadline", "fixed"),
    [
        (0.0, 1.0, 0.0),
        (1e8, float("inf"), 0.0),
        (1e8, -1.0, 0.0),
        (1e8, 1.0, -0.1),
        (float("nan"), 1.0, 0.0),
    ],
)
def test_local_steps_for_validates(step: float, deadline: float, fixed: float) -> None:
    with pytest.raises(ValueError, match="finite number"):
        local_steps_for(_profile(), step, deadline, fixed_s=fixed)


# --------------------------------------------------------------------------- planner


@lru_cache(maxsize=1)
def _mlp_planner() -> BudgetPlanner:
    model = MLP(64, [128], 10)
    plan = StructurePlan(model, model.example_input(1), model.output_layers)
    return BudgetPlanner(plan, 32)


def test_planner_caches_per_level_costs() -> None:
    planner = _mlp_planner()
    full = planner.plan.model
    assert planner.param_bytes_at(1.0) == sum(p.numel() * 4 for p in full.parameters())
    assert planner.step_flops_at(1.0) == training_step_flops(full, 32)
    assert planner.memory_at(1.0) == estimate_training_memory(full, 32)
    # hidden width 128 -> 64: layer 1 is 64x64 (+64), head 10x64 (+10)
    assert planner.param_bytes_at(0.5) == (64 * 64 + 64 + 10 * 64 + 10) * 4
    totals = [planner.memory_at(r).total for r in DEFAULT_LEVELS]
    assert totals == sorted(totals, reverse=True)
    assert planner.memory_at(0.5) is planner.memory_at(0.5)  # cached


def test_planner_budget_hand_computed() -> None:
    planner = _mlp_planner()
    memory = planner.memory_at(0.5).total + 1  # fits r = 1/2, not r = 1
    device = _profile(
        "pi", compute_flops=1e8, memory_bytes=memory, uplink_bps=1e6, downlink_bps=1e7
    )

    budget = planner.budget(device, deadline_s=1.0)

    step_s = planner.step_flops_at(0.5) / 1e8
    comm_s = 8 * planner.param_bytes_at(0.5) * (1 / 1e7 + 1 / 1e6)
    tau = math.floor((1.0 - comm_s - 3.0 * step_s) / step_s)
    assert budget.capacity == 0.5 and budget.memory_fits
    # Python float64 arithmetic, a handful of operations on each side: rel 1e-12 is 1e4 x the
    # rounding (no tensor kernels involved)
    assert budget.comm_time_s == pytest.approx(comm_s, rel=1e-12)
    assert budget.step_time_s == pytest.approx(step_s, rel=1e-12)
    assert budget.local_steps == tau > 1
    assert budget.round_time_s == pytest.approx(comm_s + (tau + 3.0) * step_s, rel=1e-12)
    assert budget.round_time_s <= 1.0


def test_planner_too_small_device() -> None:
    planner = _mlp_planner()
    device = _profile("watch", memory_bytes=1000)
    with pytest.raises(DeviceTooSmallError, match="watch"):
        planner.budget(device, 1.0)
    oversize = planner.budget(device, 1.0, allow_oversize=True)
    assert oversize.capacity == 0.0625 and not oversize.memory_fits


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    compute=st.floats(1e3, 1e15),
    memory=st.integers(10**3, 10**12),
    up=st.floats(1e3, 1e10),
    down=st.floats(1e3, 1e10),
    deadline=st.floats(1e-3, 1e5),
)
def test_planner_budget_property(
    compute: float, memory: int, up: float, down: float, deadline: float
) -> None:
    planner = _mlp_planner()
    device = _profile(compute_flops=compute, memory_bytes=memory, uplink_bps=up, downlink_bps=down)
    try:
        budget = planner.budget(device, deadline)
    except DeviceTooSmallError:
        assert planner.memory_at(min(DEFAULT_LEVELS)).total > memory
        return
    assert 0.0 < budget.capacity <= 1.0 and budget.capacity in DEFAULT_LEVELS
    assert isinstance(budget.local_steps, int) and budget.local_steps >= 1
    assert budget.memory_fits and budget.memory.total <= memory
    bigger = [r for r in DEFAULT_LEVELS if r > budget.capacity]
    assert all(planner.memory_at(r).total > memory for r in bigger)
    times = (budget.step_time_s, budget.comm_time_s, budget.round_time_s)
    assert all(math.isfinite(t) and t > 0 for t in times)
    if budget.local_steps > 1:  # more than the minimum: the round fits the deadline
        assert budget.round_time_s <= deadline * (1 + 1e-9)


def test_planner_validates() -> None:
    plan = _mlp_planner().plan
    with pytest.raises(ValueError, match="batch_size"):
        BudgetPlanner(plan, 0)
    with pytest.raises(ValueError, match="level"):
        BudgetPlanner(plan, 8, levels=())
    with pytest.raises(ValueError, match="optimizer_slots"):
        BudgetPlanner(plan, 8, optimizer_slots=-1)
    with pytest.raises(ValueError, match="hypergradient"):
        BudgetPlanner(plan, 8, hypergradient="magic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="deadline_s"):
        _mlp_planner().budget(_profile(), 0.0)


def test_budget_module_has_no_side_effects_on_plan_model() -> None:
    planner = _mlp_planner()
    model: nn.Module = planner.plan.model
    assert all(p.grad is None for p in model.parameters())
