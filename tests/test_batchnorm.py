"""BatchNorm under submodels: aggregated running statistics vs static BN (sBN)."""

import torch
from torch.func import functional_call

from radbo.experiment import build, calibrate_batchnorm, run
from radbo.models import SmallCNN
from tests.configs import small_config


def test_calibration_recomputes_exact_batch_statistics():
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = SmallCNN()
    state = model.state_dict()
    x = {n: state[n] for n in model.outer_param_names()}
    y = {n: state[n] for n in model.inner_param_names()}
    b = {n: t for n, t in state.items() if n not in x and n not in y}
    inputs = torch.randn(64, 1, 8, 8, generator=gen)

    with torch.no_grad():
        new = calibrate_batchnorm(model, x, y, b, inputs)
        conv = functional_call(
            model.body[0], {"weight": x["body.0.weight"], "bias": x["body.0.bias"]}, (inputs,)
        )

    assert torch.allclose(new["body.1.running_mean"], conv.mean(dim=(0, 2, 3)), atol=1e-5)
    assert torch.allclose(
        new["body.1.running_var"], conv.var(dim=(0, 2, 3), unbiased=True), atol=1e-4
    )
    assert torch.equal(b["body.1.running_mean"], state["body.1.running_mean"])  # input untouched
    assert model.body[1].momentum == 0.1  # restored


def test_static_bn_keeps_server_statistics_out_of_aggregation_and_still_learns():
    cfg = small_config(
        rounds=6,
        eval_every=6,
        model={"name": "cnn", "batchnorm": "static", "calibration_samples": 256},
        fleet={"capacities": [1.0, 0.5], "devices": None},
    )
    exp = build(cfg)

    result = run(cfg, progress=False, save=False)

    for k, t in exp.initial_state.buffers.items():
        assert torch.equal(result.state.buffers[k], t)  # never aggregated
    inner = [e for e in result.ledger if e["phase"] == "train.inner"]
    aggregated = run(
        small_config(
            rounds=1, model={"name": "cnn"}, fleet={"capacities": [1.0, 0.5], "devices": None}
        ),
        progress=False,
        save=False,
    )
    agg_inner = [e for e in aggregated.ledger if e["phase"] == "train.inner"]
    assert inner[0]["bytes_up"] < agg_inner[0]["bytes_up"]  # no statistics sent up
    assert result.final["test_accuracy"] > 0.3
