"""Strict JSON out (issue 28, item 6): every JSON file radbo writes parses with a strict
parser -- one that refuses ``NaN`` and ``Infinity``, as ``jq`` and JavaScript do -- even for a
run whose savings are 0/0 (no client ever available), where the fractions are ``null`` with a
reason beside them and the summary prints "-" instead of "nan%"."""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest

import radbo.cost
import radbo.jsonio
from radbo.cli import main
from radbo.cost import savings, savings_at_accuracy
from radbo.jsonio import dumps, finite, loads_strict
from tests.configs import DEMO

NAN, INF = float("nan"), float("inf")
_TOTALS = ("flops", "bytes", "bytes_up", "bytes_down", "sim_time_s", "energy_j")
_TOTALS += ("energy_compute_j", "energy_radio_j")


def strict(path: Path) -> Any:
    """``path`` parsed by a strict JSON parser (NaN, Infinity and -Infinity refused)."""
    text = path.read_text(encoding="utf-8")
    for word in ("NaN", "Infinity"):  # not even inside what a lenient parser would take
        assert f": {word}" not in text and f"[{word}" not in text, path
    return loads_strict(text)


def nulls(data: Any, where: str = "") -> list[str]:
    """Where ``data`` holds ``null``."""
    if data is None:
        return [where]
    if isinstance(data, dict):
        return [w for k, v in data.items() for w in nulls(v, f"{where}.{k}")]
    if isinstance(data, list):
        return [w for i, v in enumerate(data) for w in nulls(v, f"{where}[{i}]")]
    return []


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------- the encoder
def test_dumps_writes_non_finite_floats_as_null_at_any_depth() -> None:
    data = {"a": NAN, "b": [1.5, INF, (-INF, 2)], "c": {"d": {"e": NAN}}, "f": True, "g": 3}

    text = dumps(data, indent=1)

    assert loads_strict(text) == {
        "a": None,
        "b": [1.5, None, [None, 2]],
        "c": {"d": {"e": None}},
        "f": True,
        "g": 3,
    }
    assert math.isnan(data["a"])  # the input is left as it was


def test_dumps_of_finite_data_is_json_dumps() -> None:
    data = {"x": [0.1, 1e300, -5e-324], "y": "NaN", "z": None}

    assert dumps(data, indent=2, sort_keys=True) == json.dumps(data, indent=2, sort_keys=True)
    assert finite(data) == data


def test_dumps_takes_no_allow_nan() -> None:
    with pytest.raises(TypeError, match="allow_nan"):
        dumps({}, allow_nan=True)


@pytest.mark.parametrize("text", ['{"a": NaN}', "[Infinity]", '{"b": [1, -Infinity]}'])
def test_loads_strict_refuses_what_strict_parsers_refuse(text: str) -> None:
    with pytest.raises(ValueError, match="not strict JSON"):
        loads_strict(text)
    assert json.loads(text)  # which Python's own parser takes


def test_undefined_savings_carry_a_reason() -> None:
    nothing = {"flops": 0, "bytes": 0, "bytes_up": 0, "bytes_down": 0, "sim_time_s": 0.0}

    sv = savings(nothing, nothing)
    written = loads_strict(dumps(sv))

    assert all(written[k] is None for k in sv if k.endswith("_fraction"))
    assert set(written["reasons"]) == {k for k in sv if k.endswith("_fraction")}
    assert written["reasons"]["compute_fraction"] == (
        "undefined: the baseline's compute (FLOPs) is 0: no client of it ran (none was available?)"
    )
    spent = dict.fromkeys(_TOTALS, 1.0)
    assert "reasons" not in savings(spent, spent)  # every fraction defined: nothing to say


def test_savings_at_accuracy_not_reached_says_who() -> None:
    rows = [
        {
            "round": 0,
            "communication_rounds": 1,
            "cost_flops": 1,
            "cost_bytes": 1,
            "sim_clock_s": 1.0,
            "test_accuracy": 0.5,
        }
    ]

    sv = savings_at_accuracy(rows, {"test_accuracy": 0.9}, rows, {"test_accuracy": 0.9})

    assert sv is not None and math.isnan(sv["compute_fraction"])
    assert sv["reasons"]["compute_fraction"] == (
        "undefined: the run and the baseline never reached the target"
    )
    assert loads_strict(dumps(sv))["compute_fraction"] is None


@pytest.mark.parametrize("module", [radbo.jsonio, radbo.cost], ids=lambda m: m.__name__)
def test_the_doctests_hold(module: Any) -> None:
    result = doctest.testmod(module)

    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------- real runs, every file they write
