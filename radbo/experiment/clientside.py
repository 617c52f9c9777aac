"""The client side of a run: the model clients train, its structure plan, the algorithm and
the :class:`~radbo.client.ClientRuntime` every client's work runs in.

One build serves every place that runs client work: :func:`radbo.experiment.build` (the
simulation, and through it ``radbo export``) and a Flower node that holds its own data
(:func:`radbo.flower.nodedata.node_side`). Each makes the model with :func:`client_model`,
then the algorithm and runtime with :func:`client_side`. The two steps are apart because the
server plans the fleet's budgets with the model and its structure plan in between, and the
fleet's mean local steps those budgets give are wired into the algorithm (a node reads them
from its node data).

The builders take their own config section (``build_model(config.model, ...)``,
``build_algorithm(config.algorithm, ...)``, ``build_task(config.task, ...)``); what an
algorithm needs from other sections comes in its :class:`~radbo.algorithms.Wiring`
(:func:`algorithm_wiring`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radbo.algorithms import AlgorithmConfig, Wiring
from radbo.client import Algorithm, ClientRuntime, Phase, pads_minibatches
from radbo.config import ConfigError, RunConfig
from radbo.data import Dataset, DatasetSummary
from radbo.graphs import PhaseGraphs
from radbo.masks.structure import StructurePlan
from radbo.models import BilevelModel, ModelConfig
from radbo.problem import BilevelProblem, Sampler
from radbo.randomness import Stream, derive_seed
from radbo.tasks import TaskConfig

__all__ = [
    "RUN_DTYPES",
    "ClientModel",
    "ClientSide",
    "algorithm_wiring",
    "build_algorithm",
    "build_model",
    "build_task",
    "client_model",
    "client_side",
    "structure_plan",
]

#: The torch dtype of each ``[runtime] dtype``.
RUN_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_model(
    section: ModelConfig,
    input_shape: tuple[int, ...],
    classes: int,
    *,
    seed: int,
    dtype: torch.dtype,
    data_name: str,
) -> BilevelModel:
    """The ``[model]`` of ``section`` for inputs of ``input_shape`` (one example) and
    ``classes`` outputs, initialised from the run ``seed`` (global RNG state is restored), in
    ``dtype``. Inputs the model cannot take are a :class:`ConfigError` (``data_name``: the
    data set they come from, for the message)."""
    if not section.flat:
        try:
            section.image(tuple(input_shape), data_name)
        except ValueError as err:
            raise ConfigError(f"config error: model.name = {section.name!r}: {err}") from None
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(seed, Stream.INIT))
        try:
            model = section.build(tuple(input_shape), classes)
        except ValueError as err:  # sizes the model cannot take
            raise ConfigError(
                f"config error: model.name = {section.name!r}: cannot take {data_name} inputs "
                f"of shape {tuple(input_shape)}: {err}"
            ) from None
        except (MemoryError, RuntimeError) as err:  # torch's "can't allocate memory"
            if not isinstance(err, MemoryError) and "allocate" not in str(err):
                raise  # not an allocation failure: a bug, keep its traceback
            raise ConfigError(
                f"config error: model.name = {section.name!r}: the model does not fit in this "
                f"machine's memory ({str(err).splitlines()[0] if str(err) else 'MemoryError'}); "
                "use smaller widths"
            ) from None
    return model.to(dtype)


def build_task(section: TaskConfig, training: DatasetSummary) -> BilevelProblem:
    """The ``[task]``'s bilevel problem (its inner and outer losses) for the training set
    ``training`` summarises."""
    problem: BilevelProblem = section.build(training)
    return problem


def structure_plan(model: BilevelModel) -> StructurePlan:
    """The structure plan (coupled channel groups, submodel skeletons) of ``model``."""
    return StructurePlan(model, model.example_input(1), output_layers=model.output_layers)


@dataclass(frozen=True)
class ClientModel:
    """The model a run trains, which of its tensors are x (``outer``), y (``inner``) and
    buffers, and its structure plan (``None`` when nothing needs submodels or a memory model:
    no mask policy and no device fleet)."""

    model: BilevelModel
    outer: list[str]
    inner: list[str]
    buffers: list[str]
    plan: StructurePlan | None


def client_model(
    config: RunConfig, input_shape: tuple[int, ...], outputs: int, *, structure: bool
) -> ClientModel:
    """The configured model for inputs of ``input_shape`` and ``outputs`` outputs, its tensors'
    roles, and with ``structure`` its structure plan."""
    model = build_model(
        config.model,
        input_shape,
        outputs,
        seed=config.seed,
        dtype=RUN_DTYPES[config.runtime.dtype],
        data_name=config.data.name,
    )
    outer, inner = model.outer_param_names(), model.inner_param_names()
    roles = set(outer) | set(inner)
    buffers = [n for n in model.state_dict() if n not in roles]
    plan = structure_plan(model) if structure else None
    return ClientModel(model, outer, inner, buffers, plan)


def algorithm_wiring(
    config: RunConfig, model: ClientModel, population_steps: float | None
) -> Wiring:
    """What the configured algorithm is wired with besides its own section: the model's
    names, the estimator, the BatchNorm mode, the local-steps mode, the fleet's mean local
    steps ``population_steps`` and the seed of its own random stream."""
    return Wiring(
        outer_names=tuple(model.outer),
        inner_names=tuple(model.inner),
        buffer_names=tuple(model.buffers),
        estimator=config.estimator,
        aggregate_buffers=not config.model.static_batchnorm,
        budget_steps=config.fleet.local_steps != "fixed",
        seed=derive_seed(config.seed, Stream.ALGORITHM),
        population_steps=population_steps,
    )


def build_algorithm(section: AlgorithmConfig, wiring: Wiring) -> Algorithm[Any]:
    """The ``[algorithm]`` of ``section``, wired with ``wiring``."""
    algorithm: Algorithm[Any] = section.build(wiring)
    return algorithm


@dataclass
class ClientSide:
    """What client work runs with: the model, the algorithm (whose phases' client halves
    clients run) and the runtime over the examples clients index."""

    model: ClientModel
    algorithm: Algorithm[Any]
    runtime: ClientRuntime

    @property
    def phases(self) -> dict[str, Phase[Any]]:
        """The algorithm's phases by name."""
        return {p.name: p for p in self.algorithm.phases()}


def client_side(
    config: RunConfig,
    model: ClientModel,
    examples: Dataset,
    training: DatasetSummary,
    sampler: Sampler,
    population_steps: float | None,
) -> ClientSide:
    """The client side of ``config`` for ``model``: the algorithm wired with the fleet's mean
    local steps ``population_steps``, and the runtime over ``examples`` (the training set on
    the server, a node's own examples on a Flower node), drawing minibatches with ``sampler``,
    whose task is built for the training set ``training`` summarises."""
    algorithm = build_algorithm(config.algorithm, algorithm_wiring(config, model, population_steps))
    plan = model.plan
    problem = build_task(config.task, training)
    runtime = ClientRuntime(
        problem=problem,
        features=examples.features,
        labels=examples.labels,
        model=model.model,
        build_submodel=None if plan is None else plan.submodel,
        sampler=sampler,
        pads=pads_minibatches(problem, model.model),
        channels_last=config.runtime.memory_format == "channels_last",
        graphs=PhaseGraphs() if config.runtime.cuda_graphs else None,
    )
    return ClientSide(model, algorithm, runtime)
