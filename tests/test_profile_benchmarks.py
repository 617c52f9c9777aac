"""Smoke tests of the issue 30 profiling scripts at their smallest, on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_scatter_order_probe_finds_every_way_bitwise_on_the_cpu():
    out = _run("benchmarks/scatter_order.py", "--clients", "12")
    assert re.search(r"12 clients on cpu: client by client [\d.]+ ms", out)
    ways = re.findall(
        r"\n  (\S+ \(deterministic \w+\)|add_at_many\(flat=\w+\)): bitwise (\w+)", out
    )
    assert len(ways) == 6 and all(equal == "True" for _, equal in ways)


def test_the_round_profile_lists_operations_call_sites_and_functions():
    out = _run(
        "benchmarks/round_profile.py",
        "--clients", "4", "--rounds", "1", "--top", "3", "--sites-of", "aten::randperm",
    )  # fmt: skip
    assert re.search(r"## 4 clients, batched: median [\d.]+ ms per round", out)
    assert re.search(r"aten operations: \d+ \(nested ones included\)", out)
    assert re.search(r"\d+  aten::randperm  radbo/problem\.py\(\d+\): draw_", out)
    assert "radbo functions by own time:" in out and "radbo/simulation/engine.py" in out
