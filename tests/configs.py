"""Shared config helpers for the tests: the demo config and small variants of it."""

import tomllib
from pathlib import Path

from radbo.config import RunConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.toml"


def demo_dict() -> dict:
    return tomllib.loads(DEMO.read_text())


def small_config(**overrides) -> RunConfig:
    data = demo_dict()
    data.update(rounds=4, eval_every=2)
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
