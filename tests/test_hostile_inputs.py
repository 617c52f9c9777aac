"""Hostile inputs (issue 15, items 1 and 2): nothing a user types crashes radbo or hangs it.

Two kinds of tests. First, every case the issue names (and the ones found beside them) is
refused by ``radbo run`` with its exact one-line message and exit code 2, never a traceback.
Second, a property-based battery: generated configs, TOML bytes, fleet files, traces, pickles
and safetensors files with lying headers, placed where radbo reads files, are either accepted
-- and then a run of one round completes -- or refused with one of radbo's error classes (exit
code 2, a message, no traceback); any other exception escapes ``radbo.cli.main`` and fails the
test, and nothing from a file is ever executed. The default suite draws a few examples per
property (derandomized); ``pytest -m slow`` runs many more, freshly random.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import pickle
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from pydantic import BaseModel, ValidationError

from radbo.cli import main
from radbo.config import (
    BaselineConfig,
    ConfigError,
    FleetConfig,
    MaskConfig,
    RunConfig,
    RuntimeConfig,
    TraceConfig,
    parse_config,
)
from radbo.data.readers import read_libsvm, read_omniglot
from radbo.devices import Fleet
from radbo.devices.profile import DeviceProfile
from radbo.limits import MAX_ROUNDS, caps_lifted
from radbo.registry import registries
from tests.configs import demo_dict

INF = float("inf")
NAN = float("nan")


# ----------------------------------------------------------------------------- helpers
class Nested:
    """A value nested ``depth`` levels deep (arrays, or inline tables), written to TOML
    without recursion (the writer would hit Python's limit before tomllib does)."""

    def __init__(self, depth: int, table: bool = False) -> None:
        self.depth, self.table = depth, table

    def toml(self) -> str:
        if self.table:
            return "{a = " * self.depth + "1" + "}" * self.depth
        return "[" * self.depth + "]" * self.depth

    def __repr__(self) -> str:
        return f"Nested({self.depth}, table={self.table})"


def _toml_string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t"}
    out = []
    for ch in text:
        if ch in escapes:
            out.append(escapes[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
    return key if bare else _toml_string(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, Nested):
        return value.toml()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + items + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def toml(data: dict[str, Any]) -> str:
    """A TOML document: top-level values first, then one ``[table]`` per dict value (nested
    dicts become inline tables)."""
    lines = [
        f"{_toml_key(k)} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)
    ]
    for key, table in data.items():
        if isinstance(table, dict):
            lines.append(f"[{_toml_key(key)}]")
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def tiny() -> dict[str, Any]:
    """The demo config made small: 1 round, 4 clients, a 16-unit MLP, 2 inner steps, 3 CG
    iterations, no baseline (a round takes about half a second)."""
    data = demo_dict()
    data.update(rounds=1, eval_every=1, output_dir="runs/never-written")
    data["fleet"]["num_clients"] = 4
    data["model"]["hidden"] = [16]
    data["algorithm"].update(inner_steps=2, batch_size=8, outer_batch_size=8)
    data["estimator"]["max_iter"] = 3
    data["baseline"]["enabled"] = False
    return data


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``radbo.cli.main(argv)`` with its stdout and stderr captured. An exception that is not
    one of radbo's error classes escapes from here and fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _count(code: int) -> None:
    """Record the exit code as a hypothesis event (``pytest --hypothesis-show-statistics``
    then shows how many examples ran a round and how many were refused)."""
    if currently_in_test_context():
        event(f"exit code {code}")


def run_one_round(config: Path, folder: Path, *extra: str) -> tuple[int, str, str]:
    """``radbo run CONFIG --quiet --rounds 1`` writing under ``folder``; asserts the outcome is
    one of the two allowed: exit 0 after a completed round, or exit 2 with a message and no
    traceback."""
    argv = ["run", str(config), "--quiet", "--output-dir", str(folder / "out"), "--rounds", "1"]
    code, out, err = run_cli([*argv, *extra])
    _count(code)
    assert "Traceback" not in out + err
    if code == 0:
        assert "final test accuracy" in out
    else:
        assert code == 2, (code, err)
        assert err.strip(), "a refusal says why"
    return code, out, err


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A fresh folder per hypothesis example (``tmp_path`` is one per test)."""
    with tempfile.TemporaryDirectory(prefix="radbo-hostile-") as folder:
        yield Path(folder)


def patched(data: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """``data`` with ``data[path[0]]...[path[-1]] = value`` (sections created as needed)."""
    data = copy.deepcopy(data)
    where = data
    for key in path[:-1]:
        if not isinstance(where.get(key), dict):
            where[key] = {}
        where = where[key]
    where[path[-1]] = value
    return data


def fast(examples: int) -> Callable[[Any], Any]:
    """Hypothesis settings of the default suite: few, derandomized examples, no deadline."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


SLOW = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------- the cases the issue names
def _drop_devices(data: dict[str, Any]) -> None:
    data["fleet"].pop("devices")
    data["fleet"].pop("capacities")


def _nested_fleet_file(data: dict[str, Any], tmp: Path) -> None:
    nested = tmp / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    _drop_devices(data)
    data["fleet"]["file"] = str(nested)


def _shrofbo(coefficient: float) -> Callable[[dict[str, Any], Path], None]:
    def patch(data: dict[str, Any], tmp: Path) -> None:
        data["algorithm"] = {"name": "shrofbo", "coefficient": coefficient}
        data.pop("estimator")
        data["mask"]["policy"] = "none"

    return patch


def _set(*path: str, value: Any) -> Callable[[dict[str, Any], Path], None]:
    def patch(data: dict[str, Any], tmp: Path) -> None:
        where = data
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = value

    return patch


def _output_under_file(data: dict[str, Any], tmp: Path) -> None:
    (tmp / "regular-file").write_text("not a folder")
    data["output_dir"] = str(tmp / "regular-file" / "out")


CAP = "radbo run --force lifts this cap"
NAMED_CASES = [
    (
        "negative seed",
        _set("seed", value=-1),
        "config error: seed = -1: Input should be greater than or equal to 0",
    ),
    (
        "deadline inf",
        _set("fleet", "deadline_s", value=INF),
        "config error: fleet.deadline_s = inf: Input should be a finite number",
    ),
    (
        "damping inf",
        _set("estimator", "damping", value=INF),
        "config error: estimator.damping = inf: Input should be a finite number",
    ),
    (
        "test_fraction too high for the partition",
        _set("data", "test_fraction", value=0.999),
        "config error: fleet.num_clients = 4: the dirichlet partition cannot give 4 clients at least one sample each for their inner and one for their outer data from the 2 training examples of digits (after test_fraction = 0.999): at most 1 clients fit; use num_clients <= 1, or set [partition] allow_overlap = true to let clients share examples",
    ),
    (
        "overcommit inf",
        _set("fleet", "overcommit", value=INF),
        "config error: fleet.overcommit = inf: Input should be a finite number",
    ),
    (
        "inner_lr inf",
        _set("algorithm", "inner_lr", value=INF),
        "config error: algorithm.inner_lr = inf: Input should be a finite number",
    ),
    (
        "outer_lr inf",
        _set("algorithm", "outer_lr", value=INF),
        "config error: algorithm.outer_lr = inf: Input should be a finite number",
    ),
    (
        "inner_lr 1e30",
        _set("algorithm", "inner_lr", value=1e30),
        f"config error: algorithm.inner_lr = 1e+30: Input should be at most 1000 (a larger step diverges on the problems radbo runs; {CAP})",
    ),
    (
        "max_hypergrad_norm inf",
        _set("algorithm", "max_hypergrad_norm", value=INF),
        "config error: algorithm.max_hypergrad_norm = inf: Input should be a finite number",
    ),
    (
        "tiny coefficient",
        _shrofbo(1e-30),
        "config error: algorithm.coefficient = 1e-30: Input should be greater than or equal to 0.000001",
    ),
    (
        "huge coefficient",
        _shrofbo(1e30),
        "config error: algorithm.coefficient = 1e+30: Input should be less than or equal to 1000000",
    ),
    (
        "huge batch_size",
        _set("algorithm", "batch_size", value=10**12),
        "config error: algorithm.batch_size = 1000000000000: Input should be less than or equal to 1000000000",
    ),
    (
        "huge inner_steps",
        _set("algorithm", "inner_steps", value=10**9),
        f"config error: algorithm.inner_steps = 1000000000: Input should be at most 10,000 (more would keep every round busy for hours; {CAP})",
    ),
    (
        "rounds 10**12",
        _set("rounds", value=10**12),
        f"config error: rounds = 1000000000000: Input should be at most 1,000,000 (a run of more rounds would not end; {CAP})",
    ),
    (
        "deeply nested JSON fleet file",
        _nested_fleet_file,
        "config error: fleet.file: device profile error: fleet file {tmp}/nested.json is not valid JSON: nested too deeply",
    ),
    (
        "output folder under a regular file",
        _output_under_file,
        "config error: output_dir = '{tmp}/regular-file/out': the folder cannot be created (Not a directory)",
    ),
    # found beside them
    (
        "overcommit finite but overflowing",
        _set("fleet", "overcommit", value=1e308),
        "config error: fleet.overcommit = 1e+308: Input should be less than or equal to 1000",
    ),
    (
        "seed beyond 64 bits",
        _set("seed", value=2**64),
        "config error: seed = 18446744073709551616: Input should be less than or equal to 9223372036854775807",
    ),
    (
        "nan device weight",
        _set("fleet", "devices", "phone_low", value=NAN),
        "config error: fleet.devices.phone_low = nan: Input should be a finite number",
    ),
    (
        "a device budget's local steps",
        lambda data, tmp: data["fleet"].update(local_steps="budget", deadline_s=1e300),
        "config error: fleet.deadline_s = 1e+300: client 0's device fits {steps} local steps in it, more than 1,000,000 (a round would not end); lower deadline_s, or lift the cap with radbo run --force",
    ),
]


@pytest.mark.parametrize(
    ("patch", "expected"), [c[1:] for c in NAMED_CASES], ids=[c[0] for c in NAMED_CASES]
)
def test_named_case_is_one_line_and_exit_code_2(tmp_path, capsys, patch, expected):
    data = tiny()
    patch(data, tmp_path)
    config = tmp_path / "bad.toml"
    config.write_text(toml(data))

    code = main(
        ["run", str(config), "--quiet"]
        + ([] if "output_dir" in expected else ["--output-dir", str(tmp_path / "out")])
    )

    out, err = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in out + err
    if "{steps}" in expected:  # the exact count depends on the catalog device's FLOP/s
        head, tail = expected.split("{steps}")
        assert err.startswith(head) and err.rstrip("\n").endswith(tail)
        assert err.count("\n") == 1
    else:
        assert err == expected.format(tmp=tmp_path) + "\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_output_folder_under_proc_is_one_line(tmp_path, capsys):
    data = tiny()
    data["output_dir"] = "/proc/radbo-hostile-test/out"
    config = tmp_path / "c.toml"
    config.write_text(toml(data))

    assert main(["run", str(config), "--quiet"]) == 2

    assert capsys.readouterr().err == (
        "config error: output_dir = '/proc/radbo-hostile-test/out': the folder cannot be created "
        "(No such file or directory)\n"
    )


def test_deeply_nested_toml_config_is_one_line(tmp_path, capsys):
    config = tmp_path / "deep.toml"
    config.write_text("rounds = " + "[" * 5000 + "]" * 5000 + "\n")

    assert main(["run", str(config)]) == 2

    assert capsys.readouterr().err == (
        f"config error: {config} is not valid TOML: arrays or tables nested too deeply\n"
    )


def test_a_5000_digit_integer_is_one_line(tmp_path, capsys):
    config = tmp_path / "digits.toml"
    config.write_text("rounds = " + "9" * 5000 + "\n")
    fleet = tmp_path / "fleet.json"
    fleet.write_text('{"format": "radbo-fleet", "version": ' + "9" * 5000 + "}")
    data = tiny()
    _drop_devices(data)
    data["fleet"]["file"] = str(fleet)
    (tmp_path / "fleet.toml").write_text(toml(data))

    assert main(["run", str(config)]) == 2
    assert main(["run", str(tmp_path / "fleet.toml"), "--output-dir", str(tmp_path / "o")]) == 2

    first, second = capsys.readouterr().err.splitlines()
    assert first.startswith(
        f"config error: {config} is not valid TOML: Exceeds the limit (4300 digits)"
    )
    assert second.startswith(
        f"config error: fleet.file: device profile error: fleet file {fleet} is not valid JSON: Exceeds the limit (4300 digits)"
    )


def test_a_model_too_big_for_memory_is_one_line(tmp_path, capsys):
    data = tiny()
    data["model"]["hidden"] = [10**12]  # 2.56e14 bytes of weights
    config = tmp_path / "huge-model.toml"
    config.write_text(toml(data))

    assert main(["run", str(config), "--output-dir", str(tmp_path / "out")]) == 2

    err = capsys.readouterr().err
    assert err.startswith(
        "config error: model.name = 'mlp': the model does not fit in this machine's memory ("
    )
    assert err.endswith("); use smaller widths\n") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # a refused run leaves no folder behind


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_deep_fleet_files_are_a_config_error_in_python_too(tmp_path, suffix):
    fleet = tmp_path / f"deep{suffix}"
    fleet.write_text(("[" * 5000 + "]" * 5000) if suffix == ".json" else "device = " + "[" * 5000)

    with pytest.raises(ConfigError, match="nested too deeply$"):  # ProfileError is one
        Fleet.from_file(fleet)


def test_a_trace_below_one_bit_per_second_is_refused(tmp_path, capsys):
    # found by the battery: 5e-324 kbit/s made every transfer time inf, and the budget a
    # ValueError traceback; a device's bandwidth now lies in [1, 1e15] bit/s
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"0": {"computation": 50.0, "communication": 5e-324}}))
    data = tiny()
    _drop_devices(data)
    data["fleet"]["num_clients"] = 1
    data["fleet"]["trace"] = {"path": str(trace), "flops_per_sample": 1e6, "memory_bytes": 2**30}
    config = tmp_path / "c.toml"
    config.write_text(toml(data))

    assert main(["run", str(config), "--output-dir", str(tmp_path / "out")]) == 2

    assert capsys.readouterr().err.splitlines() == [
        f"config error: fleet.trace: device profile error: trace client 0: {way}_bps = 4.94e-321: "
        f"Input should be greater than or equal to 1 (allowed: a number in [1, 1e15], {way} "
        "bandwidth in bit/s)"
        for way in ("uplink", "downlink")
    ]


