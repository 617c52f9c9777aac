"""Command-line config overrides (``radbo run CONFIG key.sub=value ...``) and the
did-you-mean suggestion for a misspelt key (issue 27, item 6)."""

import json
import tomllib
from pathlib import Path

import pytest

from radbo.cli import main
from radbo.config import ConfigError, apply_overrides, load_config, parse_config, parse_override

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.toml"
TINY = (
    'rounds = 1\neval_every = 1\n[fleet]\nnum_clients = 3\n[model]\nname = "mlp"\nhidden = [16]\n'
)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("algorithm.inner_lr=0.2", ("algorithm", "inner_lr"), 0.2),
        ("fleet.num_clients=50", ("fleet", "num_clients"), 50),
        ("model.hidden=[64]", ("model", "hidden"), [64]),
        ('task.name="few_shot"', ("task", "name"), "few_shot"),
        # the shell strips the quotes of task.name="few_shot": one bare word is a string
        ("task.name=few_shot", ("task", "name"), "few_shot"),
        ("output_dir=runs/x-1", ("output_dir",), "runs/x-1"),
        ("mask.mask_x=false", ("mask", "mask_x"), False),
        ("fleet.capacities={laptop = 1.0}", ("fleet", "capacities"), {"laptop": 1.0}),
        ("fleet.capacities.phone-low=0.5", ("fleet", "capacities", "phone-low"), 0.5),
        (" seed = 3 ", ("seed",), 3),
    ],
)
def test_an_override_is_a_dotted_key_and_a_toml_value(text, path, value):
    assert parse_override(text) == (path, value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "inner_lr",
            "config error: override 'inner_lr' is not KEY=VALUE: write KEY=VALUE with a dotted "
            "key and a TOML value, e.g. algorithm.inner_lr=0.2",
        ),
        (
            "algorithm..inner_lr=0.2",
            "config error: override 'algorithm..inner_lr=0.2' is not KEY=VALUE: write KEY=VALUE "
            "with a dotted key and a TOML value, e.g. algorithm.inner_lr=0.2",
        ),
        (
            "model.hidden=[64",
            "config error: override model.hidden = '[64' is not a TOML value (a string with "
            "spaces or symbols needs quotes: model.hidden='\"a b\"'; a list: [1, 2])",
        ),
        (
            "seed=1\nrounds=3",
            "config error: override seed = '1\\nrounds=3': a value is one line",
        ),
    ],
)
def test_a_malformed_override_is_one_line_naming_it(text, message):
    with pytest.raises(ConfigError) as err:
        parse_override(text)
    assert str(err.value) == message


def test_overrides_set_nested_keys_in_order_and_leave_the_input_alone():
    data = {"fleet": {"num_clients": 10}, "model": {"name": "mlp"}}

    merged = apply_overrides(
        data, ["fleet.num_clients=50", "algorithm.inner_lr=0.2", "fleet.num_clients=7"]
    )

    assert merged == {
        "fleet": {"num_clients": 7},
        "model": {"name": "mlp"},
        "algorithm": {"inner_lr": 0.2},
    }
    assert data == {"fleet": {"num_clients": 10}, "model": {"name": "mlp"}}


def test_an_override_below_a_value_that_is_not_a_table_is_refused():
    with pytest.raises(ConfigError) as err:
        apply_overrides({"model": {"hidden": [128]}}, ["model.hidden.width=3"])
    assert str(err.value) == (
        "config error: override model.hidden.width=3: model.hidden = [128] is not a table, so "
        "it has no key 'width'"
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [("algorithm.inner_lr", "-1.0"), ("fleet.num_clients", "0"), ("mask.policy", '"magic"')],
)
def test_an_override_is_validated_exactly_like_the_file(tmp_path, key, value):
    """The same bad value in the file and on the command line: the same one-line error."""
    section, name = key.split(".")
    data = tomllib.loads(DEMO.read_text())
    data[section][name] = tomllib.loads(f"v = {value}")["v"]
    with pytest.raises(ConfigError) as from_file:
        parse_config(data)

    with pytest.raises(ConfigError) as from_override:
        load_config(DEMO, overrides=[f"{key}={value}"])

    assert str(from_override.value) == str(from_file.value)
    assert len(str(from_override.value).splitlines()) == 1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.inner_lrr=0.2",
            "config error: algorithm.inner_lrr = 0.2: unknown field (did you mean 'inner_lr'?)",
        ),
        (
            "estimator.max_iterr=3",  # the demo's estimator is cg
            "config error: estimator.max_iterr = 3: unknown field (did you mean 'max_iter'?)",
        ),
        (
            "fleat.num_clients=50",
            "config error: fleat = {...}: unknown field (did you mean 'fleet'?)",
        ),
        ("roundz=3", "config error: roundz = 3: unknown field (did you mean 'rounds'?)"),
        (
            "runtime.zzz=1",  # nothing close: where the allowed keys are
            "config error: runtime.zzz = 1: unknown field (check the spelling; see the README for "
            "the allowed keys)",
        ),
    ],
)
def test_a_misspelt_key_gets_a_did_you_mean(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides=[override])
    assert str(err.value) == message


def test_a_misspelt_key_of_a_nested_section_in_the_file_gets_a_did_you_mean():
    data = tomllib.loads(DEMO.read_text())
    data["fleet"].pop("devices")
    data["fleet"].pop("capacities")
    data["fleet"]["trace"] = {"pth": "t.json", "flops_per_sample": 1.0, "memory_bytes": 10}
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    lines = str(err.value).splitlines()
    assert "config error: fleet.trace.pth = 't.json': unknown field (did you mean 'path'?)" in lines


def test_cli_overrides_change_the_run_and_results_json_records_them(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    # overrides before and after an option; flags still work beside them
    argv = ["run", str(tiny), "algorithm.inner_lr=0.2", "--quiet", "--output-dir", str(out)]
    argv += ["model.hidden=[8]", "--seed", "4"]

    assert main(argv) == 0, capsys.readouterr().err

    results = json.loads((out / "results.json").read_text())
    assert results["overrides"] == ["algorithm.inner_lr=0.2", "model.hidden=[8]"]
    config = results["config"]
    assert config["algorithm"]["inner_lr"] == 0.2
    assert config["model"]["hidden"] == [8]
    assert config["seed"] == 4 and config["rounds"] == 1
    assert config["fleet"]["num_clients"] == 3  # the file's, untouched


def test_cli_override_with_a_typo_exits_2_with_one_line_before_writing(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["run", str(tiny), "--quiet", "--output-dir", str(out), "algorithm.inner_lrr=0.2"]

    assert main(argv) == 2

    assert capsys.readouterr().err == (
        "config error: algorithm.inner_lrr = 0.2: unknown field (did you mean 'inner_lr'?)\n"
    )
    assert not out.exists()


def test_cli_fleet_takes_overrides_too(tiny, capsys):
    assert main(["fleet", str(tiny), "--json", "fleet.num_clients=4", "model.hidden=[8]"]) == 0

    rows = json.loads(capsys.readouterr().out)
    assert [row["client"] for row in rows] == [0, 1, 2, 3]


def test_cli_refuses_a_word_that_is_not_an_override(tiny, capsys):
    assert main(["run", str(tiny), "--quiet", "fleet"]) == 2
    assert capsys.readouterr().err.startswith("config error: override 'fleet' is not KEY=VALUE")


def test_the_override_doctests_hold():
    import doctest

    import radbo.config

    result = doctest.testmod(radbo.config)
    assert result.failed == 0 and result.attempted >= 3
