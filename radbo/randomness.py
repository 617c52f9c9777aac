"""Named random streams: every random choice of a run comes from its own seeded stream.

A run has one integer seed. Each kind of random choice (the train/test split, the partition,
the model's initial weights, which clients are available in a round, each client's minibatches,
...) draws from a generator seeded by :func:`derive_seed` of the run seed, the choice's
:class:`Stream` and the integers that locate it (round, client, phase). Streams of different
choices are therefore independent, a choice never moves when another changes, and any single
draw can be reproduced without replaying the run before it -- which is what makes checkpoints
and batched or distributed backends reproduce a sequential run exactly.

The stream identifiers are fixed numbers: changing one changes every run's numbers, so a new
kind of draw gets a new member here and nothing else in radbo writes a literal stream id.

>>> derive_seed(0, Stream.SPLIT) == derive_seed(0, Stream.SPLIT)
True
>>> derive_seed(0, Stream.SPLIT) != derive_seed(0, Stream.PARTITION)
True
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import numpy as np
import torch

__all__ = ["Stream", "derive_seed", "derive_seeds", "generator", "task_seed", "task_seeds"]


class Stream(IntEnum):
    """Identifiers of radbo's random streams (the second word given to :func:`derive_seed`)."""

    # -- building a run: derive_seed(run seed, stream [, index])
    SPLIT = 11  #: the stratified train/test split of an embedded data set
    PARTITION = 12  #: which training examples each client holds
    INIT = 13  #: the model's initial weights
    CLIENT_SPLIT = 14  #: each client's inner (training) / outer (validation) split
    FLEET = 15  #: which catalog device each client gets from a tier mix
    CALIBRATION = 16  #: the server's calibration examples for static BatchNorm
    SUBSET = 17  #: limit_train / limit_test subsets (index 0: train, 1: test)
    ALGORITHM = 18  #: an algorithm's own server-side draws (FedMBO's Neumann truncations)
    LONG_TAIL = 19  #: which examples a long-tailed training set keeps
    EVALUATION = 20  #: a task's own evaluation draws (the few-shot test episodes)
    # -- per round: derive_seed(run seed, round, stream [, client or phase])
    AVAILABILITY = 0xA7A1  #: which clients are available in a round
    DROPOUT = 0xD809  #: which sampled clients drop out, and in which phase
    SAMPLE = 0x5A3F  #: which available clients a round samples
    SELECT = 0x5E1  #: a phase's own choice of participants (index: the phase)
    LOCAL_STEPS = 0x7A0  #: a client's local-step count from a schedule (index: the client)
    MASK = 0x3A5C  #: a client's mask choice (index: the client)
    # -- derive_seed(run seed, ONCE, stream, client): drawn once per client for the whole run
    ONCE = 0xF1ED
    # -- an algorithm's draws: derive_seed(algorithm seed, round, stream)
    NEUMANN_TERMS = 0xFED  #: random Neumann truncations: FedMBO's N_i per PHE chain, FedNest's N'


def derive_seed(*words: int) -> int:
    """A 63-bit seed derived from integers (run seed, stream, round, client, ...) by NumPy's
    ``SeedSequence``, so that streams of different words are independent."""
    return int(np.random.SeedSequence([int(w) for w in words]).generate_state(1, np.uint64)[0]) >> 1


# NumPy's SeedSequence constants (numpy/random/bit_generator.pyx, the algorithm of Melissa
# O'Neill's seed_seq_fe, which NumPy cites there)
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _MASK32, _POOL = 0xCA01F9DD, 0x4973F715, 0xFFFFFFFF, 4


def derive_seeds(prefix: Sequence[int], last: Sequence[int]) -> list[int]:
    """``[derive_seed(*prefix, w) for w in last]``, bitwise, in a fixed number of array
    operations: a round's per-client seeds (each task's, each mask's) at once.

    Written by hand because NumPy's ``SeedSequence`` takes one entropy list per object, and
    building one per client was the largest Python cost of a 1,000-client round
    (``benchmarks/round_profile.py``). This is its algorithm (``mix_entropy``, then
    ``generate_state(1, uint64)``) on arrays of 32-bit words, one lane per last word: the
    hash constants depend only on how many words were mixed, so they are the same in every
    lane. Words of more than 32 bits (a run seed of 63 bits) are split into 32-bit words as
    NumPy splits them; a last word of more than 32 bits falls back to :func:`derive_seed`.
    """
    if any(int(w) < 0 for w in (*prefix, *last)):
        raise ValueError("derive_seeds: words must be non-negative integers")
    if any(int(w) > _MASK32 for w in last):
        return [derive_seed(*prefix, w) for w in last]
    head = [word for w in prefix for word in _words(int(w))]
    n = len(last)
    entropy = [np.full(n, w, dtype=np.uint64) for w in head]
    entropy.append(np.asarray([int(w) for w in last], dtype=np.uint64).reshape(n))
    const = _INIT_A

    def hashmix(value: Any) -> Any:  # uint64 arrays holding 32-bit words
        nonlocal const
        value = value ^ np.uint64(const)
        const = (const * _MULT_A) & _MASK32
        value = (value * np.uint64(const)) & np.uint64(_MASK32)
        return value ^ (value >> np.uint64(16))

    def mix(x: Any, y: Any) -> Any:
        result = (x * np.uint64(_MIX_L) - y * np.uint64(_MIX_R)) & np.uint64(_MASK32)
        return result ^ (result >> np.uint64(16))

    zeros = np.zeros(n, dtype=np.uint64)
    pool = [hashmix(entropy[i] if i < len(entropy) else zeros) for i in range(_POOL)]
    for i_src in range(_POOL):
        for i_dst in range(_POOL):
            if i_src != i_dst:
                pool[i_dst] = mix(pool[i_dst], hashmix(pool[i_src]))
    for i_src in range(_POOL, len(entropy)):
        for i_dst in range(_POOL):
            pool[i_dst] = mix(pool[i_dst], hashmix(entropy[i_src]))
    out, const = [], _INIT_B
    for i_dst in range(2):  # two 32-bit words, little-endian: one uint64
        value = pool[i_dst] ^ np.uint64(const)
        const = (const * _MULT_B) & _MASK32
        value = (value * np.uint64(const)) & np.uint64(_MASK32)
        out.append(value ^ (value >> np.uint64(16)))
    return [int(v) >> 1 for v in (out[0] | (out[1] << np.uint64(32)))]


def _words(n: int) -> list[int]:
    """``n`` as NumPy's SeedSequence reads an integer: 32-bit words, least significant first
    (``[0]`` for 0)."""
    words = [0] if n == 0 else []
    while n > 0:
        words.append(n & _MASK32)
        n >>= 32
    return words


def generator(*words: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed` of ``words``."""
    return torch.Generator().manual_seed(derive_seed(*words))


def task_seed(seed: int, round: int, phase: int, client: int) -> int:
    """The seed of one client's task: its minibatches and any other draw of its local work in
    ``round``, phase number ``phase`` (0-based). A client's draws depend on nothing else, so
    every backend reproduces them."""
    return derive_seed(seed, round, phase + 1, client)


def task_seeds(seed: int, round: int, phase: int, clients: Sequence[int]) -> list[int]:
    """``[task_seed(seed, round, phase, c) for c in clients]``, bitwise, at once
    (:func:`derive_seeds`)."""
    return derive_seeds((seed, round, phase + 1), clients)
