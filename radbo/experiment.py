"""Python API of ``radbo run``: build a simulation from a :class:`RunConfig`, run it, save it.

>>> from radbo.config import RunConfig
>>> cfg = RunConfig(rounds=2, eval_every=1)        # doctest: +SKIP
>>> result = radbo.run(cfg, progress=False)        # doctest: +SKIP
>>> result.final["test_accuracy"]                  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from radbo.algorithms.fedmbo import FedMBO
from radbo.algorithms.fedmsa import FedMSA
from radbo.algorithms.rabo import RABO
from radbo.algorithms.shrofbo import ShroFBO
from radbo.algorithms.simfbo import SimFBO
from radbo.checkpoint import CheckpointError, atomic_write_text, load_checkpoint, save_checkpoint
from radbo.config import (
    CGEstimator,
    CIFAR10Data,
    CNN7Model,
    CNNModel,
    ConfigError,
    DigitsData,
    DirichletPartition,
    FeatureL2Task,
    FedMBOConfig,
    FedMSAConfig,
    FiniteDifferenceEstimator,
    FirstOrderEstimator,
    IIDPartition,
    LogisticModel,
    MLPModel,
    MNISTData,
    NeumannEstimator,
    RABOConfig,
    ResNet12Model,
    ResNet18Model,
    RunConfig,
    ShardsPartition,
    SimFBOConfig,
    VSLossTask,
    VSMLPModel,
)
from radbo.cost import LedgerEntry, as_dicts, savings, totals, totals_by_tier
from radbo.data import (
    Dataset,
    load_cifar10,
    load_digits,
    load_mnist,
    long_tail_subset,
    partition_dirichlet,
    partition_iid,
    partition_shards,
    split_indices,
    stratified_subset,
    train_test_split,
)
from radbo.devices import Fleet
from radbo.devices.budget import Budget, BudgetPlanner, DeviceTooSmallError
from radbo.hypergrad import (
    AutogradProducts,
    FiniteDifference,
    FiniteDifferenceProducts,
    FirstOrder,
    HypergradEstimator,
    ImplicitCG,
    Neumann,
)
from radbo.masks.assigner import SubmodelAssigner
from radbo.masks.policies import (
    CoveragePolicy,
    ImportancePolicy,
    LeadingPolicy,
    MaskPolicy,
    RandomPolicy,
    RollingPolicy,
)
from radbo.masks.structure import StructurePlan
from radbo.models import (
    CNN7,
    MLP,
    VSMLP,
    BilevelModel,
    FeatureL2Logistic,
    ResNet12,
    ResNet18,
    SmallCNN,
)
from radbo.problem import ClientData, forward
from radbo.simulation.engine import (
    Backend,
    ClientBudget,
    ClientRuntime,
    Simulation,
    derive_seed,
)
from radbo.simulation.schedules import UniformLocalSteps
from radbo.tasks import FeatureL2, HyperRepresentation, VSLoss
from radbo.typing import Params

# Stream identifiers for derive_seed: each random choice of a run has its own stream.
_SPLIT, _PARTITION, _INIT, _CLIENT_SPLIT, _FLEET, _CALIBRATION = 11, 12, 13, 14, 15, 16
_SUBSET = 17  # limit_train / limit_test: derive_seed(seed, _SUBSET, 0 for train, 1 for test)
_ALGORITHM = 18  # an algorithm's own draws (FedMBO's Neumann truncations)
_LONG_TAIL = 19  # data.imbalance: which training examples a long-tailed training set keeps
#: Model configs whose models take flat vectors (they flatten any input themselves).
_FLAT_MODELS = (MLPModel, LogisticModel, VSMLPModel)
# Test examples per forward pass of the evaluator (bounds its memory on large test sets).
_EVAL_BATCH = 1024


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
    fleet: Fleet | None = None
    device_budgets: list[Budget] | None = None
    planner: BudgetPlanner | None = None


@dataclass
class RunResult:
    """Outcome of :func:`run`.

    Attributes:
        rounds: per-round metrics (``RoundRecord.as_dict``).
        final: the last evaluation (``test_accuracy``, ``test_loss``).
        state: the final algorithm state.
        totals: run totals (FLOPs, bytes, simulated time, communication rounds, ...).
        totals_by_tier: the same counters per device tier.
        ledger: one row per client, phase and round.
        baseline: the paired full-model run's result (when ``baseline.enabled``).
        savings: this run's compute, bytes and simulated time as fractions of the baseline's.
    """

    config: RunConfig
    rounds: list[dict[str, Any]]
    final: dict[str, float]
    state: Any
    output_dir: Path | None = None
    totals: dict[str, float] = field(default_factory=dict)
    totals_by_tier: dict[str, dict[str, float]] = field(default_factory=dict)
    ledger: list[dict[str, Any]] = field(default_factory=list)
    baseline: RunResult | None = None
    savings: dict[str, float] | None = None


def load_data(config: RunConfig) -> tuple[Dataset, Dataset]:
    """Training and test set of the configured data, shaped for the configured model: flat
    vectors for ``mlp``, ``logistic`` and ``vs_mlp``, images ``(C, H, W)`` for every other
    model.

    ``digits`` is split by ``test_fraction`` (stratified, from the run seed); ``mnist`` and
    ``cifar10`` use their official splits, cut to ``limit_train`` / ``limit_test`` examples by
    :func:`radbo.data.stratified_subset` (from the run seed). Then ``imbalance > 1`` makes the
    training set long-tailed (:func:`radbo.data.long_tail_subset`, from the run seed); the
    test set stays as it is. A missing or unreadable data file is a :class:`ConfigError`
    naming ``data.root``.
    """
    dc = config.data
    flat = isinstance(config.model, _FLAT_MODELS)
    if isinstance(dc, DigitsData):
        data = load_digits(flatten=flat)
        split_gen = torch.Generator().manual_seed(derive_seed(config.seed, _SPLIT))
        train, test = train_test_split(data, dc.test_fraction, split_gen)
        return _long_tail(config, train), test
    try:
        if isinstance(dc, MNISTData):
            train = load_mnist(dc.root, train=True, flatten=flat)
            test = load_mnist(dc.root, train=False, flatten=flat)
        elif isinstance(dc, CIFAR10Data):
            train = load_cifar10(dc.root, train=True)
            test = load_cifar10(dc.root, train=False)
        else:  # pragma: no cover
            raise TypeError(f"unsupported data config {dc!r}")
    except (OSError, ValueError) as err:  # FileNotFoundError, corrupt or truncated files
        raise ConfigError(f"config error: data.root = {dc.root!r}: {err}") from None
    parts = []
    for i, (split, limit) in enumerate(((train, dc.limit_train), (test, dc.limit_test))):
        if len(split) == 0:
            raise ConfigError(f"config error: data.root = {dc.root!r}: {split.name} is empty")
        if flat and split.features.ndim > 2:
            split = Dataset(split.features.flatten(1), split.labels, split.num_classes, split.name)
        if limit is not None:
            gen = torch.Generator().manual_seed(derive_seed(config.seed, _SUBSET, i))
            split = stratified_subset(split, limit, gen)
        parts.append(split)
    return _long_tail(config, parts[0]), parts[1]


def _long_tail(config: RunConfig, train: Dataset) -> Dataset:
    """``train`` made long-tailed as ``data.imbalance`` asks (itself when it is 1)."""
    if config.data.imbalance == 1:
        return train
    gen = torch.Generator().manual_seed(derive_seed(config.seed, _LONG_TAIL))
    return long_tail_subset(train, config.data.imbalance, gen)


#: Smallest image side each convolutional model takes: CNN7 (two valid 5x5 convs and two 2x2
#: pools) and ResNet12 (four 2x2 pools) need 16; ResNet18's three stride-2 stages must leave its
#: last stage at least 2x2, or its BatchNorm fails on a training batch of one example.
_MIN_IMAGE_SIZE = {"cnn": 1, "cnn7": 16, "resnet12": 16, "resnet18": 9}


def build_model(config: RunConfig, input_shape: tuple[int, ...], classes: int) -> BilevelModel:
    """The configured model for inputs of ``input_shape`` (one example) and ``classes``
    outputs, initialised from the run seed (global RNG state is restored).

    ``mlp`` flattens inputs of any shape; the convolutional models need images ``(C, S, S)``
    of at least ``_MIN_IMAGE_SIZE`` pixels a side, or raise :class:`ConfigError`.
    """
    mc = config.model
    flat = isinstance(mc, _FLAT_MODELS)
    image = None if flat else _image_shape(config, input_shape)
    with torch.random.fork_rng():
        torch.manual_seed(derive_seed(config.seed, _INIT))
        try:
            return _make_model(mc, input_shape, image, classes)
        except ValueError as err:  # sizes the model cannot take
            raise ConfigError(
                f"config error: model.name = {mc.name!r}: cannot take {config.data.name} inputs "
                f"of shape {tuple(input_shape)}: {err}"
            ) from None


def _make_model(
    mc: Any, input_shape: tuple[int, ...], image: tuple[int, int] | None, classes: int
) -> BilevelModel:
    if isinstance(mc, MLPModel):
        return MLP(math.prod(input_shape), mc.hidden, classes)
    if isinstance(mc, LogisticModel):
        return FeatureL2Logistic(math.prod(input_shape), classes, mc.init_log_l2)
    if isinstance(mc, VSMLPModel):
        return VSMLP(math.prod(input_shape), mc.hidden, classes)
    assert image is not None
    channels, size = image
    if isinstance(mc, CNNModel):
        return SmallCNN(channels, size, mc.channels, classes)
    if isinstance(mc, CNN7Model):
        return CNN7(classes, channels, size, mc.channels, mc.hidden)
    if isinstance(mc, ResNet12Model):
        return ResNet12(classes, channels, size, mc.widths)
    if isinstance(mc, ResNet18Model):
        return ResNet18(classes, channels, size, mc.widths)
    raise TypeError(f"unsupported model config {mc!r}")  # pragma: no cover


def _image_shape(config: RunConfig, input_shape: tuple[int, ...]) -> tuple[int, int]:
    """(channels, side) of square images ``(C, S, S)`` large enough for the model."""
    name = config.model.name
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ConfigError(
            f"config error: model.name = {name!r}: needs square images (C, S, S), but "
            f"{config.data.name} gives inputs of shape {tuple(input_shape)}; use mlp"
        )
    channels, size = input_shape[0], input_shape[2]
    least = _MIN_IMAGE_SIZE[name]
    if size < least:
        raise ConfigError(
            f"config error: model.name = {name!r}: needs images of at least {least}x{least}, "
            f"but {config.data.name} gives {channels}x{size}x{size}; use a larger data set or "
            "another model"
        )
    return channels, size


def build_task(
    config: RunConfig, train: Dataset | None = None
) -> HyperRepresentation | FeatureL2 | VSLoss:
    """The configured bilevel task (its inner and outer losses).

    ``vs_loss`` needs the training set ``train``: its outer loss weights each class by the
    inverse of its frequency there (:func:`radbo.tasks.balanced_class_weights`).
    """
    if isinstance(config.task, FeatureL2Task):
        return FeatureL2(inner_l2=config.task.inner_l2)
    if isinstance(config.task, VSLossTask):
        if train is None:
            raise ValueError("build_task: task vs_loss needs the training set (train=...)")
        return VSLoss.balanced(train.labels, train.num_classes, inner_l2=config.task.inner_l2)
    return HyperRepresentation(inner_l2=config.task.inner_l2)


def build_estimator(config: RunConfig) -> HypergradEstimator:
    """The configured hypergradient estimator."""
    est = config.estimator
    if isinstance(est, CGEstimator):
        return ImplicitCG(max_iter=est.max_iter, tol=est.tol, damping=est.damping)
    if isinstance(est, NeumannEstimator):
        return Neumann(terms=est.terms, eta=est.eta)
    if isinstance(est, FiniteDifferenceEstimator):
        return FiniteDifference(
            num_coordinates=est.num_coordinates,
            fraction=est.fraction,
            mu=est.mu,
            hvp_mu=est.hvp_mu,
            cg_iters=est.cg_iters,
            tol=est.tol,
            damping=est.damping,
            as_printed=est.as_printed,
            rescale=est.rescale,
        )
    if isinstance(est, FirstOrderEstimator):
        return FirstOrder(lam=est.lam, inner_steps=est.inner_steps, lr=est.lr)
    raise TypeError(f"unsupported estimator config {est!r}")  # pragma: no cover


def build_algorithm(
    config: RunConfig, outer: list[str], inner: list[str], buffers: list[str]
) -> RABO | SimFBO | FedMBO | FedMSA:
    """The configured algorithm (RABO / RAFBO, SimFBO, ShroFBO, FedMBO or FedMSA)."""
    algo = config.algorithm
    names = {
        "outer_names": tuple(outer),
        "inner_names": tuple(inner),
        "buffer_names": tuple(buffers),
    }
    if isinstance(algo, RABOConfig):
        return RABO(
            **names,
            inner_lr=algo.inner_lr,
            outer_lr=algo.outer_lr,
            inner_steps=algo.inner_steps,
            batch_size=algo.batch_size,
            outer_batch_size=algo.outer_batch_size,
            estimator=build_estimator(config),
            max_hypergrad_norm=algo.max_hypergrad_norm,
            use_budget_steps=config.fleet.local_steps != "fixed",
            aggregate_buffers=not static_batchnorm(config),
            name=algo.name,
        )
    if isinstance(algo, SimFBOConfig):
        cls = ShroFBO if algo.name == "shrofbo" else SimFBO
        products = (
            FiniteDifferenceProducts(mu=algo.fd_mu)
            if algo.products == "finite_difference"
            else AutogradProducts()
        )
        return cls(
            **names,
            inner_lr=algo.inner_lr,
            v_lr=algo.v_lr,
            outer_lr=algo.outer_lr,
            server_lr_y=algo.server_lr_y,
            server_lr_v=algo.server_lr_v,
            server_lr_x=algo.server_lr_x,
            radius=algo.radius,
            coefficient=algo.coefficient,
            batch_size=algo.batch_size,
            outer_batch_size=algo.outer_batch_size,
            products=products,
            penalty=algo.penalty if algo.products == "first_order" else None,
            aggregate_buffers=not static_batchnorm(config),
        )
    if isinstance(algo, FedMBOConfig):
        return FedMBO(
            **names,
            inner_lr=algo.inner_lr,
            outer_lr=algo.outer_lr,
            inner_steps=algo.inner_steps,
            batch_size=algo.batch_size,
            outer_batch_size=algo.outer_batch_size,
            neumann_terms=algo.neumann_terms,
            eta=algo.eta,
            clients_per_phase=algo.clients_per_phase,
            max_hypergrad_norm=algo.max_hypergrad_norm,
            seed=derive_seed(config.seed, _ALGORITHM),
            aggregate_buffers=not static_batchnorm(config),
        )
    if isinstance(algo, FedMSAConfig):
        return FedMSA(
            **names,
            outer_lr=algo.outer_lr,
            inner_lr=algo.inner_lr,
            v_lr=algo.v_lr,
            momentum=algo.momentum,
            local_steps=algo.local_steps,
            batch_size=algo.batch_size,
            outer_batch_size=algo.outer_batch_size,
            aggregate_buffers=not static_batchnorm(config),
        )
    raise TypeError(f"unsupported algorithm config {algo!r}")  # pragma: no cover


def fixed_local_steps(config: RunConfig) -> int:
    """T (RABO, FedMBO) or tau / K (SimFBO, ShroFBO, FedMSA) when every client runs the same
    number of steps."""
    algo = config.algorithm
    return algo.inner_steps if isinstance(algo, RABOConfig | FedMBOConfig) else algo.local_steps


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
    model: BilevelModel,
    test: Dataset,
    outer_names: list[str],
    inner_names: list[str],
    calibration: torch.Tensor | None = None,
) -> Callable[[Params], dict[str, float]]:
    """Accuracy, balanced accuracy (mean per-class recall) and cross-entropy of the global
    model on the held-out test set.

    With ``calibration`` inputs (static BatchNorm), the BatchNorm running statistics are first
    recomputed from scratch over them (cumulative average, in training mode) for the model
    being evaluated, and the state's own statistics are ignored.
    """
    module = model
    outer, inner = set(outer_names), set(inner_names)

    def evaluate(state: Params) -> dict[str, float]:
        was_training = module.training
        try:
            with torch.no_grad():
                x = {k: v for k, v in state.items() if k in outer}
                y = {k: v for k, v in state.items() if k in inner}
                b = {k: v.clone() for k, v in state.items() if k not in outer and k not in inner}
                if calibration is not None:
                    b = calibrate_batchnorm(module, x, y, b, calibration)
                module.eval()
                logits = torch.cat(
                    [forward(module, x, y, b, part) for part in test.features.split(_EVAL_BATCH)]
                )
                loss = F.cross_entropy(logits, test.labels)
                hit = (logits.argmax(1) == test.labels).float()
                acc = hit.mean()
                # mean per-class recall over the classes present: the figure of merit on
                # long-tailed training data (task vs_loss), equal to acc on balanced test sets
                counts = torch.bincount(test.labels, minlength=test.num_classes).float()
                hits = torch.bincount(test.labels, weights=hit, minlength=test.num_classes)
                present = counts > 0
                balanced = (hits[present] / counts[present]).mean()
        finally:
            module.train(was_training)
        return {"accuracy": float(acc), "loss": float(loss), "balanced_accuracy": float(balanced)}

    return evaluate


def calibrate_batchnorm(
    module: nn.Module, x: Params, y: Params, buffers: Params, inputs: torch.Tensor
) -> Params:
    """Static BN: BatchNorm statistics of (x, y) recomputed over ``inputs`` (one pass, exact
    cumulative mean and variance via ``momentum = None``); returns the new buffers."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in bns]
    fresh = {
        k: (torch.zeros_like(v) if not k.endswith("running_var") else torch.ones_like(v))
        for k, v in buffers.items()
    }
    try:
        for m in bns:
            m.momentum = None
        module.train()
        forward(module, x, y, fresh, inputs)
    finally:
        for m, momentum in zip(bns, momenta, strict=True):
            m.momentum = momentum
    return fresh


