"""``[runtime] memory_format = "channels_last"``: client work reads its image minibatches in
NHWC layout (oneDNN's convolutions and max pooling run faster on it on CPUs,
``benchmarks/vs_pfl.py --backends sequential,sequential:channels_last``); everything it
computes is the contiguous run's to float rounding.

A convolution in another layout sums the same products in another order, so the float64 runs
agree to the bound tests/simulation/test_batched.py derives for reordered sums (1e-10
relative); the ledger (FLOPs, bytes, counts) is exactly the same.
"""

from __future__ import annotations

import pytest
import torch

from radbo.config import ConfigError
from radbo.experiment import build
from tests.configs import small_config
from tests.simulation.test_batched import assert_runs_agree, trajectory

CNN = {"data": {"image_size": 16}, "model": {"name": "cnn7"}}
NHWC = {"memory_format": "channels_last"}


def test_a_clients_image_minibatch_is_channels_last_and_other_inputs_keep_their_layout():
    runtime = build(small_config(**CNN, runtime=NHWC)).simulation.runtime
    assert runtime.channels_last
    one = runtime.batch(torch.tensor([0, 2, 5])).inputs
    assert one.shape == (3, 1, 16, 16)
    assert one.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(one, runtime.features[[0, 2, 5]])  # the same numbers
    # a stacked cohort's minibatches (clients x batch x C x H x W) keep their layout
    stacked = runtime.batch(torch.tensor([[0, 1], [2, 3]])).inputs
    assert stacked.ndim == 5 and stacked.is_contiguous()
    # the default is contiguous
    plain = build(small_config(**CNN)).simulation.runtime
    assert not plain.channels_last
    assert plain.batch(torch.tensor([0, 2])).inputs.is_contiguous()


def test_flat_inputs_are_left_as_they_are():
    runtime = build(small_config(runtime=NHWC)).simulation.runtime  # the demo's MLP
    inputs = runtime.batch(torch.tensor([0, 1])).inputs
    assert inputs.ndim == 2 and inputs.is_contiguous()


@pytest.mark.parametrize(
    "algorithm",
    [{}, {"algorithm": {"name": "fedavg"}}],
    ids=["rabo-cg-masks", "fedavg-masks"],
)
def test_a_channels_last_run_is_the_contiguous_run_to_float64_rounding(algorithm):
    """CNN7 with structured masks, float64: states and metrics to 1e-10 relative, ledgers
    and client lists exactly."""
    base = {**CNN, **algorithm}
    contiguous = trajectory({**base, "runtime": {"dtype": "float64"}})
    nhwc = trajectory({**base, "runtime": {"dtype": "float64", **NHWC}})
    assert_runs_agree(contiguous, nhwc)


def test_the_setting_is_checked_and_left_out_of_dumps_at_its_default():
    with pytest.raises(ConfigError, match="memory_format"):
        small_config(runtime={"memory_format": "nhwc"})
    assert "memory_format" not in small_config().runtime.model_dump()
    assert small_config(runtime=NHWC).runtime.model_dump()["memory_format"] == "channels_last"
