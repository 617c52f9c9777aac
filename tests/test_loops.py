"""radbo.loops: the framework's local-step loop (masking finished clients, repeated blocks for
the FLOP meter, per-client work) and the marks a CG solve takes as a hook."""

from __future__ import annotations

import pytest
import torch

from radbo.autodiff import solve_cg
from radbo.flops import RepeatedWorkError, count_flops
from radbo.loops import Work, cg_iteration_flops, cg_product, local_steps


def test_a_client_past_its_steps_keeps_its_carry_and_its_work_stops():
    def step(t, carry):
        w, n = carry
        return (w + 1.0, n + 1), Work(n_grad=2, n_hvp=[1, 0, 1])

    out = local_steps(step, (torch.zeros(3, 2), 0), [1, 3, 2], name="test.step")
    w, n = out.carry
    assert w.tolist() == [[1.0, 1.0], [3.0, 3.0], [2.0, 2.0]]
    assert n == 3  # a value that is no tensor takes what the step returned
    assert out.n_grad == [2, 6, 4] and out.n_hvp == [1, 0, 2]


def test_a_step_may_update_the_carry_in_place_and_finished_clients_stay_put():
    """BatchNorm running statistics move in place: while some clients have finished, the step
    gets a copy, so theirs do not move."""
    stats = torch.zeros(2, 3)

    def step(t, carry):
        carry["stats"].add_(1.0)
        return carry, Work()

    out = local_steps(step, {"stats": stats}, [1, 2], name="test.inplace")
    assert out.carry["stats"].tolist() == [[1.0] * 3, [2.0] * 3]


def test_nan_of_a_finished_client_never_leaks():
    def step(t, w):
        return w / torch.tensor([1.0, 0.0]).reshape(2, 1) * 0.0, Work()  # client 1: NaN

    out = local_steps(step, torch.ones(2, 1), [2, 0], name="test.nan")
    assert out.carry.tolist() == [[0.0], [1.0]]


def test_one_count_for_every_client_and_reverse_sweeps():
    seen = []

    def step(t, carry):
        seen.append(t)
        return carry + t, Work(n_grad=1)

    out = local_steps(step, torch.zeros(()), 3, name="test.plain")
    assert float(out.carry) == 3.0 and out.n_grad == [3] and seen == [0, 1, 2]
    seen.clear()
    out = local_steps(step, torch.zeros(2), [1, 3], name="test.back", reverse=True)
    assert seen == [2, 1, 0] and out.carry.tolist() == [0.0, 3.0] and out.n_grad == [1, 3]


@pytest.mark.parametrize("reverse", [False, True])
def test_counts_on_the_device_mask_as_counts_on_the_host(reverse: bool):
    """``counts`` (a captured phase's step counts, read on the device only): every step runs
    masked by ``t < counts``, bitwise what host counts give, in-place updates and NaNs of
    finished clients included; the work counts every step run (the caller knows the
    counts); a step count that is not one number is refused."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    counts = [1, 4, 2, 4]

    def step(t, carry):
        w, stats, _ = carry
        stats.add_(w.sum(-1))  # in place, as BatchNorm statistics move
        w = torch.where(torch.arange(4).unsqueeze(-1) == t, w / 0.0, w * 1.5 + t)
        return (w, stats, w.sum(-1)), Work(n_grad=2)  # per client, as a cohort's losses

    host = local_steps(step, (start, torch.zeros(4), 0.0), counts, name="t", reverse=reverse)
    device = local_steps(
        step,
        (start, torch.zeros(4), 0.0),
        4,
        name="t",
        reverse=reverse,
        counts=torch.tensor(counts),
    )
    for a, b in zip(host.carry, device.carry, strict=True):  # bitwise, NaNs where they are
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0, equal_nan=True)
    assert host.n_grad == [2, 8, 4, 8] and device.n_grad == [8] * 4
    with pytest.raises(TypeError, match="with counts, steps is the number of steps run"):
        local_steps(step, (start,), counts, name="t", counts=torch.tensor(counts))


def test_a_step_naming_the_wrong_number_of_clients_is_refused():
    with pytest.raises(ValueError, match="names 3 clients, not 2"):
        local_steps(lambda t, c: (c, Work(n_grad=[1, 1, 1])), torch.zeros(2), [1, 1], name="x")


def test_uniform_steps_are_counted_once_and_give_the_full_count():
    a = torch.ones(4, 3)

    def work(uniform: bool):
        def step(t, carry):
            return carry + (a @ a.T).sum(), Work()

        return lambda: local_steps(step, torch.zeros(()), 5, name="test.mm", uniform=uniform)

    blocks: dict = {}
    assert count_flops(work(True), blocks=blocks) == 5 * 2 * 4 * 3 * 4
    assert count_flops(work(False), reuse=False) == 5 * 2 * 4 * 3 * 4
    assert [key[0] for key in blocks] == ["test.mm"]
    assert count_flops(work(False), blocks=(none := {})) == 5 * 2 * 4 * 3 * 4 and not none


def test_a_marked_cg_solve_shows_one_iteration_s_flops():
    a = torch.eye(4, dtype=torch.float64) * 2
    b = (torch.ones(4, 3, dtype=torch.float64),)
    blocks: dict = {}
    count_flops(lambda: solve_cg(cg_product(lambda u: (a @ u[0],)), b, max_iter=3), blocks=blocks)
    assert cg_iteration_flops(blocks) == 2 * 4 * 4 * 3


def test_steps_marked_uniform_whose_products_differ_are_caught():
    """The promise of a uniform step is checked on a sample: the second step is counted too,
    and a step whose products grow (here with t) raises instead of reusing the first count.
    The sample is the second step only: work that changes from the third step on is a caller
    error the check does not see (check=False shows what reusing would have counted)."""
    a = torch.ones(4, 4)

    def growing(t: int, carry: tuple[torch.Tensor]) -> tuple[tuple[torch.Tensor], Work]:
        for _ in range(t + 1):
            a @ a
        return carry, Work(n_grad=1)

    def run(step, uniform: bool = True):
        return lambda: local_steps(step, (torch.zeros(2),), 4, name="test.grow", uniform=uniform)

    with pytest.raises(RepeatedWorkError, match=r"'test.grow'.*128 FLOPs the first time and 256"):
        count_flops(run(growing))
    assert count_flops(run(growing, uniform=False)) == (1 + 2 + 3 + 4) * 128
    assert count_flops(run(growing), check=False) == 4 * 128  # the wrong count the check stops

    def late(t: int, carry: tuple[torch.Tensor]) -> tuple[tuple[torch.Tensor], Work]:
        for _ in range(2 if t == 3 else 1):
            a @ a
        return carry, Work(n_grad=1)

    assert count_flops(run(late)) == 4 * 128  # not caught: the fourth step ran two products
    assert count_flops(run(late, uniform=False)) == 5 * 128