def test_a_deadline_that_fits_infinitely_many_steps_is_one_line(tmp_path, capsys):
    data = tiny()
    data["fleet"].update(local_steps="budget", deadline_s=1e308)
    config = tmp_path / "c.toml"
    config.write_text(toml(data))

    assert main(["run", str(config), "--output-dir", str(tmp_path / "out")]) == 2

    err = capsys.readouterr().err
    assert err.startswith("config error: fleet.deadline_s = 1e+308: device '")
    assert err.endswith(
        "' would fit infinitely many steps of 40448 FLOPs; check compute_flops and step_flops\n"
    )


def test_a_config_that_is_not_a_table_is_one_line():
    with pytest.raises(
        ConfigError, match="^config error: a run config is a table of settings, got list$"
    ):
        parse_config([1, 2])  # type: ignore[arg-type]


def test_a_libsvm_file_too_wide_for_memory_is_refused(tmp_path):
    data = tmp_path / "wide.svm"
    data.write_text("1 1:0.5\n-1 2:1.5\n")

    with pytest.raises(
        ValueError,
        match=r"2 examples x 1000000000000 features as dense float64 would take 1.6e\+04 GB, more than this machine's",
    ):
        read_libsvm(data, num_features=10**12)


def test_a_png_bomb_in_an_omniglot_folder_is_refused(tmp_path):
    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    header = struct.pack(">IIBBBBB", 30_000, 30_000, 8, 0, 0, 0, 0)  # 9e8 gray pixels
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    glyph = tmp_path / "alphabet" / "character" / "bomb.png"
    glyph.parent.mkdir(parents=True)
    glyph.write_bytes(bomb)

    with pytest.raises(
        ValueError,
        match=r"bomb.png could not be decoded as a PNG image \(Image size \(900000000 pixels\) exceeds limit",
    ):
        read_omniglot(tmp_path, image_size=28)


