"""Variants, backends, baselines and estimator memory models are registered classes (issue 29
item 5): a config's name picks a class from a registry, and nothing dispatches on a name with
``if ... name == "..."``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

import radbo
from radbo.algorithms import (
    ALGORITHMS,
    MAML,
    RABO,
    RAFBO,
    FedNest,
    FedNestConfig,
    LFedNest,
    LFedNestConfig,
    MAMLConfig,
    ProtoNet,
    ProtoNetConfig,
    RABOConfig,
    RAFBOConfig,
    ShroFBO,
    ShroFBOConfig,
    SimFBO,
    SimFBOConfig,
    Wiring,
)
from radbo.config import BaselineConfig, ConfigError, RuntimeConfig, parse_config
from radbo.devices import estimate_training_memory
from radbo.experiment.baseline import BASELINES
from radbo.experiment.build import build_backend
from radbo.hypergrad import ESTIMATORS, FiniteDifference, ImplicitCG
from radbo.models import MLP
from radbo.simulation import (
    BACKENDS,
    AutoBackend,
    BatchedBackend,
    ProcessBackend,
    SequentialBackend,
)

ROOT = Path(radbo.__file__).resolve().parent
WIRING = Wiring(outer_names=("x",), inner_names=("y",))


@pytest.mark.parametrize(
    ("tag", "config_cls", "algorithm_cls"),
    [
        ("rabo", RABOConfig, RABO),
        ("rafbo", RAFBOConfig, RAFBO),
        ("fednest", FedNestConfig, FedNest),
        ("lfednest", LFedNestConfig, LFedNest),
        ("simfbo", SimFBOConfig, SimFBO),
        ("shrofbo", ShroFBOConfig, ShroFBO),
        ("protonet", ProtoNetConfig, ProtoNet),
        ("maml", MAMLConfig, MAML),
    ],
)
def test_each_variant_resolves_through_the_registry(tag, config_cls, algorithm_cls):
    """Each tag is its own registered class, whose ``build`` makes its own algorithm."""
    assert ALGORITHMS[tag] is config_cls
    assert get_args(config_cls.model_fields["name"].annotation) == (tag,)
    config = ALGORITHMS[tag].model_validate({"name": tag})
    algorithm = config.build(WIRING)
    assert type(algorithm) is algorithm_cls
    assert algorithm.name == tag
    assert isinstance(algorithm, config_cls)


def test_a_run_config_builds_each_variant():
    base = {"model": {"name": "mlp", "hidden": [8]}, "fleet": {"num_clients": 3}}
    for tag, cls in (("rafbo", RAFBO), ("shrofbo", ShroFBO), ("simfbo", SimFBO)):
        config = parse_config({**base, "algorithm": {"name": tag}})
        assert type(config.algorithm) is ALGORITHMS[tag]
        wired = config.algorithm.build(
            Wiring(outer_names=("x",), inner_names=("y",), estimator=config.estimator)
        )
        assert type(wired) is cls


def test_shrofbo_owns_rho_and_its_validator():
    """rho means something to ShroFBO only; ShroFBO checks that the printed rho is wired."""
    assert "ShroFBO's rho" in ShroFBOConfig.model_fields["rho"].description
    assert "not read by SimFBO" in SimFBOConfig.model_fields["rho"].description
    printed = ShroFBOConfig(rho="printed")
    with pytest.raises(ValidationError, match="needs population_steps"):
        ShroFBO(outer_names=("x",), inner_names=("y",), rho="printed")
    assert printed.build(Wiring(("x",), ("y",), population_steps=3.0)).population_steps == 3.0
    # SimFBO takes no population: nothing of ShroFBO's wiring reaches it
    assert "population_steps" not in SimFBO.model_fields
    assert not issubclass(SimFBO, ShroFBOConfig)


def test_dumps_keep_their_keys_in_place():
    """Configs, results and checkpoints hold a kind's dump: the split moved no key."""
    for tag in ("simfbo", "shrofbo"):
        keys = list(ALGORITHMS[tag].model_validate({"name": tag}).model_dump())
        assert keys[keys.index("local_steps") + 1] == "rho", tag
    assert list(RAFBOConfig().model_dump()) == list(RABOConfig().model_dump())
    assert RAFBOConfig().model_dump() == {**RABOConfig().model_dump(), "name": "rafbo"}
    fednest = FedNestConfig(name="fednest").model_dump()
    assert LFedNestConfig(name="lfednest").model_dump() == {**fednest, "name": "lfednest"}


def test_rafbo_requires_the_finite_difference_estimator_as_a_rule_of_its_class():
    assert RAFBOConfig().accepted_estimators() == ("finite_difference",)
    assert RAFBOConfig.default_estimator == "finite_difference"
    assert "cg" in RABOConfig().accepted_estimators()
    assert isinstance(RAFBO(outer_names=("x",), inner_names=("y",)).estimator, FiniteDifference)
    with pytest.raises(ValidationError, match="takes estimator 'finite_difference'; got 'cg'"):
        RAFBO(outer_names=("x",), inner_names=("y",), estimator=ImplicitCG())
    with pytest.raises(ConfigError, match="algorithm rafbo takes estimator finite_difference"):
        parse_config({"algorithm": {"name": "rafbo"}, "estimator": {"name": "neumann"}})


