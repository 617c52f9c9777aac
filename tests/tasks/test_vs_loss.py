"""Loss-function tuning on long-tailed data: VS loss (x = per-class w, l, D), y = the network."""

import doctest
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import radbo.data.imbalance
import radbo.tasks.vs_loss as vs_loss_module
from radbo.config import ConfigError, load_config, parse_config
from radbo.data import Dataset, long_tail_counts, long_tail_subset
from radbo.experiment import build, load_data, run
from radbo.hypergrad import ImplicitCG
from radbo.masks.structure import StructurePlan
from radbo.models import VSMLP, VSResNet18
from radbo.problem import Batch, bind_losses, forward
from radbo.tasks import VSLoss, balanced_class_weights, vs_cross_entropy
from tests.configs import demo_dict
from tests.tolerances import gamma

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vs_loss.toml"


def split_params(model):
    state = model.state_dict()
    x = {n: state[n].detach() for n in model.outer_param_names()}
    y = {n: state[n].detach() for n in model.inner_param_names()}
    return x, y


def solve_inner(inner, x, y):
    """y*(x) by Newton's method on the (strongly convex) inner loss, to machine precision."""
    names = list(y)
    sizes = [y[n].numel() for n in names]
    flat = torch.cat([y[n].reshape(-1) for n in names])

    def unflatten(v):
        return {n: p.reshape(y[n].shape) for n, p in zip(names, v.split(sizes), strict=True)}

    def g(v):
        return inner(x, unflatten(v))

    for _ in range(30):
        grad = torch.autograd.functional.jacobian(g, flat)
        converged = float(grad.norm()) < 1e-12
        hess = torch.autograd.functional.hessian(g, flat)
        flat = flat - torch.linalg.solve(hess, grad)
        if converged:  # one step past |grad| < 1e-12: Newton's quadratic rate ends at rounding
            break
    assert float(torch.autograd.functional.jacobian(g, flat).norm()) < 1e-12
    return unflatten(flat)


# -------------------------------------------------------------------------- the loss itself


@pytest.mark.float_sensitive
@pytest.mark.parametrize("hidden", [[16], []])
def test_vs_loss_at_the_initial_x_is_exactly_cross_entropy(hidden):
    """Bitwise, by exact arithmetic: at w = 1, l = 0, D = 1 the VS loss scales by 1, adds 0 and
    weights by 1 (all exact), and the functional forward runs the module's own ops on the same
    tensors (the same storage), so both sides are the same float32 kernels on the same inputs.
    Measured equal on default/avx2/avx512; marked because it pins two code paths together."""
    gen = torch.Generator().manual_seed(0)
    model = VSMLP(8, hidden, 5)
    batch = Batch(torch.randn(37, 8, generator=gen), torch.randint(0, 5, (37,), generator=gen))
    x, y = split_params(model)
    assert all(torch.equal(t, torch.zeros(5)) for t in x.values())  # w = 1, l = 0, D = 1
    task = VSLoss(torch.ones(5), inner_l2=0.0)
    loss = task.inner_loss(model, x, y, {}, batch)
    assert torch.equal(loss, F.cross_entropy(model(batch.inputs), batch.targets))


@pytest.mark.float_sensitive
def test_vs_loss_by_hand_on_two_examples_and_three_classes():
    z = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 1.0]], dtype=torch.float64)
    c = torch.tensor([0, 2])
    w = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64)
    l_ = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64)
    d = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    # example 0, class 0: a = D*z + l = (1.1, 3.8, 0.3); -2 * log(e^1.1 / (e^1.1+e^3.8+e^0.3))
    # example 1, class 2: a = (0.6, -2.2, 0.8);          -0.5 * log(e^0.8 / (e^0.6+e^-2.2+e^0.8))
    first = -2.0 * (1.1 - math.log(math.exp(1.1) + math.exp(3.8) + math.exp(0.3)))
    second = -0.5 * (0.8 - math.log(math.exp(0.6) + math.exp(-2.2) + math.exp(0.8)))
    # by hand: (2 * (3.892945 - 1.1) + 0.5 * (1.425144 - 0.8)) / 2 = (5.585890 + 0.312572) / 2
    expected = (first + second) / 2
    assert expected == pytest.approx(2.949231, abs=2e-6)  # the 6 decimals written above
    # float64: each side rounds ~20 times (scale, shift, 3 exps, sum, log, difference, weight,
    # mean; exp and log within an ulp), and the subtraction 1.1 - 3.89 amplifies by at most
    # (1.1 + 3.89) / 2.79 < 2, so the two differ by at most 2 * 2 * gamma_20 ~ 9e-15 relative;
    # measured 0 (bitwise) on default/avx2/avx512
    assert float(vs_cross_entropy(z, c, w, l_, d)) == pytest.approx(expected, rel=1e-14)

    # the same through the model's parametrization: w = exp(log w), D = exp(log D)
    model = VSMLP(3, [], 3).double()
    x = {"vs_log_weight": w.log(), "vs_shift": l_, "vs_log_scale": d.log()}
    y = {
        "head.weight": torch.eye(3, dtype=torch.float64),
        "head.bias": torch.zeros(3, dtype=torch.float64),
    }
    loss = VSLoss(torch.ones(3), inner_l2=0.0).inner_loss(model, x, y, {}, Batch(z, c))
    # adds exp(log w) and exp(log D) (a few more roundings) and the identity head: measured 0
    assert float(loss) == pytest.approx(expected, rel=1e-12)


