"""What ships with radbo: the license, the citation file, the package metadata and the files
radbo reads at run time (in the wheel), and the README's facts about them."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tomllib
import zipfile
from fnmatch import fnmatch
from importlib.metadata import version
from pathlib import Path

import pytest

import radbo

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert text.split("\n")[1:4] == [
        " " * 33 + "Apache License",
        " " * 27 + "Version 2.0, January 2004",
        " " * 24 + "http://www.apache.org/licenses/",
    ]
    # all nine sections of the terms, the end marker and the appendix's notice
    for n, title in enumerate(
        [
            "Definitions",
            "Grant of Copyright License",
            "Grant of Patent License",
            "Redistribution",
            "Submission of Contributions",
            "Trademarks",
            "Disclaimer of Warranty",
            "Limitation of Liability",
            "Accepting Warranty or Additional Liability",
        ],
        start=1,
    ):
        assert f"   {n}. {title}." in text, title
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(text.splitlines()) == 202


def test_package_metadata():
    assert PROJECT["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert PROJECT["license-files"] == ["LICENSE"]
    assert PROJECT["version"] == radbo.__version__
    assert PROJECT["authors"] and PROJECT["classifiers"]
    extras = PROJECT["optional-dependencies"]
    # dev builds on the user extras instead of repeating them
    assert extras["dev"][0] == "radbo[flower,edge,tensorboard]"
    users = ("flower", "edge", "tensorboard")
    repeated = {r for name in users for r in extras[name]} & set(extras["dev"])
    assert repeated == set()
    # upper bounds where radbo relies on a dependency's internals
    bounded = {
        "torch-pruning": PROJECT["dependencies"],
        "flwr[simulation]": extras["flower"],
        "executorch": extras["edge"],
    }
    for name, requirements in bounded.items():
        [spec] = [r for r in requirements if r.startswith(name)]
        assert "<" in spec, spec


def test_installed_versions_are_within_the_bounds():
    from packaging.requirements import Requirement

    extras = PROJECT["optional-dependencies"]
    for spec in [*PROJECT["dependencies"], *extras["flower"], *extras["edge"]]:
        req = Requirement(spec)
        try:
            installed = version(req.name)
        except Exception:  # an extra this environment does not have
            continue
        assert req.specifier.contains(installed, prereleases=True), (spec, installed)


def test_every_runtime_file_is_package_data():
    """Every file below radbo/ that is not Python source matches a package-data pattern, so
    the wheel has what radbo reads at run time (device catalog, py.typed, the Flower app)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["radbo"]
    package = ROOT / "radbo"
    data = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert {"py.typed", "__init__.pyi", "devices/catalog.toml", "flower/app/pyproject.toml"} <= set(
        data
    )
    missing = [f for f in data if not any(fnmatch(f, pattern) for pattern in patterns)]
    assert missing == []


@pytest.mark.slow
def test_the_wheel_carries_the_runtime_files_and_the_license(tmp_path):
    """About 10 s: setuptools in an isolated build environment from the package index."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = tmp_path.glob("radbo-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(f"radbo-{radbo.__version__}.dist-info/METADATA").decode()
    for name in (
        "radbo/py.typed",
        "radbo/devices/catalog.toml",
        "radbo/flower/app/pyproject.toml",
        "radbo/flower/deploy.py",
        f"radbo-{radbo.__version__}.dist-info/licenses/LICENSE",
    ):
        assert name in names, name
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


# ----------------------------------------------------------------------------- citations


def readme_citations() -> list[str]:
    """The titles in the README's citation paragraph (after the algorithm table)."""
    start = README.index("The papers, by the titles and authors they print")
    paragraph = README[start : README.index("\n\n", start)]
    return [" ".join(t.split()) for t in re.findall(r'"([^"]+)"', paragraph)]


def test_citation_file_names_radbo_and_the_papers_of_the_readme():
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["version"] == radbo.__version__
    assert cff["license"] == PROJECT["license"]
    titles = [" ".join(r["title"].split()) for r in cff["references"]]
    assert titles == readme_citations()
    assert len(titles) == 14
    for ref in cff["references"]:
        assert ref["authors"], ref["title"]
        for author in ref["authors"]:  # surnames as the README gives them, no invented names
            assert set(author) <= {"family-names", "name"}


# ----------------------------------------------------------------------------- README facts


def test_the_readme_names_the_flower_that_installs():
    """The flwr versions the README names are the ones radbo's bounds allow, the installed
    one among them."""
    pytest.importorskip("flwr")
    named = set(re.findall(r"flwr (\d+\.\d+)", README)) | set(
        re.findall(r"Flower \((\d+\.\d+)", README)
    )
    installed = ".".join(version("flwr").split(".")[:2])
    assert installed in named
    assert named <= {"1.41", "1.42"}, named


def test_the_readme_cites_papers_not_files_radbo_does_not_ship():
    assert "papers/" not in README


# ------------------------------------------------------------------ the public API, declared once
@pytest.mark.parametrize("package", ["radbo", "radbo.flower"])
def test_every_public_name_is_declared_once_and_resolves(package: str) -> None:
    """The stub ``__init__.pyi`` is the one declaration: ``__all__`` is made from it, no name
    is declared twice, and each name is, on first use, the object of that name in the module
    the stub says."""
    module = importlib.import_module(package)
    stub = Path(str(module.__file__)).with_suffix(".pyi")
    imports = [
        n for n in ast.parse(stub.read_text(encoding="utf-8")).body if isinstance(n, ast.ImportFrom)
    ]
    declared = {
        alias.asname or alias.name: f"{package}.{n.module}" for n in imports for alias in n.names
    }
    assert sum(len(n.names) for n in imports) == len(declared)  # no name declared twice
    assert sorted(declared) == module.__all__
    if package == "radbo.flower":
        pytest.importorskip("flwr")
    for name, home in declared.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name)
        assert name in dir(module)


def test_every_algorithm_of_the_registry_is_public() -> None:
    """Each built-in algorithm's config class, and the algorithm class it builds, is a public
    name: the exported set is the registry's, not a matter of chance."""
    from radbo.algorithms import ALGORITHMS

    builtin = [c for c in ALGORITHMS.classes() if c.__module__.startswith("radbo.")]
    assert len(builtin) >= 11
    for config in builtin:
        assert getattr(radbo, config.__name__) is config
        algorithm = config.__name__.removesuffix("Config")
        assert getattr(radbo, algorithm).__mro__[1] is config
