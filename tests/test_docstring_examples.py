"""Every example in radbo's docstrings runs and prints what it says (``doctest``), so that none
goes stale: one test per module (``radbo.__main__``, which would run the CLI, aside)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import radbo

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(radbo.__path__, "radbo.")
    if not m.name.endswith("__main__")
)


def test_the_modules_are_found():
    assert {"radbo.tasks.few_shot", "radbo.simulation.auto", "radbo.models.vs_resnet"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
