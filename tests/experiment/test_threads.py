"""``[runtime] threads``: radbo.run sets torch's intra-op threads for the run and restores the
caller's setting afterwards (also when the run fails)."""

import pytest
import torch

from radbo.experiment import run
from radbo.experiment.runner import torch_threads
from radbo.simulation import SequentialBackend
from tests.configs import small_config


def test_run_uses_the_configured_threads_and_restores_the_callers(monkeypatch):
    seen = []

    def factory(cfg):
        seen.append(torch.get_num_threads())
        return SequentialBackend()

    before = torch.get_num_threads()
    for threads in (2, 1):
        seen.clear()
        cfg = small_config(rounds=1, eval_every=1, runtime={"threads": threads})
        run(cfg, progress=False, save=False, backend_factory=factory)
        assert seen and set(seen) == {threads}
        assert torch.get_num_threads() == before


def test_threads_none_leaves_torch_alone():
    before = torch.get_num_threads()
    cfg = small_config(rounds=1, eval_every=1, runtime={"threads": None})
    assert cfg.runtime.threads is None
    with torch_threads(None):
        assert torch.get_num_threads() == before


def test_threads_are_restored_when_the_block_fails():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(2):
        assert torch.get_num_threads() == 2
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_default_is_one_thread_and_zero_is_refused():
    assert small_config().runtime.threads == 1
    with pytest.raises(ValueError, match="threads"):
        small_config(runtime={"threads": 0})