TRACE = {str(c): {"computation": 1.0, "communication": 1000.0} for c in range(3)}
#: no client is ever available: nothing is trained, every saving is 0 / 0
UNAVAILABLE = """
rounds = 2
eval_every = 1
[model]
name = "mlp"
hidden = [16]
[fleet]
num_clients = 3
[fleet.trace]
path = "{trace}"
flops_per_sample = 1e6
memory_bytes = 1000000000
availability = 0.0
[algorithm]
name = "rabo"
inner_steps = 2
[baseline]
enabled = true
terms = 2
"""


@pytest.fixture(scope="module")
def unavailable(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The output folder of the no-client-available config run under seeds 0 and 1, and
    what ``radbo run`` printed."""
    tmp = tmp_path_factory.mktemp("unavailable")
    trace = tmp / "trace.json"
    trace.write_text(json.dumps(TRACE))
    config = tmp / "off.toml"
    config.write_text(UNAVAILABLE.format(trace=trace))
    out = tmp / "out"

    code, printed, err = cli("run", str(config), "--quiet", "--output-dir", str(out))
    assert (code, err) == (0, ""), err
    code, _, err = cli(
        "run", str(config), "--quiet", "--output-dir", str(out / "seeds"), "--seeds", "0", "1"
    )
    assert (code, err) == (0, ""), err
    return out, printed


def test_a_run_with_no_client_available_writes_strict_json(
    unavailable: tuple[Path, str],
) -> None:
    out, printed = unavailable

    results = strict(out / "results.json")
    assert strict(out / "ledger.json") == []  # no client ever ran

    for key in ("savings", "savings_at_accuracy"):
        fractions = [k for k in results[key] if k.endswith("_fraction")]
        assert fractions and all(results[key][k] is None for k in fractions)
        assert set(results[key]["reasons"]) == set(fractions)
        assert all(r.startswith("undefined: ") for r in results[key]["reasons"].values())
    # outside the configs (whose unset settings are null), null only where a figure is
    # undefined: the savings
    figures = [w for w in nulls(results) if not w.startswith((".config.", ".baseline.config."))]
    assert figures and all(w.startswith((".savings.", ".savings_at_accuracy.")) for w in figures)
    # the summary prints "-" for an undefined fraction, never "nan%"
    assert "nan" not in printed.lower()
    assert "at equal rounds (2): compute -, bytes -, simulated time -" in printed


def test_aggregate_json_over_seeds_is_strict(unavailable: tuple[Path, str]) -> None:
    out, _ = unavailable
    seeds = out / "seeds"

    aggregate = strict(seeds / "aggregate.json")
    for seed in (0, 1):
        strict(seeds / f"seed-{seed}" / "results.json")
        strict(seeds / f"seed-{seed}" / "ledger.json")

    assert aggregate["seeds"] == [0, 1]
    assert "nan" not in (seeds / "aggregate.md").read_text().lower()


def test_report_json_of_runs_with_undefined_savings_is_strict(
    unavailable: tuple[Path, str], tmp_path: Path
) -> None:
    out, _ = unavailable

    code, _, err = cli(
        "report", str(out), str(out / "seeds"), "--output", str(tmp_path), "--format", "svg"
    )

    assert (code, err) == (0, "")
    report = strict(tmp_path / "report.json")
    assert len(report["runs"]) == 3
    assert report["runs"][0]["savings"]["compute_fraction"] is None
    assert "nan" not in (tmp_path / "report.md").read_text().lower()


def test_report_reads_null_test_metrics(unavailable: tuple[Path, str], tmp_path: Path) -> None:
    # a test metric that was NaN is null in a results.json now: the report takes it
    out, _ = unavailable
    run = tmp_path / "run"
    run.mkdir()
    results = strict(out / "results.json")
    results["rounds"][0]["test_loss"] = None
    results["initial"]["test_loss"] = None
    (run / "results.json").write_text(json.dumps(results))

    code, _, err = cli("report", str(run), "--output", str(tmp_path / "r"), "--format", "svg")

    assert (code, err) == (0, "")
    strict(tmp_path / "r" / "report.json")


def test_a_demo_run_and_its_export_write_strict_json(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    code, _, err = cli(
        "run", str(DEMO), "--quiet", "--rounds", "2", "--output-dir", str(run), "eval_every=1"
    )
    assert (code, err) == (0, ""), err

    results = strict(run / "results.json")
    assert strict(run / "ledger.json")
    assert results["savings"]["compute_fraction"] > 0

    export = tmp_path / "export"
    code, _, err = cli(
        "export", str(run), "--output", str(export), "--format", "safetensors",
        "--accuracy-examples", "0",
    )  # fmt: skip
    assert (code, err) == (0, ""), err
    manifest = strict(export / "manifest.json")
    assert manifest["check"]["passed"] is True