#: Model configs of models with BatchNorm layers: they have ``batchnorm`` and
#: ``calibration_samples``.
_BATCHNORM_MODELS = (CNNModel, ResNet12Model, ResNet18Model)


def static_batchnorm(config: RunConfig) -> bool:
    """Whether the model's BatchNorm layers use static BN (sBN; see :class:`CNNModel`)."""
    return isinstance(config.model, _BATCHNORM_MODELS) and config.model.batchnorm == "static"


def calibration_inputs(config: RunConfig, train: Dataset) -> torch.Tensor | None:
    """The server's calibration set for static BN: the first ``calibration_samples`` of a
    seeded permutation of the training set (None without static BN)."""
    mc = config.model
    if not static_batchnorm(config) or not isinstance(mc, _BATCHNORM_MODELS):
        return None
    gen = torch.Generator().manual_seed(derive_seed(config.seed, _CALIBRATION))
    pick = torch.randperm(len(train), generator=gen)[: mc.calibration_samples]
    return train.features[pick]


def build_policy(config: RunConfig) -> MaskPolicy:
    """The configured mask policy."""
    mc = config.mask
    if mc.policy == "importance":
        return ImportancePolicy()
    if mc.policy == "leading":
        return LeadingPolicy()
    if mc.policy == "rolling":
        return RollingPolicy(stride=mc.rolling_stride)
    if mc.policy == "random":
        return RandomPolicy()
    if mc.policy == "coverage":
        per_round = config.fleet.clients_per_round or config.fleet.num_clients
        if mc.coverage_k > per_round:
            raise ConfigError(
                f"config error: mask.coverage_k = {mc.coverage_k}: needs at least that many "
                f"clients per round, the fleet samples {per_round}"
            )
        return CoveragePolicy(k=mc.coverage_k, num_clients=per_round)
    raise ConfigError(f"config error: mask.policy = {mc.policy!r}: no policy to build")