# ----------------------------------------------------------------------------- --force
def test_force_lifts_the_caps_and_only_the_caps():
    data = tiny()
    data["rounds"] = MAX_ROUNDS + 1

    with pytest.raises(ConfigError, match="at most 1,000,000"):
        parse_config(data)
    assert parse_config(data, force=True).rounds == MAX_ROUNDS + 1
    with caps_lifted():
        assert parse_config(data).rounds == MAX_ROUNDS + 1
    data["algorithm"]["inner_lr"] = INF
    with pytest.raises(
        ConfigError, match="algorithm.inner_lr = inf: Input should be a finite number"
    ):
        parse_config(data, force=True)


def test_cli_force_runs_a_config_above_a_cap(tmp_path):
    data = tiny()
    data["algorithm"]["inner_lr"] = 2000.0
    config = tmp_path / "big-step.toml"
    config.write_text(toml(data))

    refused, _, err = run_one_round(config, tmp_path)
    forced, out, _ = run_one_round(config, tmp_path, "--force")

    assert refused == 2 and "algorithm.inner_lr = 2000.0: Input should be at most 1000" in err
    assert forced == 0 and "final test accuracy" in out


def test_cli_force_lifts_the_budget_check_at_build(tmp_path):
    data = tiny()
    data["fleet"].update(local_steps="budget", deadline_s=1e300)
    config = tmp_path / "long-deadline.toml"
    config.write_text(toml(data))

    refused, _, err = run_cli(["fleet", str(config), "--json"])
    forced, out, _ = run_cli(["fleet", str(config), "--json", "--force"])

    assert refused == 2 and "more than 1,000,000 (a round would not end)" in err
    assert forced == 0 and min(row["local_steps"] for row in json.loads(out)) > 10**290


