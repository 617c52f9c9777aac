"""radbo.randomness: the per-client seeds of a round at once equal NumPy's SeedSequence."""

from __future__ import annotations

import random

import pytest

from radbo.randomness import Stream, derive_seed, derive_seeds, task_seed, task_seeds


def test_derive_seeds_equal_derive_seed_word_for_word():
    """Bitwise NumPy's SeedSequence (via derive_seed) for prefixes of 0 to 6 words, each of
    0, 1 or 2 32-bit words (a 63-bit run seed), so that the entropy is shorter than, as long
    as and longer than the pool of 4, and last words from 0 to 2**32 - 1."""
    rng = random.Random(0)
    for _ in range(200):
        prefix = [
            rng.choice([0, 1, rng.randrange(100), rng.randrange(2**32), rng.randrange(2**63)])
            for _ in range(rng.randrange(7))
        ]
        last = [
            rng.choice([0, 2**32 - 1, rng.randrange(1000), rng.randrange(2**32)]) for _ in range(9)
        ]
        assert derive_seeds(prefix, last) == [derive_seed(*prefix, w) for w in last]


def test_derive_seeds_give_the_engine_its_task_and_mask_seeds():
    clients = [0, 3, 999, 12]
    assert derive_seeds((7, 5, 2), clients) == [task_seed(7, 5, 1, c) for c in clients]
    assert task_seeds(2**63 - 1, 9, 0, clients) == [task_seed(2**63 - 1, 9, 0, c) for c in clients]
    mask = [derive_seed(2**62 + 11, 4, Stream.MASK, c) for c in clients]
    assert derive_seeds((2**62 + 11, 4, Stream.MASK), clients) == mask


def test_derive_seeds_edge_cases():
    assert derive_seeds((1, 2), []) == []
    assert derive_seeds((), [5]) == [derive_seed(5)]
    assert derive_seeds((1,), [2**40, 3]) == [derive_seed(1, 2**40), derive_seed(1, 3)]
    with pytest.raises(ValueError, match="non-negative"):
        derive_seeds((1,), [-1])