@pytest.mark.float_sensitive
def test_outer_loss_is_class_balanced_cross_entropy_of_the_plain_logits():
    labels = torch.tensor([0, 0, 0, 1])
    weights = balanced_class_weights(labels, 3)  # class 2 absent: weight 0
    assert weights.tolist() == [0.5, 1.5, 0.0]
    gen = torch.Generator().manual_seed(1)
    # float64: the claim is which terms f sums, not float32's rounding
    model = VSMLP(4, [6], 3).double()
    inputs = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    batch = Batch(inputs, torch.tensor([0, 1, 1, 0, 2]))
    x, y = split_params(model)
    x = {k: torch.full_like(t, 0.7) for k, t in x.items()}  # x must not enter f
    task = VSLoss(torch.tensor([0.5, 1.5, 2.0]))
    nll = F.cross_entropy(model(batch.inputs), batch.targets, reduction="none")
    weights = torch.tensor([0.5, 1.5, 1.5, 0.5, 2.0], dtype=torch.float64)
    expected = (weights * nll).mean()
    # the same float64 ops on both sides (measured 0, bitwise, on default/avx2/avx512); were
    # they summed in other orders, the two 6-4-3 forwards (~10 roundings), log-softmax over 3
    # (~8, exp and log within an ulp: count them twice) and the weighted mean of 5 positive
    # terms (~6) would differ by at most 2 * gamma_40 ~ 9e-15 relative
    rtol = 2 * gamma(40, torch.float64)
    torch.testing.assert_close(task.outer_loss(model, x, y, {}, batch), expected, rtol=rtol, atol=0)


