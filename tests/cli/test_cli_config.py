"""Config validation and the `radbo run` command line."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from radbo.cli import main
from radbo.config import ConfigError, RunConfig, load_config, parse_config

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.toml"


def test_demo_config_is_valid_and_matches_the_issue():
    cfg = load_config(DEMO)

    assert cfg.fleet.num_clients == 10
    assert sorted(set(cfg.fleet.capacities.values())) == [0.25, 0.5, 1.0]
    assert cfg.partition.kind == "dirichlet" and cfg.partition.alpha == 0.5
    assert cfg.data.name == "digits"


def test_defaults_are_valid():
    assert RunConfig().algorithm.name == "rabo"


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        (
            {"algorithm": {"inner_lr": -1.0}},
            "config error: algorithm.inner_lr = -1.0: Input should be greater than 0",
        ),
        (
            {"algorithm": {"inner_lrr": 0.1}},
            "config error: algorithm.inner_lrr = 0.1: unknown field",
        ),
        (
            {"mask": {"policy": "magic"}},
            "config error: mask.policy = 'magic': Input should be 'importance', 'leading', "
            "'rolling', 'random', 'coverage', 'fiarse', 'oap' or 'none'",
        ),
        (
            {"fleet": {"capacities": [1.5]}},
            "config error: fleet.capacities.0 = 1.5: Input should be less than or equal to 1",
        ),
        (
            {"fleet": {"capacities": {"laptop": 0.0}}},
            "config error: fleet.capacities.laptop = 0.0: Input should be greater than 0",
        ),
        (
            {"fleet": {"capacities": "half"}},
            "config error: fleet.capacities = 'half': Input should be a valid list or a valid dictionary",
        ),
        (
            {"fleet": {"devices": {"laptop_cpu": 1.0}, "file": "f.toml"}},
            "config error: fleet = {...}: give at most one device source, got devices and file",
        ),
        (
            {"partition": {"kind": "zipf"}},
            "config error: partition = {...}: Input tag 'zipf' found using 'kind' does not match any of the expected tags",
        ),
        ({"rounds": 0}, "config error: rounds = 0: Input should be greater than or equal to 1"),
        (
            {"fleet": {"num_clients": 3, "clients_per_round": 5}},
            "clients_per_round = 5 exceeds num_clients = 3",
        ),
    ],
)
def test_bad_values_give_one_line_naming_field_value_and_allowed(patch, expected):
    data = tomllib.loads(DEMO.read_text())
    for key, value in patch.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value

    with pytest.raises(ConfigError) as err:
        parse_config(data)

    message = str(err.value)
    assert expected in message
    assert len(message.splitlines()) == 1


def test_cli_bad_key_exits_2_with_one_clear_line(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(DEMO.read_text().replace("inner_steps = 10", "inner_stepz = 10"))

    code = main(["run", str(path), "--quiet"])

    err = capsys.readouterr().err.strip()
    assert code == 2
    assert (
        err
        == "config error: algorithm.inner_stepz = 10: unknown field (did you mean 'inner_steps'?)"
    )


def test_cli_missing_file_and_bad_toml_exit_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    assert main(["run", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_cli_run_writes_results_and_plot(tmp_path, capsys):
    """``radbo run`` in-process (a fresh interpreter costs 8 s more, mostly imports and first
    builds; test_python_dash_m_radbo_is_the_cli checks the entry point)."""
    out = tmp_path / "run"
    config = tmp_path / "demo.toml"  # the demo without its full-model baseline run
    text = DEMO.read_text()
    assert "[baseline]\n" in text and "enabled = true\n" in text
    config.write_text(text.replace("enabled = true\n", "enabled = false\n"))

    code = main(["run", str(config), "--rounds", "2", "--output-dir", str(out)])

    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "final test accuracy" in captured.out
    assert "radbo" in captured.err  # the progress bar
    results = json.loads((out / "results.json").read_text())
    assert len(results["rounds"]) == 2
    row = results["rounds"][-1]
    for key in (
        "test_accuracy",
        "inner_loss",
        "outer_loss",
        "coverage_x_min",
        "coverage_y_min",
        "untrained_fraction_x",
    ):
        assert key in row
    assert results["config"]["rounds"] == 2 and not results["config"]["baseline"]["enabled"]
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_dash_m_radbo_is_the_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "radbo", "run", "--help"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # as tests/conftest.py: one thread
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: radbo run") and "--output-dir" in proc.stdout


def test_section_without_its_tag_takes_the_default_kind():
    cfg = parse_config({"algorithm": {"inner_lr": 0.3}, "estimator": {"max_iter": 3}})

    assert cfg.algorithm.name == "rabo" and cfg.algorithm.inner_lr == 0.3
    assert cfg.estimator.name == "cg" and cfg.estimator.max_iter == 3


def test_unknown_device_id_is_a_config_error(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(DEMO.read_text().replace("raspberry_pi_4 = 0.3", "raspberry_pi_44 = 0.3"))

    assert main(["fleet", str(path)]) == 2

    err = capsys.readouterr().err
    assert err.startswith("config error: fleet.devices:")
    assert "raspberry_pi_44" in err


@pytest.mark.parametrize(
    "section",
    [
        {"name": "cg", "max_iter": 7, "tol": 1e-6, "damping": 0.5},
        {"name": "neumann", "terms": 7, "eta": 0.25},
        {
            "name": "finite_difference",
            "num_coordinates": 3,
            "mu": 1e-2,
            "hvp_mu": 1e-2,
            "cg_iters": 7,
            "tol": 1e-6,
            "damping": 0.5,
            "as_printed": True,
            "rescale": True,
        },
        {"name": "finite_difference", "fraction": 0.25},
        {"name": "first_order", "lam": 5.0, "inner_steps": 7, "lr": 0.25},
    ],
)
def test_every_estimator_key_reaches_the_estimator(section):
    data = tomllib.loads(DEMO.read_text())
    data["estimator"] = section
    estimator = parse_config(data).estimator
    for key, value in section.items():
        if key != "name":
            assert getattr(estimator, key) == value, key


@pytest.mark.parametrize("path", sorted((DEMO.parent).glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_validates_and_builds(path):
    from radbo.experiment import build

    exp = build(load_config(path))
    assert exp.simulation.clients and exp.config.rounds >= 1


def test_radbo_warnings_print_as_one_line_and_others_as_python_prints_them(capsys, monkeypatch):
    import radbo.cli
    from radbo.checkpoint import CheckpointWarning

    others: list[tuple] = []
    monkeypatch.setattr(radbo.cli, "_SHOW_WARNING", lambda *args: others.append(args))
    warn = radbo.cli._one_line_warning
    warn(CheckpointWarning("resuming from round 2"), CheckpointWarning, "x.py", 1)
    warn(UserWarning("elsewhere"), UserWarning, "/site/other.py", 7)
    assert capsys.readouterr().err == "warning: resuming from round 2\n"
    assert [(str(a[0]), a[2], a[3]) for a in others] == [("elsewhere", "/site/other.py", 7)]


@pytest.mark.parametrize("command", ["run", "fleet", "export"])
def test_unreadable_config_is_reported_before_torch_is_imported(tmp_path, command):
    """A config file that is missing or not TOML is refused by the torch-free part of the
    command line (radbo.tomlfile), before radbo imports torch for the config classes: the
    error reaches the user in a fresh interpreter without importing torch (issue 15, item 1)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    code = (
        "import sys; from radbo.cli import main; "
        f"codes = [main([{command!r}, sys.argv[1]]), main([{command!r}, sys.argv[2]])]; "
        "print(codes, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "nope.toml"), str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[2, 2] False"
    assert proc.stderr.splitlines() == [
        f"config error: {tmp_path / 'nope.toml'} does not exist or is not a file",
        f"config error: {bad} is not valid TOML: Invalid value (at line 1, column 10)",
    ]