def build_fleet(config: RunConfig) -> Fleet | None:
    """The configured device fleet (tier mix, fleet file or trace), or ``None``."""
    fc = config.fleet
    try:
        if fc.devices is not None:
            seed = derive_seed(config.seed, _FLEET)
            fleet = Fleet.from_tiers(fc.devices, fc.num_clients, seed)
        elif fc.file is not None:
            fleet = Fleet.from_file(fc.file)
        elif fc.trace is not None:
            fleet = Fleet.from_trace(
                fc.trace.path,
                flops_per_sample=fc.trace.flops_per_sample,
                memory_bytes=fc.trace.memory_bytes,
                availability=fc.trace.availability,
            )
        else:
            return None
    except ValueError as err:  # includes ProfileError: bad device ids, fleet or trace files
        source = next(k for k in ("devices", "file", "trace") if getattr(fc, k) is not None)
        raise ConfigError(f"config error: fleet.{source}: {err}") from None
    if len(fleet) != fc.num_clients:
        raise ConfigError(
            f"config error: fleet.num_clients = {fc.num_clients}: the fleet has "
            f"{len(fleet)} devices; make them equal"
        )
    return fleet


def budget_planner(config: RunConfig, model: BilevelModel, plan: StructurePlan) -> BudgetPlanner:
    """Memory / FLOP / bytes model of the configured model at each capacity level."""
    return BudgetPlanner(
        plan,
        config.algorithm.batch_size,
        levels=tuple(config.fleet.capacity_levels),
        hypergradient="implicit",
        inner_names=model.inner_param_names(),
    )


