"""The FLOP meter off the hot path (issue 12): the lean counter counts what FlopCounterMode
counts, and composing CG workloads from a verified line leaves every ledger entry exactly as
measuring each workload would."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from radbo.autodiff import solve_cg
from radbo.config import load_config, parse_config
from radbo.cost import FlopMeter, _exact_line
from radbo.experiment import build
from radbo.flops import count_flops, new_scope, repeated
from radbo.loops import cg_iteration_flops, cg_product
from radbo.models import CNN7, Conv4
from tests.algorithms.test_algorithm_conformance import CASES
from tests.algorithms.test_algorithm_conformance import config as conformance_config
from tests.helpers import state_tensors


def reference(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def hvp_workload(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
    params = list(model.parameters())

    def run() -> None:
        loss = F.cross_entropy(model(inputs), targets)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        torch.autograd.grad(sum((g * g).sum() for g in grads), params)

    return run


@pytest.mark.parametrize(
    "build_model, shape",
    [
        (lambda: nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4)), (12,)),
        (lambda: Conv4(in_channels=1, image_size=16, width=8, classes=4), (1, 16, 16)),
        (lambda: CNN7(classes=4, in_channels=1, image_size=16), (1, 16, 16)),
    ],
)
def test_the_lean_counter_counts_what_flop_counter_mode_counts(build_model, shape):
    """Forward, backward and double backward (HVP) through linear, conv and BatchNorm layers:
    the same integer as FlopCounterMode.get_total_flops()."""
    torch.manual_seed(0)
    model = build_model().double()
    inputs = torch.randn(6, *shape, dtype=torch.float64)
    targets = torch.arange(6) % 4
    run = hvp_workload(model, inputs, targets)
    expected = reference(run)
    assert expected > 0
    assert count_flops(run) == expected


def test_exact_line_needs_integer_collinear_points():
    assert _exact_line({2: 120, 5: 300, 9: 540}) == (2, 120, 60)
    assert _exact_line({2: 120, 5: 300, 9: 541}) is None  # off by one FLOP
    assert _exact_line({1: 10, 3: 15, 5: 20}) is None  # slope 2.5 is not an integer


def test_the_meter_composes_a_family_only_after_three_collinear_measurements():
    meter = FlopMeter()
    calls: list[int] = []

    def product(k: int):
        a, b = torch.ones(2, 3), torch.ones(3, 4)

        def run() -> None:
            calls.append(k)
            _ = torch.ones(5, 7) @ torch.ones(7, 2)  # the base: 140 FLOPs
            for _ in range(k):
                _ = a @ b  # 48 FLOPs per unit

        return run

    for k in (3, 1, 4):
        assert meter.flops(("outer",), product(k), linear=k) == 140 + 48 * k
    assert meter.measurements == 3 and calls == [3, 1, 4]
    # the family is verified: new counts are composed, not run
    assert meter.flops(("outer",), product(9), linear=9) == 140 + 48 * 9
    assert meter.flops(("outer",), product(0), linear=0) == 140
    assert meter.measurements == 3 and calls == [3, 1, 4]
    # another family (different key) is measured on its own
    assert meter.flops(("inner",), product(2), linear=2) == 140 + 96
    assert meter.measurements == 4


def test_a_family_that_is_not_affine_keeps_being_measured():
    meter = FlopMeter()

    def quadratic(k: int):
        return lambda: torch.ones(k + 1, 3) @ torch.ones(3, k + 1)  # 6 (k+1)^2 FLOPs

    for k in range(6):
        assert meter.flops(("q",), quadratic(k), linear=k) == 6 * (k + 1) ** 2
    assert meter.measurements == 6


def ledger_flops(config, compose: bool, rounds: int) -> tuple[list[tuple], FlopMeter]:
    exp = build(config)
    sim = exp.simulation
    sim.flop_meter = meter = FlopMeter(compose=compose)
    state = exp.initial_state
    rows = []
    for r in range(rounds):
        state, record = sim.step(state, r)
        rows += [(e.round, e.phase, e.client, e.flops, e.n_hvp) for e in record.ledger]
        if r == 0:
            meter.after_round_0 = meter.measurements  # type: ignore[attr-defined]
    return rows, meter


def test_the_demo_ledger_is_unchanged_by_composition():
    config = load_config("examples/demo.toml")
    composed, meter = ledger_flops(config, compose=True, rounds=6)
    measured, reference_meter = ledger_flops(config, compose=False, rounds=6)
    assert composed == measured
    assert meter.measurements <= reference_meter.measurements


def test_the_cnn_ledger_is_unchanged_when_cg_workloads_are_composed():
    """CNN7 on 16x16 digits: the CG iteration count changes between rounds; measured, each new
    count is a new workload (rounds 2 and 7 re-measured three each on this config); composed
    (the line of a family known from its first count, whose CG iterations are repeated blocks),
    the ledger's FLOPs are the same integers and no round after round 0 measures anything."""
    config = parse_config(
        {"seed": 0, "data": {"name": "digits", "image_size": 16}, "model": {"name": "cnn7"}}
    )
    composed, meter = ledger_flops(config, compose=True, rounds=12)
    measured, reference_meter = ledger_flops(config, compose=False, rounds=12)
    assert composed == measured
    hvp_counts = {row[4] for row in measured if row[1].endswith("outer")}
    assert len(hvp_counts) > 3  # the CG stopped after several different iteration counts
    assert len(meter.cache) > meter.measurements  # some workloads were composed
    assert meter.measurements < reference_meter.measurements
    # a count of one CG solve gives its family's line at once: no steady round measures
    assert meter.measurements == meter.after_round_0


