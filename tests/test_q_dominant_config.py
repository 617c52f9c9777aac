"""``[partition] kind = "q_dominant"``: FedMSA's heterogeneity level q as a config section
(the split itself, :func:`partition_q_dominant`, is tested in tests/data/test_data.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radbo.config import ConfigError, parse_config
from radbo.data import PARTITIONS, QDominantPartition, label_histogram, partition_q_dominant
from radbo.experiment import build, run
from radbo.randomness import Stream, generator


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_q_one_gives_each_client_exactly_its_class() -> None:
    # 3 classes of 2, 3 clients of 2: client i's 2 slots all go to class i, whatever the draw
    labels = torch.tensor([2, 0, 1, 0, 2, 1])

    parts = QDominantPartition(q=1.0).split(labels, 3, gen(0))

    assert [p.tolist() for p in parts] == [[1, 3], [2, 5], [0, 4]]


def test_split_equals_partition_q_dominant_on_a_hand_case() -> None:
    # 2 clients of 4, q = 0.5: each takes round(0.5 * 4) = 2 of its class; the 2 + 2 left over
    # are shuffled and fill both clients up to 4
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])

    parts = QDominantPartition(q=0.5).split(labels, 2, gen(7))
    expected = partition_q_dominant(labels, 2, 0.5, gen(7))

    assert len(parts) == 2 and all(torch.equal(a, b) for a, b in zip(parts, expected, strict=True))
    histogram = label_histogram(labels, parts, 2)
    assert histogram.sum(dim=1).tolist() == [4, 4]
    assert int(histogram[0, 0]) >= 2 and int(histogram[1, 1]) >= 2
    assert sorted(torch.cat(parts).tolist()) == list(range(8))


def test_config_parses_q_and_rejects_values_outside_0_1() -> None:
    def error(partition: dict) -> str:
        with pytest.raises(ConfigError) as err:
            parse_config({"partition": partition})
        return str(err.value)

    parsed = parse_config({"partition": {"kind": "q_dominant", "q": 0.3}}).partition

    assert PARTITIONS["q_dominant"] is QDominantPartition
    assert isinstance(parsed, QDominantPartition) and parsed.q == 0.3
    assert error({"kind": "q_dominant", "q": 1.5}) == (
        "config error: partition.q = 1.5: Input should be less than or equal to 1"
    )
    assert error({"kind": "q_dominant", "q": -0.1}) == (
        "config error: partition.q = -0.1: Input should be greater than or equal to 0"
    )
    assert error({"kind": "q_dominant", "q": "nan"}).startswith("config error: partition.q = ")
    assert "Field required" in error({"kind": "q_dominant"})  # no default: choose q
    assert "partition.alpha" in error({"kind": "q_dominant", "q": 0.5, "alpha": 1.0})


def config(q: float) -> dict:
    """Digits over 10 clients (one dominant class each), a small MLP, RABO, 2 rounds."""
    return {
        "seed": 0,
        "rounds": 2,
        "eval_every": 1,
        "data": {"name": "digits"},
        "partition": {"kind": "q_dominant", "q": q},
        "model": {"name": "mlp", "hidden": [16]},
        "fleet": {"num_clients": 10},
        "mask": {"policy": "none"},
        "algorithm": {"name": "rabo", "inner_steps": 2, "batch_size": 8, "outer_batch_size": 8},
        "estimator": {"name": "cg", "max_iter": 3},
    }


def test_a_run_config_splits_its_clients_with_q_dominant() -> None:
    cfg = parse_config(config(0.5))

    experiment = build(cfg)
    result = run(cfg, progress=False, save=False)

    labels = experiment.train.labels
    expected = partition_q_dominant(labels, 10, 0.5, generator(cfg.seed, Stream.PARTITION))
    held = [torch.sort(torch.cat([c.inner, c.outer])).values for c in experiment.clients]
    assert all(torch.equal(h, e) for h, e in zip(held, expected, strict=True))
    histogram = label_histogram(labels, held, 10)
    sizes = histogram.sum(dim=1)
    # 1438 training digits: clients of 144 (the first 8) and 143, half from class i (sorted)
    assert sizes.tolist() == [144] * 8 + [143] * 2
    assert torch.all(histogram[torch.arange(10), torch.arange(10)] >= 72)
    assert torch.equal(histogram.argmax(dim=1), torch.arange(10))
    assert len(result.rounds) == 2
    assert np.isfinite(result.final["test_loss"]) and 0 <= result.final["test_accuracy"] <= 1


def test_more_clients_than_examples_is_a_config_error() -> None:
    data = config(0.5)
    data["fleet"] = {"num_clients": 2000}

    with pytest.raises(ConfigError, match="cannot give 2000 clients at least one sample"):
        build(parse_config(data))