def build(config: RunConfig) -> Experiment:
    """Build data, model, fleet, masks, algorithm and the simulation for ``config``."""
    train, test = load_data(config)
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

    fleet = build_fleet(config)
    masked = config.mask.policy != "none"
    plan: StructurePlan | None = None
    if masked or fleet is not None:
        plan = StructurePlan(model, model.example_input(1), output_layers=model.output_layers)
    device_budgets: list[Budget] | None = None
    planner: BudgetPlanner | None = None
    if fleet is not None and plan is not None:
        planner = budget_planner(config, model, plan)
        device_budgets = [
            planner.budget(p, config.fleet.deadline_s, allow_oversize=True) for p in fleet
        ]
    assigner: SubmodelAssigner | None = None
    if masked and plan is not None:
        policy = build_policy(config)
        assigner = SubmodelAssigner(
            plan, policy, outer_names, mask_x=config.mask.mask_x, mask_y=config.mask.mask_y
        )

    algorithm = build_algorithm(config, outer_names, inner_names, buffer_names)
    budgets = client_budgets(config, fleet, device_budgets)
    weights = None
    if config.algorithm.weighting == "data_size":
        weights = [float(c.inner.numel()) for c in clients]
    runtime = ClientRuntime(
        problem=build_task(config, train),
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
        evaluate=make_evaluator(
            model, test, outer_names, inner_names, calibration=calibration_inputs(config, train)
        ),
        eval_every=config.eval_every,
        profiles=None if fleet is None else list(fleet),
        coverage={"x": outer_names, "y": inner_names},
        dropout=[config.fleet.dropout] * len(clients) if config.fleet.dropout > 0 else None,
        overcommit=config.fleet.overcommit,
        phase_deadline_s=config.fleet.phase_deadline_s,
        local_steps=(
            UniformLocalSteps(
                *config.fleet.local_steps_range,
                per_round=config.fleet.local_steps == "uniform_per_round",
            )
            if config.fleet.local_steps in ("uniform", "uniform_per_round")
            else None
        ),
    )
    initial = algorithm.init(
        {n: state[n] for n in outer_names},
        {n: state[n] for n in inner_names},
        {n: state[n] for n in buffer_names},
    )
    return Experiment(
        config, model, simulation, initial, train, test, clients, fleet, device_budgets, planner
    )


