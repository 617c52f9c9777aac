"""Shared config helpers for the tests: the demo config and small variants of it."""

import tomllib
from pathlib import Path

from radbo.config import RunConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.toml"


def demo_dict() -> dict:
    return tomllib.loads(DEMO.read_text())


def small_config(**overrides) -> RunConfig:
    """The demo config, 4 rounds, with ``overrides`` merged into its sections (a section with
    another kind replaces the demo's). An algorithm override without an ``estimator`` drops the
    demo's ``[estimator]`` (cg): the algorithm then runs with its own default estimator.

    The backend is the sequential one unless ``runtime`` names another: the tests compare runs
    with the reference arithmetic (the processes and Flower backends equal it bitwise; the
    default ``auto`` stacks the demo MLP's families, equal to it to float rounding only)."""
    data = demo_dict()
    data.update(rounds=4, eval_every=2)
    data["runtime"] = {"backend": "sequential", **data.get("runtime", {})}
    if "algorithm" in overrides and "estimator" not in overrides:
        data.pop("estimator", None)
    for key, value in overrides.items():
        replaces = key in ("model", "estimator") or (
            isinstance(value, dict)
            and "name" in value
            and value["name"] != data.get(key, {}).get("name")
        )
        if isinstance(value, dict) and not replaces:
            data[key] = {**data.get(key, {}), **value}
        else:
            data[key] = value
    return parse_config(data)