# ----------------------------------------------- every float field refuses NaN and infinity
def _sections() -> list[type[BaseModel]]:
    # radbo's own kinds: test modules register toy kinds of their own (test_architecture)
    kinds = [
        cls
        for registry in registries()
        for cls in registry.classes()
        if cls.__module__.startswith("radbo.")
    ]
    plain = [RunConfig, FleetConfig, TraceConfig, MaskConfig, BaselineConfig, RuntimeConfig]
    return list(dict.fromkeys([*plain, *kinds, DeviceProfile]))


#: values for the required fields of the sections (the tag fields take their first tag)
_REQUIRED = {
    "path": "x.json",
    "root": "x",
    "flops_per_sample": 1.0,
    "memory_bytes": 1,
    "name": "box",
    "compute_flops": 1.0,
    "uplink_bps": 1.0,
    "downlink_bps": 1.0,
    "q": 0.5,
}


def _minimal(cls: type[BaseModel]) -> dict[str, Any]:
    data = {}
    for name, info in cls.model_fields.items():
        if info.is_required():
            literal = get_origin(info.annotation) is Literal
            data[name] = get_args(info.annotation)[0] if literal else _REQUIRED[name]
    return data


def _float_fields() -> list[tuple[str, type[BaseModel], str]]:
    return [
        (f"{cls.__name__}.{name}", cls, name)
        for cls in _sections()
        for name, info in cls.model_fields.items()
        if "float" in str(info.annotation)
    ]