def client_budgets(
    config: RunConfig, fleet: Fleet | None, device_budgets: list[Budget] | None
) -> list[ClientBudget]:
    """Capacity and local steps of every client: explicit ``fleet.capacities`` first (cycled
    list, or by device tier), then the device's memory budget (masked runs only), else the full
    model."""
    fc, steps = config.fleet, fixed_local_steps(config)
    caps = fc.capacities
    tiers = None if fleet is None else fleet.tiers()
    if isinstance(caps, dict) and tiers is not None:
        missing = sorted(set(tiers) - set(caps))
        if missing:
            raise ConfigError(
                f"config error: fleet.capacities = {caps}: no capacity for device tier(s) "
                f"{missing}; add them (tiers in this fleet: {sorted(set(tiers))})"
            )
    out = []
    for i in range(fc.num_clients):
        device = None if device_budgets is None else device_budgets[i]
        if isinstance(caps, dict) and tiers is not None:
            capacity = caps[tiers[i]]
        elif isinstance(caps, list):
            capacity = caps[i % len(caps)]
        elif device is not None and config.mask.policy != "none":
            if not device.memory_fits:
                raise DeviceTooSmallError(
                    f"client {i}: device cannot train even the smallest submodel "
                    f"(r = {device.capacity:g} needs {device.memory.total} bytes); "
                    "remove it from the fleet, add smaller capacity_levels or use a smaller model"
                )
            capacity = device.capacity
        else:
            capacity = 1.0
        local = device.local_steps if device is not None and fc.local_steps == "budget" else steps
        out.append(ClientBudget(capacity=capacity, local_steps=local))
    return out


