"""A divergence rollback restores the complete state (issue 26).

The run here has every kind of state RABO carries: the outer and inner parameters, BatchNorm
running statistics averaged by the server (``buffers``) and the first-order estimator's state
(``aux``: its ``y_lambda`` and ``z``). A round is made to diverge (a NaN written into x after
it ran), the guard rolls back; the state it keeps must be the last good one in every tensor,
and the rounds after it must be exactly those of a fresh simulation that starts from that state
with the damped step sizes -- so nothing of the diverged round survives anywhere: not in the
algorithm, the estimator, the submodel skeletons' BatchNorm modules, the samplers or the
generators.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from radbo.config import RunConfig
from radbo.experiment import build
from tests.configs import small_config

DIVERGED_ROUND = 2


def config(**algorithm: Any) -> RunConfig:
    return small_config(
        rounds=5,
        model={"name": "cnn"},
        fleet={"capacities": [1.0, 0.5]},
        algorithm={"name": "rabo", "inner_lr": 0.1, "outer_lr": 0.05, **algorithm},
        estimator={"name": "first_order", "lam": 10.0},
        baseline={"enabled": False},
        runtime={"dtype": "float64"},
    )


def same_state(a: Any, b: Any) -> bool:
    """Every field of two algorithm states equal, tensors bitwise."""
    for f in dataclasses.fields(a):
        left, right = getattr(a, f.name), getattr(b, f.name)
        if isinstance(left, dict):
            if left.keys() != right.keys():
                return False
            if not all(torch.equal(t, right[k]) for k, t in left.items()):
                return False
        elif left != right:
            return False
    return True


def records(rounds: Iterator[tuple[Any, Any]]) -> list[tuple[Any, dict]]:
    out = []
    for state, record in rounds:
        row = record.as_dict()
        row.pop("wall_time_s", None)
        out.append((state, row))
    return out


def test_a_rollback_restores_parameters_buffers_and_estimator_state() -> None:
    sim = build(config()).simulation
    state = build(config()).initial_state
    assert state.buffers and state.aux  # BatchNorm statistics and y_lambda / z are there
    real_step = sim.step

    def diverging_step(s: Any, q: int, clock_s: float = 0.0) -> tuple[Any, Any]:
        new, record = real_step(s, q, clock_s)
        if q == DIVERGED_ROUND:  # the round ran (buffers, aux moved); its x blew up
            name = next(iter(new.x))
            x = dict(new.x)
            x[name] = torch.full_like(x[name], math.nan)
            new = replace(new, x=x)
        return new, record

    sim.step = diverging_step  # type: ignore[method-assign]
    run = records(sim.iterate(state, 5))

    good, _ = run[DIVERGED_ROUND - 1]
    rolled, row = run[DIVERGED_ROUND]
    assert row["divergence"]["action"] == "rollback"
    assert row["divergence"]["lr_scale"] == 0.5
    assert same_state(rolled, good)

    # the rounds after the rollback: a fresh simulation from the last good state, its step
    # sizes halved, makes exactly the same ones
    fresh = build(config(inner_lr=0.05, outer_lr=0.025)).simulation
    want = records(fresh.iterate(good, 2, start_round=DIVERGED_ROUND + 1))
    for (got_state, got_row), (want_state, want_row) in zip(
        run[DIVERGED_ROUND + 1 :], want, strict=True
    ):
        assert same_state(got_state, want_state)
        assert got_state.buffers.keys() == good.buffers.keys()
        assert not same_state(got_state, good)  # it trained on
        # everything the round recorded is the same, but for the virtual clock, which kept
        # the diverged round's time (its work was done)
        assert got_row.pop("sim_clock_s") > want_row.pop("sim_clock_s")
        assert got_row == want_row


def inflating_step(sim: Any, at_round: int) -> None:
    """Make round ``at_round`` report a training loss a million times its size: what a round
    shows when the state it starts from is broken (the model and its norm untouched)."""
    real_step = sim.step

    def step(s: Any, q: int, clock_s: float = 0.0) -> tuple[Any, Any]:
        new, record = real_step(s, q, clock_s)
        if q == at_round:
            record.metrics["inner_loss"] = 1e6 * record.metrics["inner_loss"]
        return new, record

    sim.step = step  # type: ignore[method-assign]


def test_a_training_loss_that_trips_the_guard_rolls_back_two_rounds() -> None:
    """A round's training losses are measured at the state it starts from, so when they trip
    the guard that state is the bad one: the rollback restores the state before it (the round
    before, whose own losses passed), not the state the round started from."""
    exp = build(config())
    sim = exp.simulation
    inflating_step(sim, DIVERGED_ROUND)

    run = records(sim.iterate(exp.initial_state, 4))

    rolled, row = run[DIVERGED_ROUND]
    two_back, _ = run[DIVERGED_ROUND - 2]
    assert row["divergence"]["reason"].startswith("inner_loss = ")
    assert row["divergence"]["rolled_back_to"] == DIVERGED_ROUND - 1  # rounds done there
    assert same_state(rolled, two_back)


def test_the_earlier_good_state_survives_a_checkpoint() -> None:
    """Resumed from the engine state after round ``DIVERGED_ROUND - 1`` (through JSON, as a
    checkpoint stores it), the same trip rolls back to the same state as without the resume."""
    whole = build(config()).simulation
    inflating_step(whole, DIVERGED_ROUND)
    want = records(whole.iterate(build(config()).initial_state, 4))

    first = build(config()).simulation
    done = records(first.iterate(build(config()).initial_state, DIVERGED_ROUND))
    tensors, meta = first.state_dict()
    assert any(k.startswith("divergence_previous/") for k in tensors)
    resumed = build(config()).simulation
    resumed.load_state_dict(tensors, json.loads(json.dumps(meta)))
    inflating_step(resumed, DIVERGED_ROUND)
    state, row = done[-1]
    got = records(resumed.iterate(state, 4 - DIVERGED_ROUND, DIVERGED_ROUND, row["sim_clock_s"]))

    for (got_state, got_row), (want_state, want_row) in zip(
        got, want[DIVERGED_ROUND:], strict=True
    ):
        assert same_state(got_state, want_state)
        assert got_row == want_row