@pytest.mark.parametrize(
    ("cls", "field"), [f[1:] for f in _float_fields()], ids=[f[0] for f in _float_fields()]
)
@pytest.mark.parametrize("value", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
def test_every_float_field_refuses_non_finite_values(cls, field, value):
    base = _minimal(cls)
    cls.model_validate(base)  # the minimal section is valid...

    with pytest.raises(ValidationError) as err:
        cls.model_validate({**base, field: value})

    assert err.value.errors()[0]["loc"][0] == field  # ...and the non-finite value is refused


def test_limits_doctest():
    import doctest

    import radbo.limits

    assert doctest.testmod(radbo.limits).failed == 0


# ------------------------------------------------------------ the battery: configs
_BASE = tiny()
#: every (section, key) of the tiny config, and settings it leaves at their defaults
PATHS = sorted(
    {(k,) for k, v in _BASE.items() if not isinstance(v, dict)}
    | {(k, kk) for k, v in _BASE.items() if isinstance(v, dict) for kk in v}
    | {
        ("checkpoint_every",),
        ("fleet", "overcommit"),
        ("fleet", "dropout"),
        ("fleet", "phase_deadline_s"),
        ("fleet", "clients_per_round"),
        ("fleet", "local_steps_range"),
        ("fleet", "capacity_levels"),
        ("algorithm", "max_hypergrad_norm"),
        ("algorithm", "divergence_factor"),
        ("estimator", "damping"),
        ("estimator", "tol"),
        ("mask", "coverage_k"),
        ("partition", "allow_overlap"),
        ("data", "imbalance"),
        ("runtime", "threads"),
        ("runtime", "dtype"),
    }
)
HOSTILE = [NAN, INF, -INF, -1, 0, 1, 2, -1.0, 0.0, -0.0, 1e-300, 5e-324, 0.5, 1e30, 1e308]
HOSTILE += [10**12, 2**63 - 1, 2**64, -(2**63), True, False, "", "x", "nan", "1e400", "ü"]
HOSTILE += [[], [1], [0.5, "a"], [[]], {}, {"a": 1}, {"zzz": {"b": [1]}}]

hostile_values = st.one_of(
    st.sampled_from(HOSTILE),
    st.builds(Nested, st.integers(1, 3000), st.booleans()),
    # no moderately large integers: 5,000 inner steps is a legal, slow config, not a hostile one
    st.integers(min_value=-(10**30), max_value=3),
    st.integers(min_value=10**7, max_value=10**30),
    st.floats(),
    st.floats(min_value=5e-324, max_value=1000.0),  # mostly legal: these runs get a round
    st.text(max_size=12),
)
mutations = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(PATHS), hostile_values),
        # an unknown key, at the top or in a section
        st.tuples(
            st.sampled_from(
                [("zzz_unknown",)]
                + [(s, "zzz_unknown") for s in _BASE if isinstance(_BASE[s], dict)]
            ),
            st.just(1),
        ),
    ),
    min_size=1,
    max_size=2,
)


def check_mutated_config(changes: list[tuple[tuple[str, ...], Any]]) -> None:
    data = tiny()
    for path, value in changes:
        data = patched(data, path, value)
    with scratch() as folder:
        config = folder / "c.toml"
        config.write_text(toml(data))
        run_one_round(config, folder)


@fast(12)
@given(mutations)
def test_mutated_configs_run_one_round_or_are_refused(changes):
    check_mutated_config(changes)


@pytest.mark.slow
@SLOW
@given(mutations)
def test_mutated_configs_run_one_round_or_are_refused_many(changes):
    check_mutated_config(changes)