def test_the_meter_state_round_trips_through_json():
    import json

    meter = FlopMeter()
    for k in (1, 2, 5):
        meter.flops(("outer", (("w", (2, 3)),)), lambda: torch.ones(2, 3) @ torch.ones(3, 1), k)
    meter.flops(("half",), lambda: torch.ones(2, 3) @ torch.ones(3, 1), linear=1)
    restored = FlopMeter()
    restored.load_state_dict(json.loads(json.dumps(meter.state_dict())))
    assert restored.cache == meter.cache and restored.measurements == meter.measurements
    assert restored._lines == meter._lines and restored._points == meter._points


# ------------------------------------------------ repeated blocks and counting in place (issue 12)
def test_repeated_blocks_are_counted_once_and_sum_to_the_full_count():
    """Five identical steps, a nested block, and a double backward through graphs built in
    reused blocks: the total equals counting every operation, and FlopCounterMode's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    inputs, targets = torch.randn(7, 6), torch.randint(0, 3, (7,))
    params = list(model.parameters())

    def work() -> None:
        scope = new_scope()
        grads = []
        for _ in range(5):
            with repeated("step", scope):
                loss = F.cross_entropy(model(inputs), targets)
                with repeated("inner", scope):
                    inputs @ inputs.T
                grads.append(torch.autograd.grad(loss, params, create_graph=True))
        # the second-order pass runs outside every block: counted operation by operation
        torch.autograd.grad(sum((g * g).sum() for gs in grads for g in gs), params)

    full = count_flops(work, reuse=False)
    assert count_flops(work) == full == reference(work)
    assert full > 0


def test_a_repeated_block_is_inert_outside_a_count_and_the_mode_survives_an_error():
    a = torch.ones(3, 4)
    with repeated("x", new_scope()):  # no count running: nothing happens
        a @ a.T
    scope = new_scope()

    def failing() -> None:
        with repeated("x", scope):
            a @ a.T
        with pytest.raises(RuntimeError, match="boom"):
            with repeated("x", scope):  # known: runs outside the counter, then raises
                raise RuntimeError("boom")
        a @ a.T  # counted again once the block has ended

    assert count_flops(failing) == 2 * (2 * 3 * 4 * 3)


def test_solve_cg_counts_the_same_flops_with_uniform_products():
    torch.manual_seed(1)
    m = torch.randn(6, 6, dtype=torch.float64)
    a = m @ m.T + 6 * torch.eye(6, dtype=torch.float64)
    b = (torch.randn(6, 2, dtype=torch.float64),)  # a matrix: a @ u is a counted mm

    def solve(uniform: bool):
        product = (lambda u: (a @ u[0],)) if not uniform else cg_product(lambda u: (a @ u[0],))
        return lambda: solve_cg(product, b, max_iter=5, tol=0.0)

    assert count_flops(solve(True)) == count_flops(solve(False), reuse=False)
    assert count_flops(solve(True)) == 5 * 2 * 6 * 6 * 2
    (v,), n = solve_cg(cg_product(lambda u: (a @ u[0],)), b, max_iter=5, tol=0.0)
    (w,), m = solve_cg(lambda u: (a @ u[0],), b, max_iter=5, tol=0.0)
    assert n == m == 5 and torch.equal(v, w)


@pytest.mark.parametrize("case", CASES)
def test_every_algorithm_s_ledger_is_today_s_and_counting_changes_no_result(case):
    """Counting repeated blocks once and the first workload of a kind while it runs gives the
    ledger of the meter that re-runs every new workload and counts every operation, and the
    same states (bitwise) as a run without a meter.

    Bitwise is the claim, not a tolerance: the meter watches the same aten operations, which
    run on the same kernels in the same order with or without it (ledgers: integers)."""

    def trajectory(meter):
        exp = build(conformance_config(case))
        exp.simulation.flop_meter = meter
        return list(exp.simulation.iterate(exp.initial_state, 2))

    fast = trajectory(FlopMeter())
    slow = trajectory(FlopMeter(reuse=False, in_place=False, compose=False))
    bare = trajectory(None)
    assert [r.ledger for _, r in fast] == [r.ledger for _, r in slow]
    for (sa, _), (sb, _) in zip(fast, bare, strict=True):
        ta, tb = state_tensors(sa), state_tensors(sb)
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_a_cg_iteration_s_flops_come_from_the_count_of_one_solve():
    """cg_iteration_flops reads a count's blocks: one solve with a marked product gives the
    product's FLOPs; other blocks or two solves give nothing."""
    a = torch.eye(4, dtype=torch.float64) * 2
    b = (torch.ones(4, 3, dtype=torch.float64),)

    def solve() -> None:
        solve_cg(cg_product(lambda u: (a @ u[0],)), b, max_iter=3, tol=0.0)

    blocks: dict = {}
    total = count_flops(solve, blocks=blocks)
    assert cg_iteration_flops(blocks) == 2 * 4 * 4 * 3
    assert total == 1 * cg_iteration_flops(blocks)  # a @ b / 2 converges in one iteration
    assert cg_iteration_flops({}) is None
    assert cg_iteration_flops({**blocks, ("rabo.inner", 1, True): 5}) is None
    assert (
        cg_iteration_flops({("solve_cg", 1, "product"): 7, ("solve_cg", 2, "product"): 7}) is None
    )
    assert cg_iteration_flops({("solve_cg", 1, "product"): 7}) == 7


