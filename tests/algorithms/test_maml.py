"""Dist-MAML (radbo/algorithms/maml.py) against closed forms: one meta-step of both variants on
a quadratic, where the second-order meta-gradient is ``(I - alpha H)^K`` times the first-order
one; the FLOP meter charging second order more; the settings refused off the few-shot task;
and learning on the few-shot digits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from radbo.algorithms import MAML
from radbo.client import ClientBudget, ClientRuntime, ClientTask, Cohort, Prepared
from radbo.config import ConfigError, parse_config
from radbo.experiment import run
from radbo.problem import Batch, ClientData
from radbo.simulation.engine import full_index_set
from radbo.typing import Params

#: the diagonal Hessian of the quadratic, its two set centers and the starting point
H = torch.tensor([2.0, 1.0, 0.5, 4.0], dtype=torch.float64)
SUPPORT_CENTER = torch.tensor([1.0, -1.0, 2.0, 0.5], dtype=torch.float64)
QUERY_CENTER = torch.tensor([-0.5, 3.0, 1.0, 1.5], dtype=torch.float64)
START = torch.tensor([0.25, 0.5, -1.0, 2.0], dtype=torch.float64)
ALPHA, LR = 0.125, 0.5


class Quadratic:
    """``L_B(w) = 1/2 (w - a_B)^T H (w - a_B)``, w = (x, y) and a_B the mean input of the
    set B: grad L_B(w) = H (w - a_B), Hessian H everywhere."""

    def outer_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> torch.Tensor:
        w = torch.cat([x["x"], y["y"]])
        d = w - batch.inputs.mean(0)
        return 0.5 * (d * H * d).sum()


class TwoHalves(nn.Module):
    """Holds x and y, two entries each, for the engine's index sets."""

    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.y = nn.Parameter(torch.zeros(2, dtype=torch.float64))


def meta_step(first_order: bool, inner_steps: int) -> tuple[torch.Tensor, MAML, dict]:
    """One client's one meta-step from START: its update (the meta-gradient) and its costs."""
    algo = MAML(
        outer_names=("x",),
        inner_names=("y",),
        lr=LR,
        local_steps=1,
        inner_steps=inner_steps,
        inner_lr=ALPHA,
        first_order=first_order,
    )
    features = torch.stack([SUPPORT_CENTER, QUERY_CENTER])
    runtime = ClientRuntime(Quadratic(), features, torch.zeros(2, dtype=torch.long), TwoHalves())
    state = algo.init({"x": START[:2]}, {"y": START[2:]}, {})
    index_set = full_index_set({"x": torch.Size([2]), "y": torch.Size([2])})
    task = ClientTask(
        client=0,
        round=0,
        phase="train",
        params=algo.broadcast(state, index_set),
        index_set=index_set,
        data=ClientData(torch.tensor([0]), torch.tensor([1])),
        seed=0,
        budget=ClientBudget(),
    )
    steps = {"support": torch.tensor([[0]]), "query": torch.tensor([[1]])}
    (result,) = algo.run_client(runtime, Cohort.single(task, Prepared(steps=steps, num_steps=1)))
    new, _ = algo.server(state, [result], [index_set], [1.0])
    grad = torch.cat([result.update["x"], result.update["y"]])
    stepped = torch.cat([new.x["x"], new.y["y"]])
    torch.testing.assert_close(stepped, START - LR * grad, rtol=0, atol=1e-15)
    return grad, algo, {"n_grad": result.cost.n_grad, "n_hvp": result.cost.n_hvp}


def adapted(inner_steps: int) -> torch.Tensor:
    """w_K: K steps of w <- w - alpha H (w - a_S) from START."""
    w = START.clone()
    for _ in range(inner_steps):
        w = w - ALPHA * H * (w - SUPPORT_CENTER)
    return w


@pytest.mark.parametrize("inner_steps", [1, 2])
def test_one_meta_step_of_both_variants_in_closed_form(inner_steps: int) -> None:
    query_grad = H * (adapted(inner_steps) - QUERY_CENTER)  # grad L_Q at w_K
    jacobian = (1 - ALPHA * H) ** inner_steps  # d w_K / d w, diagonal

    first, _, first_costs = meta_step(first_order=True, inner_steps=inner_steps)
    second, _, second_costs = meta_step(first_order=False, inner_steps=inner_steps)

    # float64, a handful of roundings of numbers below 10
    torch.testing.assert_close(first, query_grad, rtol=0, atol=1e-14)
    torch.testing.assert_close(second, jacobian * query_grad, rtol=0, atol=1e-14)
    if inner_steps == 1:  # they differ by exactly the second-order term alpha H grad L_Q
        torch.testing.assert_close(first - second, ALPHA * H * query_grad, rtol=0, atol=1e-14)
    assert first_costs == {"n_grad": inner_steps + 1, "n_hvp": 0}
    assert second_costs == {"n_grad": inner_steps + 1, "n_hvp": inner_steps}


FEW_SHOT = {
    "seed": 0,
    "partition": {"kind": "iid"},
    "model": {"name": "conv4", "width": 8},
    "task": {"name": "few_shot", "ways": 5, "shots": 2, "queries": 5, "test_episodes": 20},
    "fleet": {"num_clients": 3},
    "mask": {"policy": "none"},
    "runtime": {"dtype": "float64"},
}


def test_second_order_costs_more_flops_per_round_than_first_order() -> None:
    """The FLOP meter measures the work run: differentiating through the adaptation adds a
    backward pass through each inner step's gradient."""

    def flops(first_order: bool) -> int:
        algorithm = {"name": "maml", "local_steps": 2, "inner_steps": 2, "first_order": first_order}
        cfg = parse_config({**FEW_SHOT, "rounds": 1, "eval_every": 1, "algorithm": algorithm})
        ledger = run(cfg, progress=False, save=False).ledger
        assert {row["phase"] for row in ledger} == {"train"} and len(ledger) == 3
        return sum(row["flops"] for row in ledger)

    first, second = flops(True), flops(False)
    assert 0 < first < second


def test_a_task_that_is_not_few_shot_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"maml runs only on \[task\] name = 'few_shot'"):
        parse_config({"algorithm": {"name": "maml"}})


@pytest.mark.parametrize(("first_order", "ratio"), [(False, 0.75), (True, 0.9)])
def test_maml_lowers_the_query_loss_on_the_few_shot_digits(first_order: bool, ratio: float) -> None:
    """Eight rounds on 5-way 2-shot digits (float64): the mean adapted query loss of the last
    three rounds falls below ``ratio`` x that of the first three. Measured over seeds 0-2:
    0.43-0.58 second order, 0.77-0.83 first order."""
    algorithm = {
        "name": "maml",
        "lr": 0.2,
        "local_steps": 3,
        "inner_lr": 0.5,
        "first_order": first_order,
    }
    cfg = parse_config({**FEW_SHOT, "rounds": 8, "eval_every": 8, "algorithm": algorithm})
    losses = [r["train_loss"] for r in run(cfg, progress=False, save=False).rounds]
    assert 1.3 < losses[0] < 1.8  # about log 5 = 1.61 before meta-training
    assert sum(losses[-3:]) / 3 < ratio * sum(losses[:3]) / 3