def fleet_table(config: RunConfig) -> list[dict[str, Any]]:
    """Per client: device, tier, capacity r and local steps τ as the run will use them, the
    r the device's memory budget would allow, training memory at r against the device's
    memory, availability and the expected round time at (r, τ) (what ``radbo fleet`` prints).
    """
    exp = build(config)
    rows = []
    for i, budget in enumerate(exp.simulation.budgets):
        row: dict[str, Any] = {
            "client": i,
            "device": "-",
            "tier": "-",
            "capacity": budget.capacity,
            "local_steps": budget.local_steps,
        }
        if exp.fleet is not None and exp.device_budgets is not None and exp.planner is not None:
            profile = exp.fleet[i]
            actual = exp.planner.at(profile, budget.capacity, budget.local_steps)
            row.update(
                device=profile.name,
                tier=profile.tier or profile.name,
                budget_capacity=exp.device_budgets[i].capacity,
                memory_mb=actual.memory.total / 1e6,
                device_memory_mb=profile.memory_bytes / 1e6,
                memory_fits=actual.memory_fits,
                availability=profile.availability,
                round_time_s=actual.round_time_s,
            )
        rows.append(row)
    return rows


def baseline_config(config: RunConfig) -> RunConfig:
    """The paired full-model run of ``config`` (see :class:`BaselineConfig`).

    ``fedmbo_style``: RABO's two-phase round with every client on the full model and a
    truncated Neumann hypergradient. ``fedmbo``: FedMBO with the run's T, step sizes, batch
    sizes and clipping. A SimFBO/ShroFBO/FedMSA config gives its tau (K) as T.
    """
    data = config.model_dump()
    algo = config.algorithm
    common = {
        "inner_lr": algo.inner_lr,
        "outer_lr": algo.outer_lr,
        "inner_steps": getattr(algo, "inner_steps", getattr(algo, "local_steps", 5)),
        "batch_size": algo.batch_size,
        "outer_batch_size": algo.outer_batch_size,
        "weighting": algo.weighting,
    }
    clip = getattr(algo, "max_hypergrad_norm", None)
    if config.baseline.algorithm == "fedmbo":
        data["algorithm"] = {
            "name": "fedmbo",
            **common,
            "neumann_terms": config.baseline.terms,
            "eta": config.baseline.eta,
            "clients_per_phase": config.baseline.clients_per_phase,
            "max_hypergrad_norm": clip,
        }
    elif isinstance(algo, RABOConfig):
        data["algorithm"] = {**data["algorithm"], "name": "rabo"}
    else:
        data["algorithm"] = {"name": "rabo", **common, "max_hypergrad_norm": clip}
    data["mask"] = {**data["mask"], "policy": "none"}
    data["fleet"] = {**data["fleet"], "capacities": [1.0], "local_steps": "fixed"}
    data["estimator"] = {
        "name": "neumann",
        "terms": config.baseline.terms,
        "eta": config.baseline.eta,
    }
    data["baseline"] = {"enabled": False}
    return RunConfig.model_validate(data)