@pytest.mark.parametrize("lead", [0, 1])
@pytest.mark.parametrize("warm", [False, True])
def test_a_cg_iteration_counts_no_flops_but_its_product(lead, warm):
    """What lets cg_product mark the product alone: the rest of solve_cg (step sizes, vector
    updates, inner products, masks, damping, a warm start's residual) counts 0 FLOPs, for one
    client and for a cohort, with the product's own count the only one a solve adds."""
    torch.manual_seed(0)
    b = (torch.randn(3, 4, 2, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64))
    x0 = tuple(torch.randn_like(t) for t in b) if warm else None
    if lead == 0:
        b = tuple(t[0] for t in b)
        x0 = None if x0 is None else tuple(t[0] for t in x0)

    def solve() -> None:
        solve_cg(
            lambda u: tuple(2.0 * t for t in u),
            b,
            max_iter=4,
            tol=0.0,
            damping=0.5,
            x0=x0,
            lead=lead,
        )

    assert count_flops(solve, reuse=False) == 0


def test_the_first_count_of_a_cg_workload_gives_its_line():
    meter = FlopMeter()
    meter.store(("outer",), 1000, linear=4, unit=100)
    assert meter.lookup(("outer",), linear=7) == 1300 and meter.measurements == 1
    plain = FlopMeter()
    plain.store(("outer",), 1000, linear=4)  # no unit: three points are needed
    assert plain.lookup(("outer",), linear=7) is None


def test_measure_counts_a_new_family_in_place_and_remeasures_only_new_workloads():
    """FlopMeter.measure, what every backend calls through run_measured: the first run of a
    family is counted while it runs (run once), a known workload is looked up (run once, not
    counted), a new workload of a known family is run and then counted again (run twice), and
    a result computed elsewhere is only counted when its workload is new."""
    a = torch.ones(4, 3)
    runs: list[int] = []

    def run(n: int):
        def go() -> int:
            runs.append(n)
            for _ in range(n):
                a @ a.T  # 2*4*3*4 = 96 FLOPs each
            return n

        return go

    def workload(n: int) -> tuple[tuple, None]:
        return ("mm", n), None

    meter = FlopMeter()
    assert meter.measure(run(2), ("fam",), workload) == (2, 192) and runs == [2]
    assert meter.measure(run(2), ("fam",), workload) == (2, 192) and runs == [2, 2]
    assert meter.measure(run(3), ("fam",), workload) == (3, 288) and runs == [2, 2, 3, 3]
    assert meter.measure(run(1), ("fam",), workload, result=1) == (1, 96) and runs[-1] == 1
    assert meter.measure(run(1), ("fam",), workload, result=1) == (1, 96) and len(runs) == 5
    assert meter.families == {("fam",)} and meter.measurements == 3