# ---------------------------------------------------------- the battery: TOML bytes
_TEXT = toml(tiny()).encode()
damaged_toml = st.one_of(
    st.integers(0, len(_TEXT)).map(lambda k: _TEXT[:k]),  # truncated
    st.tuples(st.integers(0, len(_TEXT) - 1), st.binary(min_size=1, max_size=4)).map(
        lambda kb: _TEXT[: kb[0]] + kb[1] + _TEXT[kb[0] + len(kb[1]) :]  # overwritten bytes
    ),
    st.tuples(
        st.integers(0, len(_TEXT)),
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf"]),
    ).map(
        lambda kb: _TEXT[: kb[0]] + kb[1] + _TEXT[kb[0] :]  # non-UTF-8 (or NUL, BOM) inserted
    ),
    st.binary(max_size=200),
)


def check_toml_bytes(content: bytes) -> None:
    with scratch() as folder:
        config = folder / "c.toml"
        config.write_bytes(content)
        run_one_round(config, folder)


@fast(10)
@given(damaged_toml)
def test_damaged_toml_bytes_run_one_round_or_are_refused(content):
    check_toml_bytes(content)


@pytest.mark.slow
@SLOW
@given(damaged_toml)
def test_damaged_toml_bytes_run_one_round_or_are_refused_many(content):
    check_toml_bytes(content)


