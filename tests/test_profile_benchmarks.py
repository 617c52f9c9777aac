"""Smoke tests of the issue 30 profiling scripts at their smallest, on the CPU."""

from __future__ import annotations

import re

from tests.helpers import run_script


def test_the_scatter_order_probe_finds_every_way_bitwise_on_the_cpu():
    out = run_script("benchmarks/scatter_order.py", "--clients", "12")
    assert re.search(r"12 clients on cpu: client by client [\d.]+ ms", out)
    ways = re.findall(
        r"\n  (\S+ \(deterministic \w+\)|add_at_many\(flat=\w+\)): bitwise (\w+)", out
    )
    assert len(ways) == 6 and all(equal == "True" for _, equal in ways)


def test_the_round_profile_lists_operations_call_sites_and_functions():
    out = run_script(
        "benchmarks/round_profile.py",
        "--clients", "4", "--rounds", "1", "--top", "3", "--sites-of", "aten::randperm",
    )  # fmt: skip
    assert re.search(r"## 4 clients, batched: median [\d.]+ ms per round", out)
    assert re.search(r"aten operations: \d+ \(nested ones included\)", out)
    assert re.search(r"\d+  aten::randperm  radbo/problem\.py\(\d+\): draw_", out)
    assert "radbo functions by own time:" in out and "radbo/simulation/engine.py" in out
