"""Python API of ``radbo run``: build a simulation from a :class:`RunConfig`, run it, save it.

>>> from radbo.config import RunConfig
>>> cfg = RunConfig(rounds=2, eval_every=1)        # doctest: +SKIP
>>> result = radbo.run(cfg, progress=False)        # doctest: +SKIP
>>> result.final["test_accuracy"]                  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from radbo.algorithms.rabo import RABO
from radbo.config import (
    CGEstimator,
    CNNModel,
    DirichletPartition,
    IIDPartition,
    MLPModel,
    NeumannEstimator,
    RunConfig,
    ShardsPartition,
)
from radbo.data import (
    Dataset,
    load_digits,
    partition_dirichlet,
    partition_iid,
    partition_shards,
    split_indices,
    train_test_split,
)
from radbo.hypergrad import HypergradEstimator, ImplicitCG, Neumann
from radbo.masks.assigner import SubmodelAssigner
from radbo.masks.policies import ImportancePolicy, LeadingPolicy
from radbo.masks.structure import StructurePlan
from radbo.models import MLP, BilevelModel, SmallCNN
from radbo.problem import ClientData, forward
from radbo.simulation.engine import (
    ClientBudget,
    ClientRuntime,
    RoundRecord,
    Simulation,
    derive_seed,
)
from radbo.tasks import HyperRepresentation
from radbo.typing import Params

# Stream identifiers for derive_seed: each random choice of a run has its own stream.
_SPLIT, _PARTITION, _INIT, _CLIENT_SPLIT = 11, 12, 13, 14


@dataclass
class Experiment:
    """Everything a run needs, built from a config: the simulation and its initial state."""

    config: RunConfig
    model: BilevelModel
    simulation: Simulation
    initial_state: Any
    train: Dataset
    test: Dataset
    clients: list[ClientData]


@dataclass
class RunResult:
    """Outcome of :func:`run`: per-round records, the final evaluation and the final state."""

    config: RunConfig
    rounds: list[dict[str, Any]]
    final: dict[str, float]
    state: Any
    output_dir: Path | None = None
    totals: dict[str, int] = field(default_factory=dict)


def build_model(config: RunConfig, input_shape: tuple[int, ...], classes: int) -> BilevelModel:
    """The configured model, initialised from the run seed (global RNG state is restored)."""
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(config.seed, _INIT))
        if isinstance(config.model, MLPModel):
            in_features = 1
            for d in input_shape:
                in_features *= d
            return MLP(in_features, config.model.hidden, classes)
        if isinstance(config.model, CNNModel):
            channels, size = input_shape[0], input_shape[-1]
            return SmallCNN(channels, size, config.model.channels, classes)
    raise TypeError(f"unsupported model config {config.model!r}")  # pragma: no cover


def build_estimator(config: RunConfig) -> HypergradEstimator:
    est = config.estimator
    if isinstance(est, CGEstimator):
        return ImplicitCG(max_iter=est.max_iter, tol=est.tol, damping=est.damping)
    if isinstance(est, NeumannEstimator):
        return Neumann(terms=est.terms, eta=est.eta)
    raise TypeError(f"unsupported estimator config {est!r}")  # pragma: no cover


def partition(config: RunConfig, labels: torch.Tensor) -> list[torch.Tensor]:
    """Split training indices over clients as configured."""
    gen = torch.Generator().manual_seed(derive_seed(config.seed, _PARTITION))
    part, n = config.partition, config.fleet.num_clients
    if isinstance(part, IIDPartition):
        return partition_iid(labels, n, gen)
    if isinstance(part, ShardsPartition):
        return partition_shards(labels, n, part.classes_per_client, gen)
    if isinstance(part, DirichletPartition):
        return partition_dirichlet(labels, n, part.alpha, gen, min_size=2)
    raise TypeError(f"unsupported partition config {part!r}")  # pragma: no cover


def make_evaluator(
    model: BilevelModel, test: Dataset, outer_names: list[str], inner_names: list[str]
) -> Callable[[Params], dict[str, float]]:
    """Accuracy and cross-entropy of the global model on the held-out test set."""
    module = model
    outer, inner = set(outer_names), set(inner_names)

    def evaluate(state: Params) -> dict[str, float]:
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                x = {k: v for k, v in state.items() if k in outer}
                y = {k: v for k, v in state.items() if k in inner}
                b = {k: v for k, v in state.items() if k not in outer and k not in inner}
                logits = forward(module, x, y, b, test.features)
                loss = F.cross_entropy(logits, test.labels)
                acc = (logits.argmax(1) == test.labels).float().mean()
        finally:
            module.train(was_training)
        return {"accuracy": float(acc), "loss": float(loss)}

    return evaluate


def build(config: RunConfig) -> Experiment:
    """Build data, model, fleet, masks, algorithm and the simulation for ``config``."""
    is_cnn = isinstance(config.model, CNNModel)
    data = load_digits(flatten=not is_cnn)
    split_gen = torch.Generator().manual_seed(derive_seed(config.seed, _SPLIT))
    train, test = train_test_split(data, config.data.test_fraction, split_gen)
    parts = partition(config, train.labels)
    client_gen = torch.Generator().manual_seed(derive_seed(config.seed, _CLIENT_SPLIT))
    clients = []
    for idx in parts:
        inner, outer = split_indices(idx, 1.0 - config.data.outer_fraction, client_gen)
        clients.append(ClientData(inner=inner, outer=outer))

    model = build_model(config, tuple(train.input_shape), train.num_classes)
    outer_names = model.outer_param_names()
    inner_names = model.inner_param_names()
    state = model.state_dict()
    buffer_names = [n for n in state if n not in set(outer_names) | set(inner_names)]
    shapes = {n: t.shape for n, t in state.items()}

    plan: StructurePlan | None = None
    assigner: SubmodelAssigner | None = None
    if config.mask.policy != "none":
        plan = StructurePlan(model, model.example_input(1), output_layers=model.output_layers)
        policy = ImportancePolicy() if config.mask.policy == "importance" else LeadingPolicy()
        assigner = SubmodelAssigner(
            plan, policy, outer_names, mask_x=config.mask.mask_x, mask_y=config.mask.mask_y
        )

    algo_cfg = config.algorithm
    algorithm = RABO(
        outer_names=tuple(outer_names),
        inner_names=tuple(inner_names),
        buffer_names=tuple(buffer_names),
        inner_lr=algo_cfg.inner_lr,
        outer_lr=algo_cfg.outer_lr,
        inner_steps=algo_cfg.inner_steps,
        batch_size=algo_cfg.batch_size,
        outer_batch_size=algo_cfg.outer_batch_size,
        estimator=build_estimator(config),
        max_hypergrad_norm=algo_cfg.max_hypergrad_norm,
    )
    caps = config.fleet.capacities
    budgets = [
        ClientBudget(capacity=caps[i % len(caps)], local_steps=algo_cfg.inner_steps)
        for i in range(config.fleet.num_clients)
    ]
    weights = None
    if algo_cfg.weighting == "data_size":
        weights = [float(c.inner.numel()) for c in clients]
    runtime = ClientRuntime(
        problem=HyperRepresentation(inner_l2=config.task.inner_l2),
        features=train.features,
        labels=train.labels,
        model=model,
        build_submodel=None if plan is None else plan.submodel,
    )
    simulation = Simulation(
        algorithm=algorithm,
        runtime=runtime,
        clients=clients,
        budgets=budgets,
        shapes=shapes,
        masks=assigner,
        seed=config.seed,
        clients_per_round=config.fleet.clients_per_round,
        weights=weights,
        evaluate=make_evaluator(model, test, outer_names, inner_names),
        eval_every=config.eval_every,
    )
    initial = algorithm.init(
        {n: state[n] for n in outer_names},
        {n: state[n] for n in inner_names},
        {n: state[n] for n in buffer_names},
    )
    return Experiment(config, model, simulation, initial, train, test, clients)


def run(
    config: RunConfig,
    *,
    progress: bool = True,
    output_dir: str | Path | None = None,
    save: bool = True,
) -> RunResult:
    """Run ``config`` end to end; with ``save`` writes ``results.json`` and ``accuracy.png``
    to ``output_dir`` (default ``config.output_dir``)."""
    exp = build(config)
    state = exp.initial_state
    iterator = exp.simulation.iterate(exp.initial_state, config.rounds)
    records: list[RoundRecord] = []
    bar = tqdm(total=config.rounds, desc="radbo", unit="round", disable=not progress)
    last_eval: dict[str, float] = {}
    try:
        for state, record in iterator:  # noqa: B007 (the last state is the result)
            records.append(record)
            if record.evaluation is not None:
                last_eval = record.evaluation
            bar.update(1)
            postfix = {"outer": f"{record.metrics.get('outer_loss', float('nan')):.3f}"}
            if last_eval:
                postfix["acc"] = f"{last_eval['accuracy']:.3f}"
            bar.set_postfix(postfix)
    finally:
        bar.close()
    rows = [r.as_dict() for r in records]
    totals: dict[str, int] = {}
    for r in records:
        for k, v in r.cost.items():
            totals[k] = totals.get(k, 0) + v
    totals["communication_rounds"] = sum(r.communication_rounds for r in records)
    final = {f"test_{k}": v for k, v in last_eval.items()}
    result = RunResult(config=config, rounds=rows, final=final, state=state, totals=totals)
    if save:
        out = Path(output_dir if output_dir is not None else config.output_dir)
        save_results(result, out)
        result.output_dir = out
    return result


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_results(result: RunResult, out: Path) -> None:
    """``results.json`` (config, per-round metrics, totals, final) and ``accuracy.png``."""
    payload = {
        "radbo_version": _version(),
        "config": result.config.model_dump(mode="json"),
        "final": result.final,
        "totals": result.totals,
        "rounds": result.rounds,
    }
    atomic_write_text(out / "results.json", json.dumps(payload, indent=2, allow_nan=True))
    from radbo.report import plot_accuracy

    plot_accuracy(result.rounds, out / "accuracy.png", title=f"{result.config.algorithm.name}")


def _version() -> str:
    from radbo import __version__

    return __version__