def run(
    config: RunConfig,
    *,
    progress: bool = True,
    output_dir: str | Path | None = None,
    save: bool = True,
    resume: bool = False,
    backend_factory: Callable[[RunConfig], Backend] | None = None,
) -> RunResult:
    """Run ``config`` end to end (and its full-model baseline when ``baseline.enabled``).

    With ``save`` writes ``results.json``, ``ledger.json`` and ``accuracy.png`` to
    ``output_dir`` (default ``config.output_dir``).

    With ``config.checkpoint_every = N`` a checkpoint (safetensors + JSON, atomic) is written
    to ``<output_dir>/checkpoints/run`` (``.../baseline`` for the baseline) every N rounds and
    after the last. ``resume=True`` continues from those checkpoints when they exist (else it
    starts afresh): the result is the same as an uninterrupted run's, number for number. The
    stored config must match ``config`` except ``rounds``, which may grow (``output_dir`` and
    ``checkpoint_every`` may differ too). One caveat when extending a finished run: its last
    round was evaluated even if ``eval_every`` does not divide it, so the extended
    ``results.json`` has one more evaluation row than a run made at the new length at once.

    ``backend_factory(run_config)``, when given, makes the backend that runs the client work of
    each run (the main run and its baseline; e.g. :class:`radbo.flower.FlowerBackend`) in
    place of the simulation's default sequential backend.
    """
    out = Path(output_dir if output_dir is not None else config.output_dir)
    checkpoints = out / "checkpoints"
    result = _run_once(
        config,
        progress=progress,
        desc="radbo",
        checkpoints=checkpoints / "run",
        resume=resume,
        backend_factory=backend_factory,
    )
    if config.baseline.enabled:
        base = _run_once(
            baseline_config(config),
            progress=progress,
            desc="baseline",
            checkpoints=checkpoints / "baseline",
            resume=resume,
            backend_factory=backend_factory,
        )
        result.baseline = base
        result.savings = savings(result.totals, base.totals)
    if save:
        save_results(result, out)
        result.output_dir = out
    return result


# config keys a resumed run may change: the target length, where it writes, how often
_RESUMABLE = ("rounds", "output_dir", "checkpoint_every")


