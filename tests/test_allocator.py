"""radbo.allocator: glibc's malloc asked to keep freed memory (``[runtime] allocator``)."""

from __future__ import annotations

import json
import platform
import resource
import subprocess
import sys

import pytest

import radbo.allocator as allocator
import radbo.experiment.runner as runner
from radbo.experiment import run
from tests.configs import small_config

# That a kept heap spares a simulation its page faults is measured on a real fleet, in a
# process of its own: tests/test_profile_benchmarks.py (benchmarks/host_settings.py).


@pytest.fixture
def fresh_state(monkeypatch):
    """The module as in a process that has not called it, with a libc of the test's choice."""
    monkeypatch.setitem(allocator._state, "retained", False)
    return monkeypatch


class FakeLibc:
    """A libc whose ``mallopt`` records its calls and takes values up to ``cap``."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return int(value <= self.cap)


def test_both_thresholds_are_set_mmap_first_and_once(fresh_state):
    libc = FakeLibc(cap=1 << 40)
    fresh_state.setattr(allocator, "_glibc", lambda: libc)
    assert allocator.retain_freed_memory() and allocator.retained()
    assert libc.calls == [(-3, allocator.MMAP_THRESHOLD), (-1, allocator.TRIM_THRESHOLD)]
    assert allocator.retain_freed_memory()
    assert len(libc.calls) == 2  # once per process


class OlderGlibc(FakeLibc):
    """Takes any trim threshold but no mmap threshold above 32 MiB."""

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return int(param == -1 or value <= 32 << 20)


def test_an_older_glibc_gets_its_largest_mmap_threshold(fresh_state):
    libc = OlderGlibc(cap=0)
    fresh_state.setattr(allocator, "_glibc", lambda: libc)
    assert allocator.retain_freed_memory()
    assert libc.calls == [(-3, 1 << 30), (-3, 32 << 20), (-1, allocator.TRIM_THRESHOLD)]


def test_a_refused_mmap_threshold_changes_nothing_else(fresh_state):
    """A trim threshold set alone would fix the mmap threshold at 128 KiB: never set it then."""
    libc = FakeLibc(cap=0)
    fresh_state.setattr(allocator, "_glibc", lambda: libc)
    assert not allocator.retain_freed_memory() and not allocator.retained()
    assert all(param == -3 for param, _ in libc.calls)


def test_another_c_library_is_left_alone(fresh_state):
    fresh_state.setattr(allocator, "_glibc", lambda: None)
    assert not allocator.retain_freed_memory() and not allocator.retained()


@pytest.mark.parametrize(("setting", "calls"), [("retain", 1), ("system", 0)])
def test_a_run_applies_the_setting_of_its_config(monkeypatch, tmp_path, setting, calls):
    seen = []
    monkeypatch.setattr(runner, "retain_freed_memory", lambda: seen.append(1) or True)
    cfg = small_config(rounds=1, runtime={"allocator": setting}, baseline={"enabled": False})
    run(cfg, progress=False, save=False, output_dir=tmp_path)
    assert len(seen) == calls


# Frees the heap's top in 128 MiB blocks, last allocated first, and counts the page faults of
# allocating and writing the same blocks again. Run in a process of its own: the setting is the
# process's for good. "retain" is radbo's setting; "cliff" is radbo's setting with the 1 GiB
# trim threshold it set before.
HEAP_CYCLE = r"""
import ctypes, json, resource, sys
import radbo.allocator as allocator
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
assert allocator.retain_freed_memory()
if sys.argv[1] == "cliff":
    assert libc.mallopt(allocator._M_TRIM_THRESHOLD, 1 << 30) == 1
SIZE, COUNT = 128 << 20, 9

def write_blocks():
    blocks = [libc.malloc(SIZE) for _ in range(COUNT)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, SIZE)
    return blocks

for b in reversed(write_blocks()):
    libc.free(b)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
write_blocks()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
"""


def heap_cycle_faults(setting: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", HEAP_CYCLE, setting],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_a_freed_heap_top_stays_mapped_whatever_its_size():
    """glibc gives back the *whole* free top of its heap once it reaches the trim threshold:
    with 1 GiB, freeing 9 blocks of 128 MiB reaches it at the 8th, and 1 GiB less the 128 KiB
    of ``M_TOP_PAD`` is unmapped: writing the blocks again faults (1 GiB - 128 KiB) / page size
    pages in (262,112 with 4 KiB pages, measured exactly so). radbo turns trimming off: the
    same cycle faults almost nothing (0 measured; the bound leaves 1 % of the 1,152 MiB to the
    interpreter's own allocations)."""
    page = resource.getpagesize()
    trimmed = ((1 << 30) - (128 << 10)) // page
    assert heap_cycle_faults("cliff") >= 0.9 * trimmed
    assert heap_cycle_faults("retain") <= 0.01 * (9 * (128 << 20)) // page
