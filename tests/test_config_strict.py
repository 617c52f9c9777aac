"""Config files and values taken as typed (issue 28, items 2 and 6): a boolean or a string is
never a number, nor a number a boolean; a config file over the size cap is refused from its
size, before it is read; a config with many problems prints at most
:data:`radbo.limits.MAX_ERROR_LINES` of them, then how many more. Each case goes through
``radbo.cli.main``: exit code 2, the exact lines on stderr, no traceback, no hang."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from radbo.cli import main
from radbo.config import apply_overrides, load_config, parse_config
from radbo.limits import MAX_CONFIG_BYTES, MAX_ERROR_LINES
from radbo.tomlfile import read_toml
from tests.configs import DEMO, ROOT
from tests.helpers import time_limit


def refused(config: Path, *extra: str, seconds: float = 60) -> list[str]:
    """The lines ``radbo run CONFIG`` prints on stderr, which must exit with code 2 (and
    print nothing else, no traceback) within ``seconds``."""
    out, err = io.StringIO(), io.StringIO()
    with time_limit(seconds), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["run", str(config), "--quiet", *extra])
    assert code == 2, err.getvalue()
    assert out.getvalue() == ""
    assert "Traceback" not in err.getvalue()
    assert err.getvalue().endswith("\n")
    return err.getvalue().splitlines()


# ------------------------------------------------------------- bools and strings: not numbers
NOT_A_NUMBER = "Input should be a valid number (a boolean is not a number)"
NOT_AN_INTEGER = "Input should be a valid integer (a boolean is not a number)"
QUOTED = "(a string is not a number: write it without quotes)"

CASES = [
    ("rounds = true", f"config error: rounds = True: {NOT_AN_INTEGER}"),
    ("[algorithm]\ninner_lr = true", f"config error: algorithm.inner_lr = True: {NOT_A_NUMBER}"),
    ('seed = "0"', f"config error: seed = '0': Input should be a valid integer {QUOTED}"),
    ('rounds = "5"', f"config error: rounds = '5': Input should be a valid integer {QUOTED}"),
    (
        '[algorithm]\ninner_lr = "0.2"',
        f"config error: algorithm.inner_lr = '0.2': Input should be a valid number {QUOTED}",
    ),
    (
        "rounds = 2.0",
        "config error: rounds = 2.0: Input should be a valid integer (an integer is written "
        "without a decimal point)",
    ),
    (
        "[mask]\nmask_x = 1",
        "config error: mask.mask_x = 1: Input should be a valid boolean (a number is not a "
        "boolean: write true or false)",
    ),
    (
        '[mask]\nmask_y = "yes"',
        "config error: mask.mask_y = 'yes': Input should be a valid boolean (a string is not a "
        "boolean: write true or false, unquoted)",
    ),
    (
        "[fleet]\nclients_per_round = false",
        f"config error: fleet.clients_per_round = False: {NOT_AN_INTEGER}",
    ),
    (
        "[fleet]\ncapacities = [1.0, true]",
        f"config error: fleet.capacities.1 = True: {NOT_A_NUMBER}",
    ),
    (
        "[fleet]\nnum_clients = 4\ndevices = { laptop_cpu = 1.0 }\ncapacities = { laptop = true }",
        f"config error: fleet.capacities.laptop = True: {NOT_A_NUMBER}",
    ),
    (
        '[fleet]\nlocal_steps = "uniform"\nlocal_steps_range = [1, 2.5]',
        "config error: fleet.local_steps_range.1 = 2.5: Input should be a valid integer (an "
        "integer is written without a decimal point)",
    ),
    (
        '[estimator]\nname = "cg"\nmax_iter = true',
        f"config error: estimator.max_iter = True: {NOT_AN_INTEGER}",
    ),
    (
        '[task]\nname = "feature_l2"\nmax_log_l2 = true\n[model]\nname = "logistic"\n'
        '[mask]\npolicy = "none"',
        'config error: task.max_log_l2 = True: expected "auto", "off" or a finite number (a '
        "boolean is not a number)",
    ),
]


@pytest.mark.parametrize(("text", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_value_of_the_wrong_kind_is_one_line(tmp_path: Path, text: str, expected: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(text + "\n")

    assert refused(config, "--output-dir", str(tmp_path / "out")) == [expected]
    assert not (tmp_path / "out").exists()


def test_a_command_line_override_is_typed_as_the_file_is(tmp_path: Path) -> None:
    assert refused(DEMO, "algorithm.inner_lr=true", "--output-dir", str(tmp_path)) == [
        f"config error: algorithm.inner_lr = True: {NOT_A_NUMBER}"
    ]
    assert refused(DEMO, "seed=x", "--output-dir", str(tmp_path)) == [
        f"config error: seed = 'x': Input should be a valid integer {QUOTED}"
    ]

    config = load_config(DEMO, overrides=["algorithm.inner_lr=0.2", "seed=3", "rounds=7"])

    assert config.algorithm.inner_lr == 0.2 and type(config.algorithm.inner_lr) is float
    assert (config.seed, config.rounds) == (3, 7)


def test_an_integer_is_taken_for_a_float_and_typed_values_as_before() -> None:
    data = apply_overrides(
        read_toml(DEMO),
        ["algorithm.inner_lr=1", "fleet.local_steps=uniform", "fleet.local_steps_range=[2, 5]"],
    )

    config = parse_config(data)

    assert config.algorithm.inner_lr == 1.0 and type(config.algorithm.inner_lr) is float
    assert config.fleet.local_steps_range == (2, 5)
    assert config.mask.mask_x is True


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "examples").glob("**/*.toml")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_example_config_still_parses(path: Path) -> None:
    parse_config(read_toml(path))


# ------------------------------------------------------------------ config file size and errors
def too_large(path: Path) -> str:
    return (
        f"config error: {path} is larger than {MAX_CONFIG_BYTES:,} bytes, the most a config "
        "file may have"
    )


def test_a_config_file_over_the_cap_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "big.toml"
    config.write_text("rounds = 2\n" + "#" * (MAX_CONFIG_BYTES - len("rounds = 2\n")))
    assert read_toml(config) == {"rounds": 2}  # exactly at the cap: read

    with config.open("a") as file:
        file.write("#")  # one byte over

    assert refused(config) == [too_large(config)]


def test_a_huge_config_file_is_refused_from_its_size_without_reading_it(tmp_path: Path) -> None:
    # 53 MB (the 3 million unknown keys) as a sparse file: never read, so instant
    config = tmp_path / "huge.toml"
    with config.open("wb") as file:
        file.truncate(53_000_000)

    assert refused(config, seconds=10) == [too_large(config)]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_as_config_does_not_block(tmp_path: Path) -> None:
    config = tmp_path / "fifo.toml"
    os.mkfifo(config)

    assert refused(config, seconds=10) == [
        f"config error: {config} does not exist or is not a file"
    ]


def test_100k_unknown_keys_print_a_bounded_error(tmp_path: Path) -> None:
    # 100,000 unknown keys printed 100,000 lines; the file is under the size cap
    config = tmp_path / "keys.toml"
    config.write_text("".join(f"k{i:x}=0\n" for i in range(100_000)))
    assert config.stat().st_size <= MAX_CONFIG_BYTES

    lines = refused(config, seconds=120)

    assert len(lines) == MAX_ERROR_LINES + 1
    assert lines[0] == (
        "config error: k0 = 0: unknown field (check the spelling; see the README for the "
        "allowed keys)"
    )
    assert all(line.startswith("config error: k") for line in lines[:-1])
    assert lines[-1] == f"config error: and {100_000 - MAX_ERROR_LINES:,} more problems"


@pytest.mark.parametrize(
    ("count", "more"), [(30, "10 more problems"), (MAX_ERROR_LINES + 1, "1 more problem")]
)
def test_many_wrong_values_print_a_bounded_error(tmp_path: Path, count: int, more: str) -> None:
    config = tmp_path / "values.toml"
    config.write_text("[fleet]\ncapacities = [" + ", ".join(["true"] * count) + "]\n")

    lines = refused(config)

    assert lines[:2] == [
        f"config error: fleet.capacities.0 = True: {NOT_A_NUMBER}",
        f"config error: fleet.capacities.1 = True: {NOT_A_NUMBER}",
    ]
    assert lines[MAX_ERROR_LINES:] == [f"config error: and {more}"]


def test_a_config_with_few_problems_prints_them_all(tmp_path: Path) -> None:
    config = tmp_path / "few.toml"
    config.write_text("rounds = true\nseed = -1\n[algorithm]\ninner_lr = true\n")

    assert refused(config) == [
        "config error: seed = -1: Input should be greater than or equal to 0",
        f"config error: rounds = True: {NOT_AN_INTEGER}",
        f"config error: algorithm.inner_lr = True: {NOT_A_NUMBER}",
    ]
