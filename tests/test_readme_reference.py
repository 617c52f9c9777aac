"""The README's configuration reference is the one the config classes generate
(:mod:`radbo.docs`), and the generator says what the classes say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Field

from radbo.config import RunConfig
from radbo.docs import (
    BEGIN,
    END,
    allowed_text,
    combinations,
    config_reference,
    default_text,
    main,
    readme_reference,
    replace_reference,
)
from radbo.registry import Registry, Section, registries

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def reference() -> str:
    """The reference of radbo's own kinds: made in a fresh interpreter, since tests register
    toy kinds (tests/test_architecture.py's algorithm) in theirs."""
    done = subprocess.run(
        [sys.executable, "-m", "radbo.docs"], capture_output=True, text=True, check=True
    )
    return done.stdout


def test_the_readme_holds_the_generated_reference(reference):
    """Fails when a config class changed and the README was not regenerated: run
    ``python -m radbo.docs --write README.md``."""
    text = README.read_text(encoding="utf-8")
    assert replace_reference(text, reference) == text, "run: python -m radbo.docs --write README.md"


def test_every_key_of_every_kind_is_in_the_reference(reference):
    for registry in registries():
        for cls in registry.classes():
            if not cls.__module__.startswith("radbo.") or cls.__module__ == "radbo.registry":
                # a kind a test registered, or radbo.registry's docstring example ("square",
                # "circle"), registered when tests/test_docstring_examples.py ran first in
                # this process
                continue
            for tag in cls.model_fields[registry.key].annotation.__args__:
                assert f'`"{tag}"`' in reference, (registry.section, tag)
            for key in cls.model_fields:
                if key != registry.key:
                    assert f"| `{key}` |" in reference, (registry.section, cls.__name__, key)
    for name in RunConfig.model_fields:
        assert f"| `{name}` |" in reference or f"**`[{name}]`**" in reference, name


def test_every_config_key_has_a_description(reference):
    """The reference says what each key means: a field without a description leaves its
    row's meaning empty."""
    empty = [
        line
        for line in reference.splitlines()
        if line.startswith("| ") and not line.startswith("| key") and line.endswith("|  |")
    ]
    assert empty == []


def test_check_and_write(tmp_path: Path, capsys):
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{BEGIN}\nold table\n{END}\noutro\n")
    assert main(["--check", str(stale)]) == 1
    assert "not current" in capsys.readouterr().err
    assert main(["--write", str(stale)]) == 0
    assert stale.read_text() == f"intro\n{BEGIN}\n{readme_reference()}{END}\noutro\n"
    assert main(["--check", str(stale)]) == 0
    with pytest.raises(ValueError, match="exactly one"):
        replace_reference("no markers here")


# ----------------------------------------------------------------------------- small cases


@pytest.mark.parametrize(
    "annotation, metadata, text",
    [
        (int, [Field(ge=1).metadata[0]], "integer >= 1"),
        (float, Field(gt=0, lt=1).metadata, "number > 0, < 1"),
        (bool, [], "true or false"),
        (Literal["a", "b", "c"], [], '"a", "b" or "c"'),
        (int | None, Field(ge=1).metadata, "integer >= 1 or unset"),
        (
            list[Annotated[float, Field(gt=0, le=1)]] | None,
            Field(min_length=2).metadata,
            "(list of numbers > 0, <= 1 (at least 2 entries)) or unset",
        ),
        (tuple[int, int], [], "[integer, integer]"),
        (dict[str, Annotated[float, Field(ge=0)]], [], "table of numbers >= 0"),
        (str, Field(pattern=r"^x+$").metadata, "text matching `^x+$`"),
    ],
)
def test_allowed_text(annotation, metadata, text):
    assert allowed_text(annotation, metadata) == text


def test_a_registered_kind_gets_its_table(monkeypatch):
    """A toy section with a tagged sub-section, as a plug-in would register one."""
    import radbo.registry

    # the toy registry goes to a copy of the list of registries, dropped after the test
    monkeypatch.setattr(radbo.registry, "_REGISTRIES", list(radbo.registry._REGISTRIES))
    shapes: Registry = Registry("shape", "kind")

    @shapes.register
    class Square(Section):
        kind: Literal["square"] = "square"
        side: float = Field(1.0, gt=0, description="edge length")
        color: str = Field("red", description="fill")

    @shapes.register
    class Dot(Section):
        kind: Literal["dot", "point"]
        color: str = Field("red", description="fill")

    class Drawing(Section):
        scale: int = Field(2, ge=1, description="zoom")
        shape: Annotated[Section, shapes] = Field(default_factory=Square)

    shapes.attach(Drawing)
    assert config_reference(Drawing) == (
        "**top level**\n\n"
        "| key | default | allowed | meaning |\n|---|---|---|---|\n"
        "| `scale` | `2` | integer >= 1 | zoom |\n\n"
        '**`[shape]`**, chosen by `kind` (default "square"; a section without `kind` takes '
        "the default kind)\n\n"
        "| `kind` | key | default | allowed | meaning |\n|---|---|---|---|---|\n"
        '| every kind | `color` | `"red"` | text | fill |\n'
        '| `"square"` | `side` | `1.0` | number > 0 | edge length |\n'
        '| `"dot"`, `"point"` | | | | no settings |\n'
    )


def test_defaults_are_toml_values():
    fields = RunConfig.model_fields
    assert default_text(fields["seed"]) == "0"
    assert default_text(fields["output_dir"]) == '"runs/radbo"'
    assert default_text(fields["checkpoint_every"]) == "unset"
    from radbo.config import FleetConfig, TraceConfig

    assert default_text(FleetConfig.model_fields["local_steps_range"]) == "[1, 10]"
    assert default_text(TraceConfig.model_fields["path"]) == "required"


def test_combinations_say_what_validation_enforces():
    """Each row of the table is what parse_config accepts and refuses."""
    from radbo.config import ConfigError, parse_config

    rows = {
        m["name"]: m["rest"]
        for m in re.finditer(r'^\| `"(?P<name>\w+)"` \| (?P<rest>.*) \|$', combinations(), re.M)
    }
    assert rows["fedmbo"].endswith('`"none"` (it trains the full model) | any')
    with pytest.raises(ConfigError, match="trains the full model"):
        parse_config({"algorithm": {"name": "fedmbo"}, "mask": {"policy": "leading"}})
    assert rows["fedsvrbgd_fo"].startswith('`"first_order"` (`lam = 50.0`; only `lam` used)')
    assert parse_config({"algorithm": {"name": "fedsvrbgd_fo"}}).estimator.lam == 50.0
    assert rows["simfbo"].startswith('`"autograd"`, `"finite_difference"` (only `hvp_mu` used)')
    with pytest.raises(ConfigError, match="no effect"):
        parse_config(
            {"algorithm": {"name": "simfbo"}, "estimator": {"name": "finite_difference", "mu": 0.1}}
        )
    assert rows["protonet"].endswith('| any | `"few_shot"`')
    with pytest.raises(ConfigError, match="runs only on"):
        parse_config({"algorithm": {"name": "protonet"}, "task": {"name": "hyper_representation"}})
    assert rows["feature_l2"] == '`"logistic"` | `"none"` (nothing to prune)'
