"""Dist-ProtoNet (radbo/algorithms/protonet.py) against hand computations: the prototypes and
loss of a 2-way 2-shot episode on an identity backbone, one local step's gradient on a linear
backbone in closed form, the head carried unchanged, the nearest-prototype evaluation, the
refusal of a task that is not few-shot, and learning on the few-shot digits."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from radbo.algorithms import ProtoNet
from radbo.client import ClientBudget, ClientRuntime, ClientTask, Cohort, Prepared
from radbo.config import ConfigError, parse_config
from radbo.experiment import build, run
from radbo.problem import Batch, ClientData, split_state
from radbo.simulation.engine import full_index_set
from radbo.tasks import FewShot
from radbo.tasks.few_shot import FewShotEvaluator, prototype_logits

#: a 2-way 2-shot, 1-query episode in two dimensions, grouped by class: support 0, 0, 1, 1,
#: then query 0, 1. Prototypes (1, 0) and (0, 5).
SUPPORT = [[0.0, 0.0], [2.0, 0.0], [0.0, 4.0], [0.0, 6.0]]
QUERY = [[1.0, 1.0], [0.0, 3.0]]
TASK = FewShot(name="few_shot", ways=2, shots=2, queries=1)


class LinearBackbone(nn.Module):
    """features = W u (``body``, no bias), then a linear ``head``: the backbone is x."""

    inner_modules = ("head",)

    def __init__(self, weight: list[list[float]]) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2, bias=False).double()
        self.head = nn.Linear(2, 2).double()
        with torch.no_grad():
            self.body.weight.copy_(torch.tensor(weight, dtype=torch.float64))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(inputs))


def episode() -> Batch:
    inputs = torch.tensor(SUPPORT + QUERY, dtype=torch.float64)
    return Batch(inputs, torch.tensor([0, 0, 1, 1, 0, 1]))


def test_prototypes_and_loss_of_a_two_way_two_shot_episode_by_hand() -> None:
    model = LinearBackbone([[1.0, 0.0], [0.0, 1.0]])  # identity: features = inputs
    x = {"body.weight": model.body.weight.detach()}
    y = {k: v.detach() for k, v in model.head.named_parameters(prefix="head")}
    # query (1, 1): squared distances 1 and 17 to the prototypes (1, 0) and (0, 5); query
    # (0, 3): 10 and 4
    logits = prototype_logits(
        torch.tensor(SUPPORT, dtype=torch.float64), torch.tensor(QUERY, dtype=torch.float64), 2
    )
    assert torch.equal(logits, torch.tensor([[-1.0, -17.0], [-10.0, -4.0]], dtype=torch.float64))
    # cross-entropy of query 0 as class 0 (margin 16) and query 1 as class 1 (margin 6)
    expected = (math.log1p(math.exp(-16.0)) + math.log1p(math.exp(-6.0))) / 2
    loss = TASK.prototype_loss(model, x, y, {}, episode())
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(expected, rel=1e-14)


def closed_form_gradient(weight: torch.Tensor) -> torch.Tensor:
    """d/dW of the episode loss on features W u: logit_qk = -||W (u_q - c_k)||^2 with c_k the
    class means of the raw support inputs (W is linear), so d logit_qk / dW = -2 W d d^T with
    d = u_q - c_k, and d CE / d logit_qk = p_qk - [k = y_q]."""
    support = torch.tensor(SUPPORT, dtype=torch.float64)
    query = torch.tensor(QUERY, dtype=torch.float64)
    centers = support.reshape(2, 2, 2).mean(1)
    grad = torch.zeros(2, 2, dtype=torch.float64)
    for q, label in zip(query, (0, 1), strict=True):
        diffs = [q - c for c in centers]
        logits = torch.stack([-(weight @ d).pow(2).sum() for d in diffs])
        probs = torch.softmax(logits, 0)
        for k, d in enumerate(diffs):
            grad += (probs[k] - float(k == label)) * (-2.0) * weight @ torch.outer(d, d)
    return grad / len(query)


def test_one_local_step_is_the_closed_form_gradient_on_x_and_leaves_the_head() -> None:
    weight = [[0.5, 0.25], [-0.125, 0.25]]  # a margin small enough for a sizable gradient
    model = LinearBackbone(weight)
    algo = ProtoNet(
        outer_names=("body.weight",),
        inner_names=("head.weight", "head.bias"),
        lr=0.5,
        local_steps=1,
    )
    batch = episode()
    runtime = ClientRuntime(TASK, batch.inputs, batch.targets, model)
    state = algo.init(
        {"body.weight": model.body.weight.detach()},
        {"head.weight": model.head.weight.detach(), "head.bias": model.head.bias.detach()},
        {},
    )
    index_set = full_index_set({n: t.shape for n, t in model.state_dict().items()})
    task = ClientTask(
        client=0,
        round=0,
        phase="train",
        params=algo.broadcast(state, index_set),
        index_set=index_set,
        data=ClientData(torch.arange(6), torch.arange(6)),
        seed=0,
        budget=ClientBudget(),
    )
    prepared = Prepared(steps={"batch": torch.arange(6).unsqueeze(0)}, num_steps=1)
    (result,) = algo.run_client(runtime, Cohort.single(task, prepared))

    expected = closed_form_gradient(torch.tensor(weight, dtype=torch.float64))
    assert set(result.update) == {"body.weight"}  # the head is not sent
    torch.testing.assert_close(result.update["body.weight"], expected, rtol=1e-13, atol=0)
    assert result.cost.n_grad == 1 and result.cost.samples == 6

    new, _ = algo.server(state, [result], [index_set], [1.0])
    torch.testing.assert_close(
        new.x["body.weight"], state.x["body.weight"] - 0.5 * expected, rtol=1e-13, atol=0
    )
    assert all(torch.equal(new.y[k], state.y[k]) for k in state.y)  # carried unchanged


def test_the_evaluator_reports_the_nearest_prototype_rule_beside_the_fitted_heads() -> None:
    """On the same fixed episodes and features: turning the rule on adds its two metrics and
    leaves the others bit for bit; its accuracy is the rule's, recomputed here."""
    data = {
        "seed": 0,
        "partition": {"kind": "iid"},
        "model": {"name": "conv4", "width": 4},
        "task": {"name": "few_shot", "ways": 5, "shots": 2, "queries": 3, "test_episodes": 10},
        "fleet": {"num_clients": 2},
        "mask": {"policy": "none"},
        "algorithm": {"name": "protonet"},
    }
    plain = build(parse_config(data))
    task = {**data["task"], "prototypes": True}
    both = build(parse_config({**data, "task": task}))
    state = plain.simulation.algorithm.model_state(plain.initial_state)
    without, with_rule = plain.simulation.evaluate(state), both.simulation.evaluate(state)
    assert set(with_rule) - set(without) == {"prototype_accuracy", "prototype_accuracy_ci95"}
    assert all(with_rule[k] == v for k, v in without.items())

    evaluator = both.simulation.evaluate
    assert isinstance(evaluator, FewShotEvaluator)
    model = evaluator.model
    model.eval()
    with torch.no_grad():
        x, y, buffers = split_state(state, evaluator.outer, evaluator.inner)
        support = evaluator.features(x, y, buffers, evaluator.support)
        query = evaluator.features(x, y, buffers, evaluator.query)
    model.train()
    targets = torch.arange(5).repeat_interleave(3)
    hits = []
    for s, q in zip(support, query, strict=True):
        prototypes = s.reshape(5, 2, -1).mean(1)
        nearest = torch.cdist(q, prototypes).argmin(-1)
        hits.append(float((nearest == targets).double().mean()))
    assert with_rule["prototype_accuracy"] == pytest.approx(sum(hits) / len(hits), abs=1e-12)


def test_a_task_that_is_not_few_shot_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"protonet runs only on \[task\] name = 'few_shot'"):
        parse_config({"algorithm": {"name": "protonet"}})


def test_protonet_learns_on_the_few_shot_digits() -> None:
    """Five rounds on 5-way 2-shot digits: the episodes' prototypical query loss falls well
    below its first round's, and the nearest-prototype test accuracy ends above chance
    (1/5)."""
    cfg = parse_config(
        {
            "seed": 0,
            "rounds": 6,
            "eval_every": 6,
            "partition": {"kind": "iid"},
            "model": {"name": "conv4", "width": 8},
            "task": {
                "name": "few_shot",
                "ways": 5,
                "shots": 2,
                "queries": 5,
                "test_episodes": 50,
                "prototypes": True,
            },
            "fleet": {"num_clients": 3},
            "mask": {"policy": "none"},
            "algorithm": {"name": "protonet", "lr": 0.05, "local_steps": 3},
        }
    )
    result = run(cfg, progress=False, save=False)
    losses = [r["train_loss"] for r in result.rounds]
    assert sum(losses[-2:]) / 2 < 0.7 * losses[0]
    assert result.final["test_prototype_accuracy"] > 0.4