def test_vs_loss_task_rejects_bad_arguments():
    with pytest.raises(ValueError, match="inner_l2"):
        VSLoss(torch.ones(3), inner_l2=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        VSLoss(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="1-D"):
        VSLoss(torch.ones(2, 2))


def test_hidden_layers_of_y_are_prunable_and_x_is_not():
    model = VSMLP(64, [32, 16], 10)
    assert model.outer_param_names() == ["vs_log_weight", "vs_shift", "vs_log_scale"]
    assert model.inner_param_names() == [
        "body.0.weight",
        "body.0.bias",
        "body.2.weight",
        "body.2.bias",
        "head.weight",
        "head.bias",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = StructurePlan(model, model.example_input(1), output_layers=model.output_layers)
    assert plan.groups == {"body.0": 32, "body.2": 16}
    sub = plan.submodel(plan.index_sets({"body.0": torch.arange(8), "body.2": torch.arange(4)}))
    assert sub.vs_shift.shape == (10,) and sub.head.out_features == 10


# -------------------------------------------------------------------------- long-tailed data


def test_long_tail_keeps_the_exponential_profile_per_class():
    labels = torch.arange(5).repeat_interleave(40)
    ds = Dataset(torch.randn(200, 3), labels, 5, "toy")
    sub = long_tail_subset(ds, 16.0, torch.Generator().manual_seed(0))
    # 40 * 16 ** (-c / 4) = 40, 20, 10, 5, 2.5
    assert torch.bincount(sub.labels, minlength=5).tolist() == [40, 20, 10, 5, 2]
    assert long_tail_counts(torch.tensor([40] * 5), 16.0).tolist() == [40, 20, 10, 5, 2]
    # every kept example is an original one, in the original order
    kept = [int(torch.nonzero((ds.features == row).all(1))) for row in sub.features]
    assert kept == sorted(kept)
    assert torch.equal(ds.labels[kept], sub.labels)
    # deterministic given the generator; another seed keeps other tail examples
    again = long_tail_subset(ds, 16.0, torch.Generator().manual_seed(0))
    other = long_tail_subset(ds, 16.0, torch.Generator().manual_seed(1))
    assert torch.equal(again.features, sub.features)
    assert not torch.equal(other.features, sub.features)
    assert long_tail_subset(ds, 1.0, torch.Generator()) is ds


@pytest.mark.parametrize("bad", [0.5, float("nan"), float("inf"), True])
def test_long_tail_rejects_bad_imbalance(bad):
    ds = Dataset(torch.zeros(4, 1), torch.tensor([0, 0, 1, 1]), 2, "toy")
    with pytest.raises(ValueError, match="imbalance must be a finite number >= 1"):
        long_tail_subset(ds, bad, torch.Generator())


def test_data_imbalance_makes_only_the_training_set_long_tailed():
    data = {"data": {"name": "digits", "imbalance": 10.0}}
    train, test = load_data(parse_config({**data, "seed": 3}))
    full_train, full_test = load_data(parse_config({"seed": 3}))
    sizes = torch.bincount(full_train.labels, minlength=10)
    expected = [math.floor(round(int(n) * 10 ** (-c / 9), 9)) for c, n in enumerate(sizes)]
    assert torch.bincount(train.labels, minlength=10).tolist() == expected
    assert torch.equal(test.features, full_test.features)  # the test set stays balanced
    # same seed, same subset; another seed, another subset (of another split)
    again, _ = load_data(parse_config({**data, "seed": 3}))
    assert torch.equal(again.features, train.features)
    other, _ = load_data(parse_config({**data, "seed": 4}))
    assert not torch.equal(other.features, train.features)


def test_docstring_examples():
    for module in (radbo.data.imbalance, vs_loss_module):
        result = doctest.testmod(module, extraglobs={"torch": torch, "F": F})
        assert result.attempted > 0 and result.failed == 0


# -------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"task": {"name": "vs_loss"}}, 'task "vs_loss" needs model "vs_mlp" or "vs_resnet18"'),
        ({"model": {"name": "vs_mlp"}}, 'model "vs_mlp" needs task "vs_loss"'),
        (
            {"model": {"name": "vs_mlp"}, "task": {"name": "feature_l2"}},
            'task "feature_l2" needs model "logistic"',
        ),
        (
            {"model": {"name": "logistic"}, "task": {"name": "vs_loss"}},
            'model "logistic" needs task "feature_l2"',
        ),
        ({"data": {"name": "digits", "imbalance": 0.5}}, "data.imbalance = 0.5"),
    ],
)
def test_config_errors_are_one_line(patch, message):
    data = demo_dict()
    data.update(patch)
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_vs_loss_config_takes_masks_and_defaults():
    data = demo_dict()
    data.update({"model": {"name": "vs_mlp"}, "task": {"name": "vs_loss"}})
    cfg = parse_config(data)
    assert cfg.model.hidden == [128] and cfg.task.inner_l2 == 1e-3
    assert cfg.mask.policy == "importance" and cfg.data.imbalance == 1.0
    # the default imbalance stays out of dumps (results.json and checkpoints as before it)
    assert "imbalance" not in cfg.model_dump(mode="json")["data"]
    tail = parse_config({"data": {"name": "mnist", "root": "m", "imbalance": 10}})
    assert tail.model_dump(mode="json")["data"]["imbalance"] == 10.0
    assert parse_config(tail.model_dump(mode="json")) == tail


# -------------------------------------------------------------------------- runs