def test_every_backend_resolves_through_the_registry():
    runtime = RuntimeConfig(workers=2)
    assert BACKENDS in RuntimeConfig.model_fields["backend"].metadata  # the setting's choices
    for name, cls in (
        ("sequential", SequentialBackend),
        ("batched", BatchedBackend),
        ("processes", ProcessBackend),
        ("auto", AutoBackend),
    ):
        assert BACKENDS[name] is cls
        backend = BACKENDS[name].from_runtime(runtime.model_copy(update={"backend": name}))
        assert type(backend) is cls
    assert BACKENDS["processes"].from_runtime(runtime).workers == 2
    config = parse_config({"runtime": {"backend": "batched"}})
    assert type(build_backend(config.runtime)) is BatchedBackend
    with pytest.raises(
        ConfigError, match="runtime.backend = 'gpu': unknown; registered: auto, batched"
    ):
        BACKENDS["gpu"]


class _ThreadBackend:
    """A backend a user registers after radbo's config classes exist (runs like sequential)."""

    gpu_refusal = "a test's refusal"

    @classmethod
    def from_runtime(cls, runtime):
        return SequentialBackend()


def test_a_backend_registered_later_is_a_valid_setting_and_says_why_not_on_a_gpu(monkeypatch):
    with pytest.raises(ConfigError, match="runtime.backend = 'threads': unknown; registered: "):
        parse_config({"runtime": {"backend": "threads"}})
    monkeypatch.setitem(BACKENDS._choices, "threads", _ThreadBackend)
    config = parse_config({"runtime": {"backend": "threads"}})
    assert type(build_backend(config.runtime)) is SequentialBackend
    with pytest.raises(
        ConfigError,
        match='device = "cuda" needs backend = "auto" or "batched" or "sequential": a test\'s '
        "refusal",
    ):
        parse_config({"runtime": {"backend": "threads", "device": "cuda"}})
    # the README reference lists the names registered when it is made
    from radbo.docs import allowed_text

    field = RuntimeConfig.model_fields["backend"]
    assert allowed_text(field.annotation, field.metadata) == (
        '"auto", "batched", "processes", "sequential" or "threads"'
    )


def test_the_tasks_an_algorithm_names_are_registered_task_kinds():
    """An algorithm's ``tasks`` (the only ``[task]`` kinds it runs on) are checked against
    the task's name when a config is read: a misspelt one would refuse every config."""
    from radbo.tasks import TASKS

    for tag in ALGORITHMS:
        only = ALGORITHMS[tag].tasks
        assert only is None or (only and set(only) <= set(TASKS)), tag


def test_every_baseline_kind_is_registered():
    assert set(BASELINES) == set(get_args(BaselineConfig.model_fields["algorithm"].annotation))


@pytest.mark.parametrize(
    ("estimator", "named"),
    [
        ("autograd", "implicit"),
        ("cg", "implicit"),
        ("neumann", "implicit"),
        ("finite_difference", "finite_difference"),
        ("first_order", "first_order"),
    ],
)
def test_each_estimator_says_its_memory_model(estimator, named):
    """``estimator.hypergradient_bytes`` is the model the name stood for, to the byte."""
    model = MLP(6, [5], 3)
    cls = ESTIMATORS[estimator]
    want = estimate_training_memory(model, 4, hypergradient=named)
    assert estimate_training_memory(model, 4, hypergradient=cls) == want
    assert estimate_training_memory(model, 4, hypergradient=cls(name=estimator)) == want
    none = estimate_training_memory(model, 4, hypergradient="none")
    assert estimate_training_memory(model, 4, hypergradient=None) == none


#: where a kind used to be chosen by comparing a name with a string
NO_NAME_DISPATCH = [
    ROOT / "experiment" / "build.py",
    *sorted((ROOT / "algorithms").glob("*.py")),
    ROOT / "config.py",
    ROOT / "devices" / "budget.py",
    ROOT / "experiment" / "baseline.py",
]
_NAME_DISPATCH = re.compile(r"""\b(name|kind|hypergradient|algorithm)\s*[!=]=\s*["']""")


@pytest.mark.parametrize("path", NO_NAME_DISPATCH, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dispatch_by_name(path):
    """A registry picks the class; comparing a kind's name with a string is not allowed here."""
    found = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _NAME_DISPATCH.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_dispatch_check_sees_the_old_ladders():
    for line in (
        'cls = LFedNest if self.name == "lfednest" else FedNest',
        'if hypergradient == "implicit":',
        'if baseline.algorithm == "fedmbo":',
        "if kind == 'batched':",
    ):
        assert _NAME_DISPATCH.search(line), line
