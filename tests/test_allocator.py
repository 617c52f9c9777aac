"""radbo.allocator: glibc's malloc asked to keep freed memory (``[runtime] allocator``)."""

from __future__ import annotations

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
