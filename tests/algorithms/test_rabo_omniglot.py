"""RABO on its own paper's task: few-shot hyper-representation on real Omniglot (issue 26).

Reads the real Omniglot splits at ``../shared/data/omniglot-small`` (next to the repository
root; 5 background alphabets to meta-train, 3 evaluation alphabets to meta-test) when they are
there and skips otherwise: users do not have them, and no test downloads data.

The fleet is the paper's (Sec. V-A): five clients at capacities 1, 1/2, 1/4, 1/8, 1/16 with
importance masks on the backbone x and the head y, the meta-training characters split by class
over the clients, 5-way 5-shot episodes, Conv-4 with static BatchNorm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from radbo.config import parse_config
from radbo.experiment import build, run

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "omniglot-small"

pytestmark = pytest.mark.skipif(
    not (DATA / "images_background").is_dir(), reason=f"no Omniglot at {DATA}"
)


def config(seed: int, rounds: int, width: int, **algorithm: Any) -> dict[str, Any]:
    return {
        "seed": seed,
        "rounds": rounds,
        "eval_every": rounds,
        "data": {"name": "omniglot", "root": str(DATA), "image_size": 28},
        "partition": {"kind": "classes"},
        "model": {"name": "conv4", "width": width, "batchnorm": "static"},
        "task": {"name": "few_shot", "ways": 5, "shots": 5, "queries": 15, "test_episodes": 100},
        "fleet": {"num_clients": 5, "capacities": [1.0, 0.5, 0.25, 0.125, 0.0625]},
        "mask": {"policy": "importance"},
        "algorithm": {
            "name": "rabo",
            "inner_lr": 0.5,
            "outer_lr": 0.1,
            "inner_steps": 5,
            "max_hypergrad_norm": 1.0,
            **algorithm,
        },
    }


def untrained_and_final(cfg: dict[str, Any]) -> tuple[float, float]:
    parsed = parse_config(cfg)
    exp = build(parsed)
    sim = exp.simulation
    untrained = sim.evaluate(sim.algorithm.model_state(exp.initial_state))["accuracy"]
    return untrained, run(parsed, progress=False, save=False).final["test_accuracy"]


@pytest.mark.float_sensitive
@pytest.mark.parametrize("seed", [0, 1])
def test_masked_rabo_improves_the_backbone_on_omniglot(seed: int) -> None:
    """12 rounds, Conv-4 width 16, 100 fixed meta-test episodes. Measured (AVX-512 kernels):
    seed 0 untrained 0.501 -> 0.636, seed 1 0.464 -> 0.581 (+0.135, +0.117); asserted +0.06.
    At this width Alg. 1 as printed learns; at width 32 and beyond it does not (the slow test
    below and BENCHMARKS.md, "RABO on Omniglot")."""
    untrained, final = untrained_and_final(config(seed, rounds=12, width=16))

    assert final >= untrained + 0.06


@pytest.mark.slow
@pytest.mark.float_sensitive
def test_at_width_32_rabo_learns_only_with_the_refit() -> None:
    """30 rounds, Conv-4 width 32, seed 0 (about 5 minutes). Measured: untrained 0.631;
    Alg. 1 as printed 0.651 (its outer loss climbs from 1.6 to 3.5); ``refit_steps = 100``
    0.795 (outer loss falls from 0.98 to 0.77)."""
    untrained, printed = untrained_and_final(config(0, rounds=30, width=32))
    _, refit = untrained_and_final(config(0, rounds=30, width=32, refit_steps=100))

    assert refit >= untrained + 0.10
    assert refit >= printed + 0.08
