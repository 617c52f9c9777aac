"""The engine's participation policy and its round observers.

The participation cases pin the draws the engine made before the policy was split out of
``Simulation`` (recorded from that code: seed 7, 8 clients); the arrival cases are small
enough to check by hand.
"""

from __future__ import annotations

from typing import Any

import pytest

from radbo.algorithms.fedmsa import FedMSA
from radbo.client import Phase
from radbo.cost import LedgerEntry
from radbo.devices.profile import parse_profile
from radbo.simulation import Participation, RoundRecord, Simulation
from tests.helpers import toy_clients, toy_mlp, toy_simulation

DEVICE = {
    "name": "d",
    "compute_flops": 1.0,
    "memory_bytes": 1,
    "uplink_bps": 1.0,
    "downlink_bps": 1.0,
}


def fleet() -> Participation:
    """8 clients, each available with probability 0.7, but client 5: always, inside its
    window [0, 100) s of every 200 s; K = 3 over-committed by 0.5 (5 sampled); every client
    drops out with probability 0.5."""
    profiles = [parse_profile(DEVICE | {"availability": 0.7}) for _ in range(8)]
    profiles[5] = parse_profile(
        DEVICE | {"availability": 1.0, "windows": [[0, 100]], "period_s": 200.0}
    )
    return Participation(
        8, seed=7, profiles=profiles, clients_per_round=3, dropout=[0.5] * 8, overcommit=0.5
    )


# (round, clock_s) -> available, sampled, unavailable, drops in a 2-phase round
BEFORE = {
    (0, 50.0): ([0, 2, 3, 5, 6, 7], [0, 2, 3, 6, 7], [1, 4], {2: 1, 3: 0, 6: 0}),
    (0, 150.0): ([0, 2, 3, 6, 7], [0, 2, 3, 6, 7], [1, 4, 5], {2: 1, 3: 0, 6: 0}),
    (1, 50.0): ([1, 2, 4, 5, 6, 7], [2, 4, 5, 6, 7], [0, 3], {4: 0, 6: 1, 7: 1}),
    (1, 150.0): ([1, 2, 4, 6, 7], [1, 2, 4, 6, 7], [0, 3, 5], {4: 0, 6: 1, 7: 1}),
    (2, 50.0): ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 5, 7], [0], {2: 0, 5: 0}),
    (2, 150.0): ([1, 2, 3, 4, 6, 7], [1, 2, 3, 4, 6], [0, 5], {2: 0, 6: 0}),
}


@pytest.mark.parametrize(("round", "clock_s"), sorted(BEFORE))
def test_turnout_is_the_draw_of_the_engine_before_the_split(round: int, clock_s: float) -> None:
    available, sampled, unavailable, drops = BEFORE[round, clock_s]

    turnout = fleet().turnout(round, clock_s, num_phases=2)

    assert turnout.available == available
    assert turnout.sampled == sampled  # ceil(3 x 1.5) = 5 of them, or all when fewer
    assert turnout.unavailable == unavailable
    assert turnout.needed == 3
    assert turnout.drops == drops
    # client 5 is always drawn available; its window decides
    assert (5 in available) == (clock_s < 100.0)


def test_simulation_answers_with_its_participation_policy() -> None:
    policy = fleet()
    toy = toy_mlp(160)
    sim = toy_simulation(
        None,
        toy,
        toy_clients(8),
        seed=7,
        profiles=policy.profiles,
        clients_per_round=3,
        dropout=[0.5] * 8,
        overcommit=0.5,
    )

    for (round, clock_s), (available, sampled, _, drops) in BEFORE.items():
        assert sim.available_clients(round, clock_s) == available
        assert sim.sample_clients(round, clock_s=clock_s) == sampled
        assert sim.dropouts(round, sampled, 2) == drops
    assert sim.needed_clients(6) == 3


def test_a_replaced_setting_makes_a_new_policy_and_an_unchanged_one_keeps_it() -> None:
    toy = toy_mlp(60)
    sim = toy_simulation(None, toy, toy_clients(3), dropout=[0.0] * 3)
    kept = sim.participation

    assert sim.participation is kept
    sim.dropout = [1.0, 0.0, 0.0]
    assert sim.participation is not kept
    assert sim.dropouts(0, [0, 1, 2], 1) == {0: 0}
    with pytest.raises(ValueError, match="dropout probabilities must be in"):
        sim.dropout = [2.0, 0.0, 0.0]
        sim.participation  # noqa: B018


