"""FedMBO and FedMSA from a config: they train the digits task, and refuse masks."""

from pathlib import Path

import pytest

from radbo.config import ConfigError, load_config, parse_config
from radbo.experiment import run
from tests.configs import demo_dict

ROOT = Path(__file__).resolve().parents[2]


def example(name, **fleet):
    data = load_config(ROOT / "examples" / f"{name}.toml").model_dump()
    data["fleet"] = {**data["fleet"], **fleet}
    return parse_config(data)


@pytest.mark.float_sensitive
@pytest.mark.parametrize(("name", "bar"), [("fedmbo", 0.85), ("fedmsa", 0.85)])
def test_example_baseline_trains_digits(name, bar):
    """examples/fedmbo.toml and examples/fedmsa.toml (float32); measured: FedMBO 0.889 (318
    communication rounds), FedMSA 0.919 (60 rounds), the same to all digits on the default,
    AVX2 and AVX-512 kernels (0.8886 and 0.9192). Seeds 1 and 2 (default kernels): FedMBO
    0.911, 0.916, FedMSA 0.939, 0.942. FedMBO's margin (0.039 at seed 0) is the seeds'
    business: the kernels do not move the accuracy in its four digits."""
    result = run(example(name), progress=False, save=False)
    assert result.final["test_accuracy"] >= bar
    rounds = result.totals["communication_rounds"]
    if name == "fedmsa":
        assert rounds == 2 * 30
    else:  # T + max N_i + 2 per iteration, N_i < N
        assert 30 * (5 + 2) <= rounds <= 30 * (5 + 4 + 2)


@pytest.mark.parametrize("name", ["fedmbo", "fedmsa"])
def test_full_model_baselines_refuse_masks(name):
    data = demo_dict()
    data["algorithm"] = {"name": name}
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert "trains the full model on every client" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.float_sensitive
def test_fleet_dropout_is_counted_and_training_goes_on():
    """Measured with seeds 0, 1, 2 (examples/fedmsa.toml, dropout 0.3): accuracy 0.886, 0.928,
    0.936 (untrained 0.097, 0.150, 0.117). Asserted: 0.8. Seed 0 (the one run here, float32)
    gives 0.8858 on the default, AVX2 and AVX-512 kernels alike."""
    result = run(example("fedmsa", dropout=0.3), progress=False, save=False)
    dropped = result.totals["dropped_client_rounds"]
    assert 0.15 * result.totals["client_rounds"] < dropped < 0.45 * result.totals["client_rounds"]
    assert result.final["test_accuracy"] >= 0.8


def test_fedmbo_as_the_savings_baseline_takes_the_runs_settings():
    from radbo.experiment import baseline_config

    data = demo_dict()
    data["baseline"] = {"enabled": True, "algorithm": "fedmbo", "terms": 4, "eta": 0.3}
    cfg = parse_config(data)
    base = baseline_config(cfg)
    algo, rabo = base.algorithm, cfg.algorithm
    assert algo.name == "fedmbo" and base.mask.policy == "none"
    assert base.fleet.capacities == [1.0] and not base.baseline.enabled
    assert (algo.inner_lr, algo.outer_lr, algo.inner_steps) == (
        rabo.inner_lr,
        rabo.outer_lr,
        rabo.inner_steps,
    )
    assert (algo.neumann_terms, algo.eta, algo.max_hypergrad_norm) == (4, 0.3, 0.5)

    data.update(rounds=2, eval_every=1)
    result = run(parse_config(data), progress=False, save=False)
    assert result.baseline.config.algorithm.name == "fedmbo"
    assert result.baseline.totals["communication_rounds"] >= 2 * (rabo.inner_steps + 2)
    assert 0 < result.savings["bytes_fraction"] < 1
