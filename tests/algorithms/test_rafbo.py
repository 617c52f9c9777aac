"""RAFBO (RABO + finite-difference hypergradient) and RABO with the first-order estimator."""

import pytest
import torch

from radbo.config import ConfigError, RunConfig, load_config, parse_config
from radbo.experiment import build, run
from tests.configs import ROOT, small_config
from tests.untrained import untrained_metrics


def test_rafbo_is_second_order_free_and_samples_P_per_client():
    cfg = small_config(
        algorithm={"name": "rafbo"},
        estimator={"name": "finite_difference", "num_coordinates": 8},
        rounds=2,
        baseline={"enabled": False},
    )

    result = run(cfg, progress=False, save=False)

    assert result.totals["n_hvp"] == 0
    outer = [e for e in result.ledger if e["phase"] == "train.outer"]
    # per client (central differences, the default): grad f, then two gradients of g per CG
    # matvec (<= 10) and per coordinate of |P| = 8
    assert all(1 + 2 * 8 <= e["n_grad"] <= 1 + 2 * 10 + 2 * 8 for e in outer)


def test_rafbo_needs_the_finite_difference_estimator():
    with pytest.raises(
        ConfigError, match="algorithm rafbo takes estimator finite_difference; got 'cg'"
    ):
        small_config(algorithm={"name": "rafbo"}, estimator={"name": "cg"})
    assert parse_config({"algorithm": {"name": "rafbo"}}).estimator.name == "finite_difference"


def test_first_order_estimator_state_is_carried_by_the_server():
    cfg = small_config(
        estimator={"name": "first_order", "lam": 10.0, "inner_steps": 3},
        fleet={"capacities": [1.0, 0.5]},
        rounds=2,
    )
    exp = build(cfg)
    init = exp.initial_state

    states = [s for s, _ in exp.simulation.iterate(init, 2)]

    keys = {f"{k}:{n}" for k in ("y_lambda", "z") for n in init.y}
    assert set(init.aux) == keys
    for k in keys:
        assert not torch.equal(states[-1].aux[k], init.aux[k])
        assert torch.isfinite(states[-1].aux[k]).all()


def rafbo_example(rounds: int = 60, seed: int = 0) -> RunConfig:
    """examples/rafbo.toml (the demo with RAFBO, |P| = 5 % of x) without its baseline."""
    data = load_config(ROOT / "examples" / "rafbo.toml").model_dump()
    data.update(rounds=rounds, seed=seed, baseline={"enabled": False})
    return parse_config(data)


@pytest.mark.float_sensitive
def test_ten_rafbo_rounds_learn():
    """The cheap version of test_rafbo_demo_reaches_accuracy. Measured (rafbo_example(10, seed),
    seeds 0, 1, 2; untrained accuracy 0.097, 0.150, 0.117, loss 2.313, 2.303, 2.291): accuracy
    0.763, 0.760, 0.872, loss 1.223, 1.225, 1.162 (drops 1.090, 1.078, 1.128; the numbers this
    docstring gave before, 0.777 / 1.028 and so on, no longer reproduce with this radbo).
    Float32; seed 0 on the default, AVX2 and AVX-512 kernels: accuracy 0.7632 on all three, loss
    1.22268, 1.22270, 1.22269 (a spread of 2e-5). Asserted: accuracy >= 0.65 (chance is 0.1;
    margin >= 0.11) and a loss drop of 0.9 (margin >= 0.17), 5000x that spread."""
    cfg = rafbo_example(rounds=10)
    untrained = untrained_metrics(cfg)

    result = run(cfg, progress=False, save=False)

    assert result.final["test_accuracy"] >= 0.65
    assert result.final["test_loss"] <= untrained["test_loss"] - 0.9
    assert result.totals["n_hvp"] == 0


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_rafbo_demo_reaches_accuracy():
    """examples/rafbo.toml (the demo with RAFBO, |P| = 5 % of x): >= 0.80 test accuracy.
    Float32; measured 0.8663 (loss 0.81591) with the default kernels, the same with the
    example's coordinate_batch = 128 and with 1 (one kernel only; the 10-round version above
    agrees in four digits across default, AVX2 and AVX-512, batch 128 as batch 1)."""
    result = run(rafbo_example(), progress=False, save=False)

    assert result.final["test_accuracy"] >= 0.80
    assert result.totals["n_hvp"] == 0