def entry(client: int, time_s: float) -> LedgerEntry:
    """A ledger entry of ``client`` whose result arrives after ``time_s`` seconds."""
    zero = {"flops": 0, "n_grad": 0, "n_hvp": 0, "samples": 0, "bytes_down": 0, "bytes_up": 0}
    return LedgerEntry(
        round=0, phase="p", client=client, tier="", compute_s=time_s, comm_s=0.0, **zero
    )


ENTRIES = [entry(0, 3.0), entry(1, 1.0), entry(2, 2.0), entry(3, 1.0)]


@pytest.mark.parametrize(
    ("deadline", "lost", "target", "late", "duration"),
    [
        # no deadline, all in: everyone arrives, the phase lasts as long as the slowest
        (None, [False] * 4, 4, [False] * 4, 3.0),
        # K = 2 of 3 arriving (client 2 lost): 1 and 3 at 1.0 s; 0 is surplus
        (None, [False, False, True, False], 2, [True, False, False, False], 1.0),
        # a 1.5 s deadline cuts 0 and 2; only two of K = 3 arrive: the phase waits 1.5 s
        (1.5, [False] * 4, 3, [True, False, True, False], 1.5),
        # K = 1: the first to arrive, ties by client id (1 before 3)
        (1.5, [False] * 4, 1, [True, False, True, True], 1.0),
    ],
)
def test_arrivals_by_hand(
    deadline: float | None, lost: list[bool], target: int, late: list[bool], duration: float
) -> None:
    policy = Participation(4, phase_deadline_s=deadline)

    assert policy.arrivals(ENTRIES, lost, target) == (late, duration)


def test_a_phase_selecting_a_client_not_in_the_round_is_refused() -> None:
    policy = Participation(4)
    every = Phase("all", lambda *a: {}, lambda *a: None, lambda s, *a: (s, {}))
    stray = Phase(
        "stray", lambda *a: {}, lambda *a: None, lambda s, *a: (s, {}), select=lambda *a: [3]
    )

    assert policy.phase_members(every, 0, None, [0, 2], round=0) == [0, 2]
    with pytest.raises(ValueError, match=r"phase 'stray' selected clients \[3\]"):
        policy.phase_members(stray, 1, None, [0, 2], round=0)


def test_bad_settings_are_refused_with_a_sentence() -> None:
    with pytest.raises(ValueError, match=r"clients_per_round must be in \[1, 4\], got 5"):
        Participation(4, clients_per_round=5)
    with pytest.raises(ValueError, match="overcommit must be >= 0, got -1"):
        Participation(4, overcommit=-1)
    with pytest.raises(ValueError, match="phase_deadline_s must be > 0 or None, got 0"):
        Participation(4, phase_deadline_s=0)


class Recorder:
    """A round observer that keeps what it sees."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, RoundRecord]] = []

    def on_round(self, state: Any, record: RoundRecord) -> None:
        self.seen.append((state, record))


def fedmsa_simulation(**kw: Any) -> tuple[Simulation[Any], Any]:
    toy = toy_mlp(60)
    algo = FedMSA(
        outer_names=tuple(toy.x),
        inner_names=tuple(toy.y),
        outer_lr=0.2,
        inner_lr=0.5,
        v_lr=0.3,
        local_steps=2,
    )
    sim = toy_simulation(algo, toy, toy_clients(3), seed=3, **kw)
    return sim, algo.init(toy.x, toy.y, {})


def test_observers_see_every_round_in_order_before_it_is_yielded() -> None:
    sim, start = fedmsa_simulation(eval_every=2, evaluate=lambda model: {"loss": 1.0})
    first, second = Recorder(), Recorder()
    yielded = []

    for state, record in sim.iterate(start, 3, start_round=2, observers=(first, second)):
        assert first.seen[-1] == second.seen[-1] == (state, record)  # seen before the yield
        yielded.append((state, record))

    assert first.seen == second.seen == yielded
    assert [r.round for _, r in first.seen] == [2, 3, 4]
    # the records are final when observed: evaluated after rounds 3 (eval_every) and 4 (last)
    assert [r.evaluation is not None for _, r in first.seen] == [False, True, True]