# --------------------------------------------------- the battery: fleet files and traces
PROFILE = {
    "name": "box",
    "compute_flops": 1e10,
    "memory_bytes": 2**30,
    "uplink_bps": 1e7,
    "downlink_bps": 1e7,
    "availability": 1.0,
    "tier": "box",
}
json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def fleet_documents(draw: st.DrawFn) -> tuple[dict[str, Any] | list | bytes, int]:
    """A fleet file's content (a JSON-able document, or raw bytes) and the client count the
    config asks for."""
    n = draw(st.integers(1, 3))
    doc: dict[str, Any] = {
        "format": "radbo-fleet",
        "version": 1,
        "device": [dict(PROFILE) for _ in range(n)],
    }
    kind = draw(st.sampled_from(["profile field", "top level", "extra key", "any JSON", "bytes"]))
    if kind == "profile field":
        device = doc["device"][draw(st.integers(0, n - 1))]
        device[draw(st.sampled_from(sorted(PROFILE)))] = draw(hostile_values | json_values)
    elif kind == "top level":
        doc[draw(st.sampled_from(["format", "version", "device"]))] = draw(
            hostile_values | json_values
        )
    elif kind == "extra key":
        doc["device"][0][draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    elif kind == "any JSON":
        return draw(json_values), n
    else:
        return draw(
            st.sampled_from(
                [b"\xff\xfe{}", b'{"format": 1, "format": 2}', b"[" * 50_000, b"", b"\x80"]
            )
            | st.binary(max_size=64)
        ), n
    return doc, n


def _write_document(path: Path, doc: Any) -> None:
    """``doc`` as the file's content: bytes as they are, else JSON or TOML by the suffix (a
    value that is not a table goes into one, ``v = ...``)."""
    if isinstance(doc, bytes):
        path.write_bytes(doc)
    elif path.suffix == ".json":
        path.write_text(json.dumps(doc, default=repr))
    else:
        try:
            path.write_text(toml(doc if isinstance(doc, dict) else {"v": doc}))
        except TypeError:  # None has no TOML form
            path.write_text(toml({"v": repr(doc)}))


def check_fleet_file(doc: Any, n: int, suffix: str) -> None:
    data = tiny()
    _drop_devices(data)
    with scratch() as folder:
        fleet = folder / f"fleet{suffix}"
        _write_document(fleet, doc)
        data["fleet"].update(file=str(fleet), num_clients=n)
        config = folder / "c.toml"
        config.write_text(toml(data))
        run_one_round(config, folder)


@fast(12)
@given(fleet_documents(), st.sampled_from([".json", ".toml"]))
def test_fleet_files_run_one_round_or_are_refused(doc_and_n, suffix):
    check_fleet_file(*doc_and_n, suffix)


@pytest.mark.slow
@SLOW
@given(fleet_documents(), st.sampled_from([".json", ".toml"]))
def test_fleet_files_run_one_round_or_are_refused_many(doc_and_n, suffix):
    check_fleet_file(*doc_and_n, suffix)


@st.composite
def traces(draw: st.DrawFn) -> tuple[Any, int]:
    n = draw(st.integers(1, 3))
    doc: dict[str, Any] = {str(i): {"computation": 50.0, "communication": 1000.0} for i in range(n)}
    kind = draw(st.sampled_from(["field", "client id", "entry", "any JSON", "bytes"]))
    if kind == "field":
        entry = doc[str(draw(st.integers(0, n - 1)))]
        entry[draw(st.sampled_from(["computation", "communication", "zzz"]))] = draw(
            hostile_values | json_values
        )
    elif kind == "client id":
        doc[draw(st.text(max_size=8) | st.sampled_from(["-1", "1e3", " 0", "9" * 5000]))] = {
            "computation": 1.0,
            "communication": 1.0,
        }
    elif kind == "entry":
        doc["0"] = draw(hostile_values | json_values)
    elif kind == "any JSON":
        return draw(json_values), n
    else:
        return draw(st.binary(max_size=64)), n
    return doc, n


def check_trace(doc: Any, n: int, suffix: str) -> None:
    data = tiny()
    _drop_devices(data)
    with scratch() as folder:
        trace = folder / f"trace{suffix}"
        _write_document(trace, doc)
        data["fleet"]["num_clients"] = n
        data["fleet"]["trace"] = {
            "path": str(trace),
            "flops_per_sample": 1e6,
            "memory_bytes": 2**30,
        }
        config = folder / "c.toml"
        config.write_text(toml(data))
        run_one_round(config, folder)


@fast(12)
@given(traces(), st.sampled_from([".json", ".toml"]))
def test_traces_run_one_round_or_are_refused(doc_and_n, suffix):
    check_trace(*doc_and_n, suffix)


@pytest.mark.slow
@SLOW
@given(traces(), st.sampled_from([".json", ".toml"]))
def test_traces_run_one_round_or_are_refused_many(doc_and_n, suffix):
    check_trace(*doc_and_n, suffix)


# ------------------------------------------------- pickles: nothing from a file is executed
class _Sentinel:
    """Unpickling it would create the file ``path`` (``open(path, "w")``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def _pickle_placements(folder: Path, payload: bytes) -> list[list[str]]:
    """Put ``payload`` everywhere radbo reads a file; the command lines that read each."""
    commands = []
    (folder / "pickle.toml").write_bytes(payload)
    commands.append(["run", str(folder / "pickle.toml")])
    for name, section in (("fleet.json", "file"), ("trace.json", "trace")):
        (folder / name).write_bytes(payload)
        data = tiny()
        _drop_devices(data)
        if section == "file":
            data["fleet"]["file"] = str(folder / name)
        else:
            data["fleet"]["trace"] = {
                "path": str(folder / name),
                "flops_per_sample": 1e6,
                "memory_bytes": 2**30,
            }
        (folder / f"{name}.toml").write_text(toml(data))
        commands.append(["run", str(folder / f"{name}.toml")])
    mnist = folder / "mnist"
    mnist.mkdir()
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        (mnist / stem).write_bytes(payload)
    data = tiny()
    data["data"] = {"name": "mnist", "root": str(mnist)}
    (folder / "mnist.toml").write_text(toml(data))
    commands.append(["run", str(folder / "mnist.toml")])
    return commands


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickles_where_radbo_reads_files_are_refused_and_never_run(tmp_path, protocol):
    sentinel = tmp_path / "unpickled"
    payload = pickle.dumps(_Sentinel(str(sentinel)), protocol=protocol)
    assert pickle.loads(payload) is not None and sentinel.exists()  # the payload works...
    sentinel.unlink()

    for command in _pickle_placements(tmp_path, payload):
        code, out, err = run_cli([*command, "--quiet", "--output-dir", str(tmp_path / "out")])
        assert code == 2 and err.strip() and "Traceback" not in out + err, command

    assert not sentinel.exists()  # ...and radbo never ran it


# ------------------------------------------- checkpoints: pickles and lying safetensors
@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> Path:
    """A folder holding the config and the checkpoint after round 1 of the tiny run."""
    folder = tmp_path_factory.mktemp("checkpointed")
    data = tiny()
    data["checkpoint_every"] = 1
    (folder / "c.toml").write_text(toml(data))
    code, _, err = run_cli(
        ["run", str(folder / "c.toml"), "--quiet", "--output-dir", str(folder / "out")]
    )
    assert code == 0, err
    return folder


def _checkpoint(folder: Path) -> Path:
    return folder / "out" / "checkpoints" / "run"


def _rehash(directory: Path, tensors: bytes) -> None:
    """Make the index vouch for ``tensors`` as the checkpoint's tensor file, recomputing the
    SHA-256s as ``radbo.checkpoint`` documents them, so the loader reads the file's header
    instead of stopping at a hash mismatch (hashes are not signatures)."""
    import hashlib

    index_path = directory / "checkpoint.json"
    index = json.loads(index_path.read_text())
    if "files" not in index or "index_sha256" not in index:  # another layout: leave it
        (directory / next(directory.glob("*.safetensors")).name).write_bytes(tensors)
        return
    name = index["files"]["tensors"]["file"]
    (directory / name).write_bytes(tensors)
    index["files"]["tensors"]["sha256"] = hashlib.sha256(tensors).hexdigest()
    body = {k: v for k, v in index.items() if k != "index_sha256"}
    index["index_sha256"] = hashlib.sha256(json.dumps(body, allow_nan=True).encode()).hexdigest()
    index_path.write_text(json.dumps(index, allow_nan=True))


def _resume(folder: Path) -> tuple[int, str, str]:
    code, out, err = run_cli(
        [
            "run",
            str(folder / "c.toml"),
            "--quiet",
            "--output-dir",
            str(folder / "out"),
            "--resume",
            "--rounds",
            "2",
        ]
    )
    _count(code)
    assert "Traceback" not in out + err
    assert code == 0 or (code == 2 and err.strip()), (code, err)
    return code, out, err


@contextlib.contextmanager
def _copy_of(checkpointed: Path) -> Iterator[Path]:
    with scratch() as folder:
        shutil.copytree(checkpointed, folder, dirs_exist_ok=True)
        yield folder


def test_a_pickled_checkpoint_is_refused_and_never_run(checkpointed):
    with _copy_of(checkpointed) as folder:
        sentinel = folder / "unpickled"
        payload = pickle.dumps(_Sentinel(str(sentinel)))
        directory = _checkpoint(folder)
        for target in sorted(directory.iterdir()):
            target.write_bytes(payload)

        code, _, err = _resume(folder)

        assert code == 2 and "checkpoint" in err
        assert not sentinel.exists()


def test_the_intact_checkpoint_resumes(checkpointed):
    with _copy_of(checkpointed) as folder:
        code, out, _ = _resume(folder)
    assert code == 0 and "final test accuracy" in out


def _real_tensors(checkpointed: Path) -> tuple[dict[str, Any], bytes]:
    raw = next(_checkpoint(checkpointed).glob("*.safetensors")).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


@st.composite
def lying_safetensors(draw: st.DrawFn, header: dict[str, Any], data: bytes) -> bytes:
    """The checkpoint's own safetensors file with a header that lies: a wrong dtype, shape or
    offsets for one tensor, a header length off, garbage JSON, or extra entries."""
    header = copy.deepcopy(header)
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names))
    lie = draw(st.sampled_from(["dtype", "shape", "offsets", "length", "json", "extra", "data"]))
    text = None
    length_delta = 0
    if lie == "dtype":
        header[name]["dtype"] = draw(
            st.sampled_from(["F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "X", ""])
        )
    elif lie == "shape":
        header[name]["shape"] = draw(st.lists(st.integers(-3, 2**40), max_size=4))
    elif lie == "offsets":
        header[name]["data_offsets"] = draw(
            st.lists(st.integers(-5, len(data) + 2**40), min_size=0, max_size=3)
        )
    elif lie == "length":
        length_delta = draw(st.integers(-64, 2**63)) or 1
    elif lie == "json":
        text = draw(
            st.sampled_from(["", "{", "[]", "null", '{"a": 1}', "{" * 10_000])
            | st.text(max_size=20)
        )
    elif lie == "extra":
        header[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    payload = data
    if lie == "data":
        payload = data[: draw(st.integers(0, max(0, len(data) - 1)))]
    body = (json.dumps(header) if text is None else text).encode()
    length = max(0, min(2**64 - 1, len(body) + length_delta))
    return struct.pack("<Q", length) + body + payload


def test_lying_safetensors_in_a_checkpoint_resume_or_are_refused(checkpointed):
    header, data = _real_tensors(checkpointed)

    @fast(10)
    @given(lying_safetensors(header, data))
    def check(content: bytes) -> None:
        with _copy_of(checkpointed) as folder:
            _rehash(_checkpoint(folder), content)
            _resume(folder)

    check()


@pytest.mark.slow
def test_lying_safetensors_in_a_checkpoint_resume_or_are_refused_many(checkpointed):
    header, data = _real_tensors(checkpointed)

    @SLOW
    @given(lying_safetensors(header, data))
    def check(content: bytes) -> None:
        with _copy_of(checkpointed) as folder:
            _rehash(_checkpoint(folder), content)
            _resume(folder)

    check()


def test_an_outer_fraction_that_rounds_away_is_one_line(tmp_path):
    """Found by the slow battery: ``outer_fraction = 1e-17`` passed ``gt=0`` and then
    ``1 - outer_fraction == 1.0`` raised inside the partition split with a traceback."""
    path = tmp_path / "c.toml"
    path.write_text("[data]\nouter_fraction = 1e-17\n")
    code, out, err = run_cli(["run", str(path)])
    assert code == 2 and out == ""
    assert err.strip() == (
        "config error: data.outer_fraction = 1e-17: 1e-17 is too small: "
        "1 - outer_fraction rounds to 1; use >= 1e-9"
    )
