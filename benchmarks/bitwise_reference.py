"""Bitwise regression check: record runs today, compare after a refactoring.

Runs the demo config (3 rounds, with its baseline), CNN7 on 16x16 digits (3 rounds sequential,
2 batched) and 2 rounds of every case of ``tests/algorithms/test_algorithm_conformance.py`` on the
sequential and the batched backend, plus a batched run with uneven local steps per client
(``fleet.local_steps = "uniform"`` over 1-3: then every algorithm with a budget of local
steps runs each client's own count), which drives the masking of finished clients. For each
run it keeps the round records (without ``wall_time_s``), the ledger, the totals and the
final state's tensors.

    PYTHONPATH=. .venv/bin/python benchmarks/bitwise_reference.py --save /tmp/ref
    # ... change the code ...
    PYTHONPATH=. .venv/bin/python benchmarks/bitwise_reference.py --check /tmp/ref

``--check`` exits 1 unless every record, ledger row and tensor is bitwise the same
(``torch.equal``, dtypes included); for a run that differs it names the parts (``rounds``,
``ledger``, ``final``, ``totals``, ``baseline``) and how far its tensors moved. A run the
reference has no record of (a case added since) is listed as new and not compared;
``--only SUBSTRING`` restricts the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from radbo.config import RunConfig, load_config, parse_config
from radbo.experiment import run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.algorithms.test_algorithm_conformance import CASES, config  # noqa: E402

UNEVEN = {"local_steps": "uniform", "local_steps_range": [1, 3]}


def sequential(config: RunConfig, rounds: int) -> RunConfig:
    """``config`` for ``rounds`` rounds on the sequential backend (the reference arithmetic;
    the default ``auto`` backend stacks the demo's families)."""
    runtime = config.runtime.model_copy(update={"backend": "sequential"})
    return config.model_copy(update={"rounds": rounds, "runtime": runtime})


def runs() -> Iterator[tuple[str, Callable[[], RunConfig]]]:
    yield "demo", lambda: sequential(load_config(ROOT / "examples" / "demo.toml"), rounds=3)
    cnn7 = {"seed": 0, "data": {"name": "digits", "image_size": 16}, "model": {"name": "cnn7"}}
    yield "cnn7", lambda: parse_config({**cnn7, "rounds": 3, "runtime": {"backend": "sequential"}})
    yield (
        "cnn7-batched",
        lambda: parse_config({**cnn7, "rounds": 2, "runtime": {"backend": "batched"}}),
    )
    for case in CASES:
        yield f"{case}", lambda case=case: config(case)
        yield (
            f"{case}-batched",
            lambda case=case: config(case, runtime={"dtype": "float64", "backend": "batched"}),
        )

        def uneven(case: str = case) -> RunConfig:
            _, _, overrides = CASES[case]
            fleet = {**overrides.get("fleet", {"num_clients": 4, "capacities": [1.0, 0.5]})}
            fleet.update(UNEVEN)
            extra: dict[str, Any] = {
                "fleet": fleet,
                "runtime": {"dtype": "float64", "backend": "batched"},
            }
            return config(case, **extra)

        yield f"{case}-uneven", uneven


def tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a state dataclass (dict fields, nested dataclasses), keyed by path."""
    out: dict[str, torch.Tensor] = {}
    if dataclasses.is_dataclass(state):
        for f in dataclasses.fields(state):
            out.update(tensors(getattr(state, f.name), f"{prefix}{f.name}/"))
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(tensors(v, f"{prefix}{k}/"))
    elif isinstance(state, torch.Tensor):
        out[prefix.rstrip("/")] = state.detach().clone().contiguous()
    return out


def record(result: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    rounds = [{k: v for k, v in r.items() if k != "wall_time_s"} for r in result.rounds]
    info = {
        "rounds": rounds,
        "ledger": result.ledger,
        "final": result.final,
        "totals": result.totals,
    }
    state = tensors(result.state)
    if result.baseline is not None:
        base_info, base_state = record(result.baseline)
        info["baseline"] = base_info
        state.update({f"baseline/{k}": t for k, t in base_state.items()})
    return info, state


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |a|`` over a tensor (inf for other dtypes or shapes; 0 for equal
    integer tensors): how far a differing tensor moved, for the report."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    scale = a.abs().max().item() if a.numel() else 0.0
    return (a - b).abs().max().item() / scale if scale > 0 else float("inf")


def canonical(info: dict[str, Any]) -> str:
    return json.dumps(info, sort_keys=True, indent=1, default=repr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", type=Path)
    mode.add_argument("--check", type=Path)
    parser.add_argument("--only", default=None)
    args = parser.parse_args()
    folder: Path = args.save or args.check
    folder.mkdir(parents=True, exist_ok=True)
    failures = []
    for name, make in runs():
        if args.only and args.only not in name:
            continue
        start = time.perf_counter()
        result = run(make(), progress=False, save=False)
        info, state = record(result)
        text = canonical(info)
        if args.save:
            (folder / f"{name}.json").write_text(text)
            save_file(state, str(folder / f"{name}.safetensors"))
            verdict = "saved"
        elif not (folder / f"{name}.json").exists():
            verdict = "new: no reference"  # a case added after the reference was recorded
        else:
            problems = []
            saved, now = json.loads((folder / f"{name}.json").read_text()), json.loads(text)
            problems += [
                f"{k} differ"
                for k in sorted(saved.keys() | now.keys())
                if saved.get(k) != now.get(k)
            ]
            ref = load_file(str(folder / f"{name}.safetensors"))
            if ref.keys() != state.keys():
                problems.append(f"state keys differ: {sorted(ref.keys() ^ state.keys())}")
            else:
                apart = [(k, t, state[k]) for k, t in ref.items() if not same(t, state[k])]
                if apart:
                    worst = max(relative_difference(t, u) for _, t, u in apart)
                    problems.append(
                        f"{len(apart)} of {len(ref)} tensors differ (max relative {worst:.1e})"
                    )
                    problems += [f"tensor {k} differs" for k, _, _ in apart]
            verdict = "equal" if not problems else "DIFFERENT: " + "; ".join(problems[:5])
            if problems:
                failures.append(name)
        print(f"{name:40s} {verdict} ({time.perf_counter() - start:.1f}s)", flush=True)
    if failures:
        print(f"{len(failures)} run(s) differ: {failures}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
