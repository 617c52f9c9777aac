"""The samplers' many-step draws (``inner_steps`` / ``outer_steps`` / ``pair_steps``) are
exactly what one call per step draws, from the generator in the same order: the same
minibatches and the same generator state after (so every later draw is the same too)."""

from __future__ import annotations

import pytest
import torch

from radbo.problem import ClientData, MinibatchSampler, draw_indices, draw_steps
from radbo.tasks.few_shot import EpisodeSampler


def generators() -> tuple[torch.Generator, torch.Generator]:
    return torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)


def same_state(a: torch.Generator, b: torch.Generator) -> bool:
    return torch.equal(a.get_state(), b.get_state())


# a client with fewer examples than a minibatch (3 < 5) and one with more; permuted indices
DATA = [
    ClientData(inner=torch.tensor([40, 7, 13]), outer=torch.tensor([2, 99])),
    ClientData(inner=torch.randperm(30)[:17] * 3, outer=torch.arange(100, 120)),
]


@pytest.mark.parametrize("data", DATA, ids=["small", "large"])
@pytest.mark.parametrize("steps", [1, 4, 10])
def test_many_steps_draw_what_one_call_per_step_draws(data, steps):
    sampler = MinibatchSampler()
    for name in ("inner", "outer"):
        one, many = generators()
        each = [getattr(sampler, name)(data, 5, one) for _ in range(steps)]
        got = getattr(sampler, f"{name}_steps")(data, 5, steps, many)
        assert got.dtype == each[0].dtype and torch.equal(got, torch.stack(each)), name
        assert same_state(one, many)
    one, many = generators()
    pairs = [sampler.pair(data, 5, 4, one) for _ in range(steps)]
    inner, outer = sampler.pair_steps(data, 5, 4, steps, many)
    assert torch.equal(inner, torch.stack([i for i, _ in pairs]))
    assert torch.equal(outer, torch.stack([o for _, o in pairs]))
    assert same_state(one, many)


def test_draw_steps_interleaves_its_sources_step_by_step_and_takes_no_steps():
    a, b = torch.arange(10, 22), torch.arange(50, 53)
    one, many = generators()
    expected = [(draw_indices(a, 4, one), draw_indices(b, 8, one)) for _ in range(3)]
    got_a, got_b = draw_steps([(a, 4), (b, 8)], 3, many)
    assert got_a.shape == (3, 4) and got_b.shape == (3, 3)  # b holds 3 < 8
    assert torch.equal(got_a, torch.stack([x for x, _ in expected]))
    assert torch.equal(got_b, torch.stack([y for _, y in expected]))
    none_a, none_b = draw_steps([(a, 4), (b, 8)], 0, many)
    assert none_a.shape == (0, 4) and none_b.shape == (0, 3) and none_a.dtype == a.dtype


def test_episodes_of_many_steps_are_the_episodes_one_by_one():
    labels = torch.arange(8).repeat_interleave(10)
    pool = torch.cat([torch.arange(0, 30), torch.arange(40, 80)])
    sampler = EpisodeSampler(labels, ways=3, shots=2, queries=4, shuffle=True)
    data = ClientData(inner=pool, outer=pool)
    one, many = generators()
    pairs = [sampler.pair(data, 0, 0, one) for _ in range(4)]
    support, query = sampler.pair_steps(data, 0, 0, 4, many)
    assert torch.equal(support, torch.stack([s for s, _ in pairs]))
    assert torch.equal(query, torch.stack([q for _, q in pairs]))
    assert same_state(one, many)
    for name in ("inner", "outer"):
        one, many = generators()
        each = [getattr(sampler, name)(data, 0, one) for _ in range(2)]
        assert torch.equal(getattr(sampler, f"{name}_steps")(data, 0, 2, many), torch.stack(each))
        assert same_state(one, many)
    empty_s, empty_q = sampler.pair_steps(data, 0, 0, 0, many)
    assert empty_s.shape == (0, 6) and empty_q.shape == (0, 12)