def _run_once(
    config: RunConfig,
    *,
    progress: bool,
    desc: str,
    checkpoints: Path | None = None,
    resume: bool = False,
    backend_factory: Callable[[RunConfig], Backend] | None = None,
) -> RunResult:
    exp = build(config)
    sim = exp.simulation
    if backend_factory is not None:
        sim.backend = backend_factory(config)
    config_data = config.model_dump(mode="json")
    state, clock_s, done = exp.initial_state, 0.0, 0
    rows: list[dict[str, Any]] = []
    ledger: list[dict[str, Any]] = []
    if resume and checkpoints is not None and (checkpoints / "checkpoint.json").is_file():
        ckpt = load_checkpoint(
            checkpoints, template=exp.initial_state, config=config_data, ignore=_RESUMABLE
        )
        if ckpt.rounds_done > config.rounds:
            raise CheckpointError(
                f"the checkpoint in {checkpoints} is after round {ckpt.rounds_done}, past "
                f"rounds = {config.rounds}; raise rounds to continue it"
            )
        state, clock_s, done = ckpt.state, ckpt.clock_s, ckpt.rounds_done
        rows, ledger = ckpt.rows, ckpt.ledger
        sim.load_state_dict(ckpt.sim_tensors, ckpt.sim_meta)
    every = config.checkpoint_every
    bar = tqdm(total=config.rounds, initial=done, desc=desc, unit="round", disable=not progress)
    last_eval = _last_evaluation(rows)
    try:
        start = state
        for state, record in sim.iterate(start, config.rounds - done, done, clock_s):  # noqa: B007
            rows.append(record.as_dict())
            ledger += as_dicts(record.ledger)
            if record.evaluation is not None:
                last_eval = record.evaluation
            completed = record.round + 1
            if every is not None and checkpoints is not None:
                if completed % every == 0 or completed == config.rounds:
                    sim_tensors, sim_meta = sim.state_dict()
                    save_checkpoint(
                        checkpoints,
                        config=config_data,
                        state=state,
                        rounds_done=completed,
                        clock_s=record.clock_s,
                        rows=rows,
                        ledger=ledger,
                        sim_tensors=sim_tensors,
                        sim_meta=sim_meta,
                    )
            bar.update(1)
            postfix = {"outer": f"{record.metrics.get('outer_loss', float('nan')):.3f}"}
            if last_eval:
                postfix["acc"] = f"{last_eval['accuracy']:.3f}"
            bar.set_postfix(postfix)
    finally:
        bar.close()
    entries = [LedgerEntry(**row) for row in ledger]
    run_totals = totals(entries)
    run_totals["communication_rounds"] = sum(r["communication_rounds"] for r in rows)
    run_totals["sim_time_s"] = rows[-1]["sim_clock_s"] if rows else 0.0
    run_totals["client_rounds"] = sum(len(r["clients"]) for r in rows)
    run_totals["unavailable_client_rounds"] = sum(len(r["unavailable"]) for r in rows)
    run_totals["rejected_updates"] = sum(len(c) for r in rows for c in r["rejected"].values())
    run_totals["dropped_client_rounds"] = sum(
        len(c) for r in rows for c in r.get("dropped", {}).values()
    )
    run_totals["late_results"] = sum(len(c) for r in rows for c in r.get("late", {}).values())
    run_totals["empty_rounds"] = sum(1 for r in rows if not r["clients"])
    meter = sim.flop_meter
    run_totals["flop_measurements"] = 0 if meter is None else meter.measurements
    return RunResult(
        config=config,
        rounds=rows,
        final={f"test_{k}": v for k, v in last_eval.items()},
        state=state,
        totals=run_totals,
        totals_by_tier=totals_by_tier(entries),
        ledger=ledger,
    )


def _last_evaluation(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The metrics of the last evaluated round among ``rows`` (``test_`` prefix removed)."""
    for row in reversed(rows):
        evaluation = {k[5:]: v for k, v in row.items() if k.startswith("test_")}
        if evaluation:
            return evaluation
    return {}


def _summary(result: RunResult) -> dict[str, Any]:
    return {"final": result.final, "totals": result.totals, "totals_by_tier": result.totals_by_tier}


def save_results(result: RunResult, out: Path) -> None:
    """``results.json`` (config, final, totals, totals per tier, per-round metrics, baseline
    and savings), ``ledger.json`` (one row per client, phase and round) and ``accuracy.png``."""
    payload: dict[str, Any] = {
        "radbo_version": _version(),
        "config": result.config.model_dump(mode="json"),
        **_summary(result),
        "rounds": result.rounds,
    }
    if result.baseline is not None:
        payload["baseline"] = {
            "config": result.baseline.config.model_dump(mode="json"),
            **_summary(result.baseline),
        }
        payload["savings"] = result.savings
    atomic_write_text(out / "results.json", json.dumps(payload, indent=2, allow_nan=True))
    atomic_write_text(out / "ledger.json", json.dumps(result.ledger, allow_nan=True))
    from radbo.report import plot_accuracy

    plot_accuracy(result.rounds, out / "accuracy.png", title=f"{result.config.algorithm.name}")


def _version() -> str:
    from radbo import __version__

    return __version__