@pytest.mark.float_sensitive
def test_example_builds_silently_and_masks_prune_the_hidden_layer_of_y():
    cfg = load_config(EXAMPLE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exp = build(cfg)
    assert exp.simulation.masks is not None
    assert exp.simulation.masks.plan.groups == {"body.0": 128}
    assert exp.simulation.masks.group_ratios(0.25) == {"body.0": 0.25}
    counts = torch.bincount(exp.train.labels, minlength=10).tolist()
    assert counts == sorted(counts, reverse=True) and counts[0] >= 9 * counts[-1]
    weights = exp.simulation.runtime.problem.class_weights
    # computed in float64, stored in float32 (one rounding each, u = 6e-8). The float32 mean of
    # 10 positive weights adds 10 roundings: |mean - 1| <= gamma_11(float32) ~ 6.6e-7 (plus
    # float64's gamma_12 from the normalisation); measured 1.2e-7 on default/avx2/avx512
    mean_bound = gamma(11, torch.float32) + gamma(12, torch.float64)
    assert float(weights.mean()) == pytest.approx(1.0, rel=0, abs=mean_bound)
    # the ratio: 2 stored roundings + 1 division in float32 and 5 float64 roundings (1/count
    # twice, the normalisation twice, the reference quotient); measured 5.4e-8 relative
    ratio_bound = gamma(3, torch.float32) + gamma(5, torch.float64)
    assert float(weights[9] / weights[0]) == pytest.approx(counts[0] / counts[9], rel=ratio_bound)


def per_class_accuracy(cfg, result):
    exp = build(cfg)
    state = result.state
    with torch.no_grad():
        pred = forward(exp.model, state.x, state.y, state.buffers, exp.test.features).argmax(1)
    return torch.stack(
        [(pred[exp.test.labels == c] == c).float().mean() for c in range(exp.test.num_classes)]
    )


def learned_and_frozen(rounds: int, seed: int = 0):
    """examples/vs_loss.toml for ``rounds`` rounds, and the same with x frozen at plain
    cross-entropy: per-class test accuracies of both, and both results."""
    data = load_config(EXAMPLE).model_dump()
    data.update(rounds=rounds, seed=seed)
    cfg = parse_config(data)
    data["algorithm"]["outer_lr"] = 1e-12  # x stays put: plain cross-entropy
    frozen_cfg = parse_config(data)
    learned = run(cfg, progress=False, save=False)
    frozen = run(frozen_cfg, progress=False, save=False)
    return per_class_accuracy(cfg, learned), per_class_accuracy(frozen_cfg, frozen), learned, frozen


@pytest.mark.float_sensitive
def test_ten_rounds_of_learning_x_beat_frozen_x_on_the_tail_classes():
    """The cheap version of the 60-round test below: after 10 rounds the gap is even wider.
    Measured (learned_and_frozen(10, seed) for seeds 0, 1, 2): tail classes 5-9 0.743 vs 0.602,
    0.803 vs 0.697, 0.842 vs 0.657 (gaps 0.14, 0.11, 0.19); mean per-class accuracy 0.835 vs
    0.773, 0.874 vs 0.818, 0.910 vs 0.820 (gaps 0.062, 0.056, 0.090); mean vs_shift of the
    three most frequent classes minus the three rarest 0.21, 0.20, 0.21.
    Asserted: gaps of 0.05, 0.025 and 0.1. Float32; seed 0 on the default, AVX2 and AVX-512
    kernels: tail 0.7427 vs 0.6019, mean gap 0.0621 and shift gap 0.2141 on all three (a spread
    of 3e-8). The frozen x moves by outer_lr = 1e-12 times clipped hypergradients: measured
    8.0e-13 on all three, against 1e-6."""
    acc_learned, acc_frozen, learned, frozen = learned_and_frozen(10)

    assert float(acc_learned[5:].mean()) >= float(acc_frozen[5:].mean()) + 0.05
    assert float(acc_learned.mean()) >= float(acc_frozen.mean()) + 0.025
    assert all(float(t.abs().max()) < 1e-6 for t in frozen.state.x.values())
    shift = learned.state.x["vs_shift"]
    assert float(shift[7:].mean()) < float(shift[:3].mean()) - 0.1


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_learning_x_beats_frozen_x_on_the_tail_classes():
    """examples/vs_loss.toml, 60 rounds: accuracy on the tail classes 5-9 of the balanced test
    set 0.832 learned vs 0.781 frozen (x kept at plain cross-entropy), balanced accuracy 0.897
    vs 0.866. (Seeds 1 and 2: tail 0.899 vs 0.825 and 0.905 vs 0.819.) Float32; seed 0 on the
    default, AVX2 and AVX-512 kernels: tail gap 0.0513, mean gap 0.0313, shift gap 0.2089 on all
    three (a spread of 6e-8), frozen x 6.2e-12, against 0.03, 0.015, 0.1 and 1e-6."""
    acc_learned, acc_frozen, learned, frozen = learned_and_frozen(60)

    assert float(acc_learned[5:].mean()) >= float(acc_frozen[5:].mean()) + 0.03
    assert float(acc_learned.mean()) >= float(acc_frozen.mean()) + 0.015
    assert all(float(t.abs().max()) < 1e-6 for t in frozen.state.x.values())
    # learning moves the shifts of the rarest classes below those of the most frequent ones
    shift = learned.state.x["vs_shift"]
    assert float(shift[7:].mean()) < float(shift[:3].mean()) - 0.1


# -------------------------------------------------------------------------- hypergradient


def test_implicit_hypergradient_equals_the_derivative_of_the_validation_loss():
    """With no hidden layer g is strongly convex in y, and the implicit hypergradient with
    respect to all three per-class vectors is the derivative of the validation loss at y*(x)."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():  # the initial y from a fixed seed, whatever ran before
        torch.manual_seed(0)
        model = VSMLP(5, [], 3).double()
    train = Batch(
        torch.randn(40, 5, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (40,), generator=gen),
    )
    val = Batch(
        torch.randn(25, 5, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (25,), generator=gen),
    )
    task = VSLoss(torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64), inner_l2=1e-2)
    outer, inner = bind_losses(task, model, {}, train, val)
    x = {
        "vs_log_weight": torch.tensor([0.2, -0.3, 0.1], dtype=torch.float64),
        "vs_shift": torch.tensor([-0.5, 0.0, 0.4], dtype=torch.float64),
        "vs_log_scale": torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64),
    }
    _, y0 = split_params(model)
    y_star = solve_inner(inner, x, y0)
    grad = ImplicitCG(max_iter=200, tol=1e-30)(outer, inner, x, y_star).grad

    def phi(xx):
        return float(outer(xx, solve_inner(inner, xx, y_star)))

    h = 1e-5
    for name in x:
        numeric = []
        for e in torch.eye(3, dtype=torch.float64):
            plus = {**x, name: x[name] + h * e}
            minus = {**x, name: x[name] - h * e}
            numeric.append((phi(plus) - phi(minus)) / (2 * h))
        numeric = torch.tensor(numeric, dtype=torch.float64)  # float32 would round it at 6e-8
        # float64: the quotient's truncation (h^2 / 6 times phi's third derivative, ~1e-10)
        # plus phi's rounding over 2h (Newton's y* to |grad| ~ 1e-16, phi ~ 1.2 exact to
        # ~1e-15: 1e-15 / 1e-5 ~ 1e-10 on a gradient of norm >= 0.13, ~1e-9 relative).
        # Measured <= 1.2e-10 on default/avx2/avx512 (2.4e-8 when `numeric` was float32:
        # float32's rounding); bound 1e-7
        assert float((grad[name] - numeric).norm() / numeric.norm()) < 1e-7, name


# ------------------------------------------------------------- ResNet-18 (RABO paper Sec. V-B)
def test_vs_resnet18_holds_only_the_vs_parameters_in_x_and_prunes_its_channels():
    """The paper's loss-tuning model: every layer of the ResNet-18 is y (RABO's masks prune its
    channels), x is the three per-class VS vectors, not in the forward pass."""
    model = VSResNet18(classes=10, in_channels=1, image_size=16, widths=(4, 8, 8, 8))
    assert model.outer_param_names() == ["vs_log_weight", "vs_shift", "vs_log_scale"]
    inner = model.inner_param_names()
    assert inner[0] == "stem.0.weight" and inner[-2:] == ["head.weight", "head.bias"]
    assert len(inner) + 3 == len(list(model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = StructurePlan(model, model.example_input(1), output_layers=model.output_layers)
    assert plan.groups and all(count in (4, 8) for count in plan.groups.values())
    half = {g: torch.arange(c // 2) for g, c in plan.groups.items()}
    sub = plan.submodel(plan.index_sets(half))
    assert sub.vs_shift.shape == (10,) and sub.head.out_features == 10
    assert sub.stem[0].out_channels == 2


def test_rabo_tunes_the_vs_loss_of_a_resnet18_at_capacity_one_half():
    """Sec. V-B's setting at toy size: long-tailed digits, every client at r = 1/2, RABO; the
    run works through masks on y, and x (the VS vectors) moves."""
    data = demo_dict()
    data.update(
        rounds=2,
        eval_every=2,
        data={"name": "digits", "image_size": 16, "imbalance": 10, "outer_fraction": 0.2},
        task={"name": "vs_loss"},
        model={"name": "vs_resnet18", "widths": [4, 8, 8, 8]},
        fleet={"num_clients": 4, "capacities": [0.5]},
        mask={"policy": "importance"},
    )
    data["algorithm"] = {**data["algorithm"], "inner_steps": 2}
    data["estimator"] = {"name": "cg", "max_iter": 3}
    data["baseline"] = {"enabled": False}
    result = run(parse_config(data), progress=False, save=False)
    assert math.isfinite(result.final["test_accuracy"])
    assert any(float(t.abs().max()) > 0 for t in result.state.x.values())  # x moved off 0
    assert result.rounds[0]["cost_flops"] > 0
