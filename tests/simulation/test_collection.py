"""The cyclic garbage collector paused for a round (``Simulation.pause_gc``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from radbo.experiment import build
from radbo.simulation import Simulation
from radbo.simulation.collection import paused_collection
from tests.configs import small_config


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    """Whatever a test does, the collector runs again after it."""
    yield
    gc.enable()


def test_the_block_runs_paused_and_the_collector_runs_again_after():
    assert gc.isenabled()
    with paused_collection():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_collector_runs_again_when_the_block_raises():
    with pytest.raises(RuntimeError, match="in the round"), paused_collection():
        raise RuntimeError("in the round")
    assert gc.isenabled()


def test_a_collector_paused_already_stays_paused_and_pause_false_changes_nothing():
    gc.disable()
    with paused_collection():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the caller paused it: not ours to restart
    gc.enable()
    with paused_collection(pause=False):
        assert gc.isenabled()
    with paused_collection(), paused_collection():  # a round inside a round
        assert not gc.isenabled()
    assert gc.isenabled()


@pytest.mark.parametrize("pause", [True, False])
def test_a_round_runs_with_the_collector_as_pause_gc_says(monkeypatch, pause):
    exp = build(small_config())
    exp.simulation.pause_gc = pause
    seen = []
    real = Simulation._step

    def spy(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Simulation, "_step", spy)
    exp.simulation.step(exp.initial_state, 0)
    assert seen == [not pause]
    assert gc.isenabled()


def test_the_collector_changes_no_result():
    """Two rounds with the collector paused and two with it running (and forced to collect
    in between) give bitwise the same states and records: nothing a round computes depends on
    when the collector runs."""
    outcomes = []
    for pause in (True, False):
        exp = build(small_config())
        sim, state = exp.simulation, exp.initial_state
        sim.pause_gc = pause
        records = []
        for q in range(2):
            gc.collect()
            state, record = sim.step(state, q)
            records.append((record.clients, record.metrics, record.ledger))
        outcomes.append((state, records))
    (a, ra), (b, rb) = outcomes
    for field in ("x", "y"):
        left, right = getattr(a, field), getattr(b, field)
        assert left.keys() == right.keys()
        assert all(torch.equal(left[k], right[k]) for k in left)
    assert ra == rb
