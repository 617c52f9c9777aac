"""Building a run from its config: data, model, task, fleet, masks, algorithm, simulation.

:func:`build` wires the parts each config section builds (``config.data.load``,
``build_fleet(config.fleet, ...)``, ``build_policy(config.mask, ...)``, ...) and the client
side :mod:`radbo.experiment.clientside` builds (model, algorithm, runtime; the same build a
Flower node makes) into a :class:`~radbo.simulation.Simulation` and its initial state, one
named step after the other; :func:`fleet_table` shows what the fleet will do. Every error a
user's config can cause here is a :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from radbo.client import Backend, ClientBudget
from radbo.config import ConfigError, FleetConfig, MaskConfig, RunConfig, RuntimeConfig
from radbo.data import Dataset
from radbo.data.partition import FleetTooLargeError, IndexParts, split_parts
from radbo.devices import Fleet
from radbo.devices.budget import Budget, BudgetPlanner, DeviceTooSmallError
from radbo.experiment.clientside import (
    RUN_DTYPES,
    ClientModel,
    ClientSide,
    build_algorithm,
    build_model,
    build_task,
    client_model,
    client_side,
)
from radbo.experiment.evaluation import calibration_inputs, make_evaluator
from radbo.limits import MAX_BUDGET_STEPS, caps_are_lifted
from radbo.masks.assigner import SubmodelAssigner
from radbo.masks.policies import POLICIES, MaskPolicy
from radbo.masks.structure import StructurePlan
from radbo.models import BilevelModel
from radbo.problem import ClientData, Sampler
from radbo.randomness import Stream, derive_seed, generator
from radbo.simulation import BACKENDS, Simulation
from radbo.simulation.schedules import UniformLocalSteps, expected_local_steps
from radbo.typing import Params

__all__ = [
    "Experiment",
    "budget_planner",
    "build",
    "build_algorithm",
    "build_backend",
    "build_fleet",
    "build_model",
    "build_policy",
    "build_task",
    "ClientTable",
    "client_budgets",
    "client_sampler",
    "client_table",
    "examples_per_client",
    "fleet_size_error",
    "fleet_table",
    "load_data",
    "partition",
    "run_device",
    "training_data",
]


@dataclass
class Experiment:
    """Everything a run needs, built from a config: the simulation and its initial state."""

    config: RunConfig
    model: BilevelModel
    simulation: Simulation[Any]
    initial_state: Any
    train: Dataset
    test: Dataset
    clients: Sequence[ClientData]
    fleet: Fleet | None = None
    device_budgets: list[Budget] | None = None
    planner: BudgetPlanner | None = None
    #: ``sum_j p_j tau_j`` over the fleet, as wired into the algorithm (a node that builds its
    #: own client side, :mod:`radbo.flower.nodedata`, needs it to wire the same algorithm)
    population_steps: float | None = None
    #: the model, algorithm and runtime client work runs with (:mod:`radbo.experiment.clientside`)
    client_side: ClientSide = field(kw_only=True)


def load_data(config: RunConfig) -> tuple[Dataset, Dataset]:
    """Training and test set of the configured data, shaped for the configured model (flat
    vectors or images ``(C, H, W)``) and in the run's dtype. A missing or unreadable data file
    is a :class:`ConfigError` naming ``data.root``."""
    dc = config.data
    try:
        train, test = dc.load(config.seed, flat=config.model.flat)
    except (OSError, ValueError) as err:  # FileNotFoundError, corrupt or truncated files
        where = f"data.root = {dc.root!r}" if hasattr(dc, "root") else f"data.name = {dc.name!r}"
        raise ConfigError(f"config error: {where}: {err}") from None
    dtype = RUN_DTYPES[config.runtime.dtype]
    return _as(train, dtype), _as(test, dtype)


def _as(data: Dataset, dtype: torch.dtype) -> Dataset:
    if data.features.dtype == dtype:
        return data
    return Dataset(data.features.to(dtype), data.labels, data.num_classes, data.name)


def run_device(section: RuntimeConfig) -> torch.device:
    """The device ``[runtime] device`` names; a GPU this machine does not have is a
    :class:`ConfigError`."""
    device = torch.device(section.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f'config error: runtime.device = "{section.device}": no CUDA device is '
                'available to torch here (torch.cuda.is_available() is False); use "cpu"'
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f'config error: runtime.device = "{section.device}": this machine has '
                f"{count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    return device


def _on(data: Dataset, device: torch.device) -> Dataset:
    """``data`` with its features and labels on ``device`` (the same object on its own)."""
    if data.features.device == device and data.labels.device == device:
        return data
    return Dataset(data.features.to(device), data.labels.to(device), data.num_classes, data.name)


def partition(config: RunConfig, labels: torch.Tensor, min_size: int = 1) -> IndexParts:
    """Split training indices over clients as configured, at least ``min_size`` examples each
    (clients share examples when the data are too few and ``partition.allow_overlap`` is set;
    see :class:`radbo.data.PartitionConfig`)."""
    gen = generator(config.seed, Stream.PARTITION)
    return config.partition.partition(labels, config.fleet.num_clients, gen, min_size=min_size)


def examples_per_client(config: RunConfig) -> int:
    """The fewest training examples a client can work with: one inner and one outer example,
    or one for an episodic task (its support and query sets come from the same examples)."""
    return 1 if config.task.episodic else 2


def fleet_size_error(config: RunConfig, examples: int, limit: int) -> str:
    """The error for a fleet larger than the partition can serve without sharing examples:
    names the limit for this config and how to go past it."""
    n = config.fleet.num_clients
    if examples_per_client(config) == 1:
        each = "at least one sample each"
    else:
        each = "at least one sample each for their inner and one for their outer data"
    held_out = getattr(config.data, "test_fraction", None)
    after = "" if held_out is None else f" (after test_fraction = {held_out:g})"
    return (
        f"config error: fleet.num_clients = {n}: the {config.partition.kind} partition cannot "
        f"give {n} clients {each} from the {examples} training examples of "
        f"{config.data.name}{after}: at most {limit} clients fit; use num_clients <= {limit}, "
        "or set [partition] allow_overlap = true to let clients share examples"
    )


class ClientTable(Sequence[ClientData]):
    """Every client's inner and outer indices, packed (:class:`~radbo.data.partition.
    IndexParts`); client ``i``'s :class:`ClientData` is made when it is asked for. A fleet of
    100,000 clients thus holds two flat index tensors, not 200,000 small ones.

    >>> parts = IndexParts.pack([torch.tensor([0, 1]), torch.tensor([2, 3, 4])])
    >>> table = ClientTable(parts, IndexParts.pack([torch.tensor([5]), torch.tensor([6])]))
    >>> len(table), table[1].inner.tolist(), table[1].outer.tolist()
    (2, [2, 3, 4], [6])
    """

    def __init__(self, inner: IndexParts, outer: IndexParts) -> None:
        if len(inner) != len(outer):
            raise ValueError(f"got {len(inner)} inner but {len(outer)} outer index sets")
        empty = torch.nonzero((inner.sizes() == 0) | (outer.sizes() == 0)).flatten()
        if empty.numel():
            c = int(empty[0])
            raise ValueError(
                f"client {c}: a client needs at least one inner and one outer sample, got "
                f"{int(inner.sizes()[c])} inner and {int(outer.sizes()[c])} outer"
            )
        self.inner = inner
        self.outer = outer

    def __len__(self) -> int:
        return len(self.inner)

    @overload
    def __getitem__(self, index: int) -> ClientData: ...
    @overload
    def __getitem__(self, index: slice) -> list[ClientData]: ...
    def __getitem__(self, index: int | slice) -> ClientData | list[ClientData]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return ClientData(inner=self.inner[index], outer=self.outer[index])

    def __iter__(self) -> Iterator[ClientData]:
        for inner, outer in zip(self.inner, self.outer, strict=True):
            yield ClientData(inner=inner, outer=outer)


def client_table(config: RunConfig, parts: Sequence[torch.Tensor]) -> ClientTable:
    """Every client's inner and outer examples: ``parts`` split by ``data.outer_fraction``
    (:func:`radbo.data.partition.split_parts`: :func:`radbo.data.split_indices` on one client
    after the other, from the run's client-split stream), or each part as both for an
    episodic task."""
    packed = parts if isinstance(parts, IndexParts) else IndexParts.pack(parts)
    if config.task.episodic:  # support and query sets come from the same examples
        return ClientTable(packed, packed)
    client_gen = generator(config.seed, Stream.CLIENT_SPLIT)
    return ClientTable(*split_parts(packed, 1.0 - config.data.outer_fraction, client_gen))


def build_backend(section: RuntimeConfig) -> Backend:
    """The backend ``[runtime] backend`` names (:data:`radbo.simulation.BACKENDS`)."""
    return BACKENDS[section.backend].from_runtime(section)


def build_policy(section: MaskConfig, clients_per_round: int) -> MaskPolicy:
    """The ``[mask]`` policy of ``section`` for rounds of ``clients_per_round`` clients."""
    try:
        return POLICIES[section.policy](section, clients_per_round)
    except (KeyError, ValueError) as err:
        raise ConfigError(f"config error: mask.policy = {section.policy!r}: {err}") from None


def build_fleet(section: FleetConfig, seed: int) -> Fleet | None:
    """The device fleet of ``[fleet]`` (tier mix, fleet file or trace; a tier mix is drawn from
    the run ``seed``), or ``None``."""
    fc = section
    try:
        if fc.devices is not None:
            fleet_seed = derive_seed(seed, Stream.FLEET)
            fleet = Fleet.from_tiers(fc.devices, fc.num_clients, fleet_seed)
        elif fc.file is not None:
            fleet = Fleet.from_file(fc.file)
        elif fc.trace is not None:
            fleet = Fleet.from_trace(
                fc.trace.path,
                flops_per_sample=fc.trace.flops_per_sample,
                memory_bytes=fc.trace.memory_bytes,
                availability=fc.trace.availability,
                behavior=fc.trace.behavior,
            )
        else:
            return None
    except ValueError as err:  # includes ProfileError: bad device ids, fleet or trace files
        source = next(k for k in ("devices", "file", "trace") if getattr(fc, k) is not None)
        lines = str(err).splitlines() or [repr(err)]  # one line per problem, each named
        raise ConfigError("\n".join(f"config error: fleet.{source}: {x}" for x in lines)) from None
    if len(fleet) != fc.num_clients:
        raise ConfigError(
            f"config error: fleet.num_clients = {fc.num_clients}: the fleet has "
            f"{len(fleet)} devices; make them equal"
        )
    return fleet


def budget_planner(config: RunConfig, model: BilevelModel, plan: StructurePlan) -> BudgetPlanner:
    """Memory / FLOP / bytes model of the configured model at each capacity level, with the
    hypergradient buffers of the configured estimator."""
    estimator = config.estimator
    return BudgetPlanner(
        plan,
        config.algorithm.batch_size,
        levels=tuple(config.fleet.capacity_levels),
        hypergradient=estimator,
        inner_names=model.inner_param_names(),
    )


def build(config: RunConfig) -> Experiment:
    """Build data, model, fleet, masks, algorithm and the simulation for ``config``.

    Everything is built on the CPU (initial weights, partitions, structure plan, masks), then
    the model, the data and the initial state move to ``[runtime] device``. The client side
    (model, algorithm, runtime) is :mod:`radbo.experiment.clientside`'s, as on a Flower node."""
    device = run_device(config.runtime)
    train, test, clients = training_data(config)
    sampler = client_sampler(config, train, clients)
    fleet = build_fleet(config.fleet, config.seed)
    model = client_model(
        config,
        tuple(train.input_shape),
        config.task.num_outputs(train),
        structure=config.mask.masked or fleet is not None,
    )
    shapes = {n: t.shape for n, t in model.model.state_dict().items()}
    rounds = _rounds(config, model, clients, fleet)
    if device.type != "cpu":
        model.model.to(device)
        train, test = _on(train, device), _on(test, device)
    side = client_side(config, model, train, train.summary(), sampler, rounds.population_steps)
    evaluate = _evaluator(config, model, train, test)
    simulation = _simulation(config, side, clients, shapes, rounds, evaluate)
    return Experiment(
        config,
        model.model,
        simulation,
        _initial_state(side),
        train,
        test,
        clients,
        fleet,
        rounds.device_budgets,
        rounds.planner,
        rounds.population_steps,
        client_side=side,
    )


@dataclass(frozen=True)
class _Rounds:
    """What decides every round besides the algorithm: the fleet, its budget planner and
    device budgets, the mask assigner, each client's budget and aggregation weight, the drawn
    local-steps schedule and the population's mean local steps."""

    fleet: Fleet | None
    planner: BudgetPlanner | None
    device_budgets: list[Budget] | None
    assigner: SubmodelAssigner | None
    budgets: list[ClientBudget]
    weights: list[float] | None
    schedule: UniformLocalSteps | None
    population_steps: float


def _rounds(
    config: RunConfig, model: ClientModel, clients: ClientTable, fleet: Fleet | None
) -> _Rounds:
    """The :class:`_Rounds` of ``config`` for ``model``, ``clients`` and ``fleet``."""
    planner, device_budgets = _device_budgets(config, model, fleet)
    assigner = _assigner(config, model)
    budgets = client_budgets(config, fleet, device_budgets)
    weights = _weights(config, clients)
    schedule = _schedule(config.fleet)
    population_steps = _population_steps(config, budgets, weights, schedule)
    return _Rounds(
        fleet, planner, device_budgets, assigner, budgets, weights, schedule, population_steps
    )


def _simulation(
    config: RunConfig,
    side: ClientSide,
    clients: ClientTable,
    shapes: dict[str, torch.Size],
    rounds: _Rounds,
    evaluate: Callable[[Params], dict[str, float]],
) -> Simulation[Any]:
    """The simulation of ``config``: ``side``'s algorithm and runtime over ``clients``, as
    ``rounds`` decide, evaluated with ``evaluate``."""
    fc, fleet = config.fleet, rounds.fleet
    return Simulation(
        algorithm=side.algorithm,
        runtime=side.runtime,
        clients=clients,
        budgets=rounds.budgets,
        shapes=shapes,
        masks=rounds.assigner,
        backend=build_backend(config.runtime),
        seed=config.seed,
        clients_per_round=fc.clients_per_round,
        weights=rounds.weights,
        evaluate=evaluate,
        eval_every=config.eval_every,
        profiles=None if fleet is None else list(fleet),
        coverage={"x": side.model.outer, "y": side.model.inner},
        dropout=[fc.dropout] * len(clients) if fc.dropout > 0 else None,
        overcommit=fc.overcommit,
        phase_deadline_s=fc.phase_deadline_s,
        local_steps=rounds.schedule,
    )


def training_data(config: RunConfig) -> tuple[Dataset, Dataset, ClientTable]:
    """The run's training and test sets (as its task splits them) and every client's inner
    and outer examples of the training set. A fleet the data cannot serve, or data the task
    cannot take, is a :class:`ConfigError`."""
    train, test = load_data(config)
    task = config.task
    try:
        train, test = task.split_data(train, test, config.data.disjoint_classes)
        parts = partition(config, train.labels, examples_per_client(config))
    except FleetTooLargeError as err:
        raise ConfigError(fleet_size_error(config, train.labels.numel(), err.limit)) from None
    except ValueError as err:
        raise ConfigError(
            f"config error: task {task.name!r} on {config.data.name}: {err}"
        ) from None
    return train, test, client_table(config, parts)


def client_sampler(config: RunConfig, train: Dataset, clients: Sequence[ClientData]) -> Sampler:
    """How the task's clients draw their minibatches of ``train``; clients the task cannot
    serve (e.g. too few classes for a few-shot episode) are a :class:`ConfigError`."""
    try:
        return config.task.sampler(train, clients)
    except ValueError as err:
        raise ConfigError(f"config error: task {config.task.name!r}: {err}") from None


def _device_budgets(
    config: RunConfig, model: ClientModel, fleet: Fleet | None
) -> tuple[BudgetPlanner | None, list[Budget] | None]:
    """The budget planner of ``model`` and every device's budget within the round deadline
    (one per distinct device, shared by the clients that have it); ``None`` without a fleet."""
    if fleet is None or model.plan is None:
        return None, None
    planner = budget_planner(config, model.model, model.plan)
    try:
        return planner, planner.budgets(fleet, config.fleet.deadline_s, allow_oversize=True)
    except ValueError as err:  # a deadline or device whose step count or times overflow
        raise ConfigError(
            f"config error: fleet.deadline_s = {config.fleet.deadline_s:g}: {err}"
        ) from None


def _assigner(config: RunConfig, model: ClientModel) -> SubmodelAssigner | None:
    """Who assigns each client's submodel every round (``None``: full models everywhere)."""
    if not config.mask.masked or model.plan is None:
        return None
    per_round = config.fleet.clients_per_round or config.fleet.num_clients
    return SubmodelAssigner(
        model.plan,
        build_policy(config.mask, per_round),
        model.outer,
        mask_x=config.mask.mask_x,
        mask_y=config.mask.mask_y,
    )


def _weights(config: RunConfig, clients: ClientTable) -> list[float] | None:
    """Each client's aggregation weight: its inner example count under ``weighting =
    "data_size"``, else ``None`` (equal weights)."""
    if config.algorithm.weighting != "data_size":
        return None
    return [float(n) for n in clients.inner.sizes().tolist()]


def _schedule(section: FleetConfig) -> UniformLocalSteps | None:
    """The drawn local-steps schedule of ``[fleet] local_steps``, or ``None`` when each client
    runs its budget's steps."""
    if section.local_steps not in ("uniform", "uniform_per_round"):
        return None
    per_round = section.local_steps == "uniform_per_round"
    return UniformLocalSteps(*section.local_steps_range, per_round=per_round)


def _population_steps(
    config: RunConfig,
    budgets: Sequence[ClientBudget],
    weights: Sequence[float] | None,
    schedule: UniformLocalSteps | None,
) -> float:
    """``sum_j p_j tau_j / sum_j p_j`` over every client: the mean local steps of a round's
    full population (each client's expected draw under a drawn schedule)."""
    steps = [
        float(b.local_steps) if schedule is None else expected_local_steps(schedule, config.seed, c)
        for c, b in enumerate(budgets)
    ]
    p = [1.0] * len(budgets) if weights is None else weights
    return sum(w * t for w, t in zip(p, steps, strict=True)) / sum(p)


def _evaluator(
    config: RunConfig, model: ClientModel, train: Dataset, test: Dataset
) -> Callable[[Params], dict[str, float]]:
    """The server's evaluation of a model state: the task's own, or test-set accuracy,
    balanced accuracy and loss (static BatchNorm calibrated on a sample of ``train``)."""
    calibration = calibration_inputs(config, train)
    net, outer, inner = model.model, model.outer, model.inner
    evaluate = config.task.evaluator(net, test, outer, inner, calibration, config.seed)
    if evaluate is None:
        evaluate = make_evaluator(net, test, outer, inner, calibration=calibration)
    return evaluate


def _initial_state(side: ClientSide) -> Any:
    """The algorithm's initial state from the model's weights (on the run device)."""
    state = side.model.model.state_dict()
    model = side.model
    return side.algorithm.init(
        {n: state[n] for n in model.outer},
        {n: state[n] for n in model.inner},
        {n: state[n] for n in model.buffers},
    )


def client_budgets(
    config: RunConfig, fleet: Fleet | None, device_budgets: list[Budget] | None
) -> list[ClientBudget]:
    """Capacity and local steps of every client: explicit ``fleet.capacities`` first (cycled
    list, or by device tier), then the device's memory budget (masked runs only), else the full
    model. Clients with equal budgets share one (frozen) :class:`ClientBudget` object."""
    fc, steps = config.fleet, config.algorithm.local_steps_default
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
    shared: dict[tuple[float, int], ClientBudget] = {}
    for i in range(fc.num_clients):
        device = None if device_budgets is None else device_budgets[i]
        if isinstance(caps, dict) and tiers is not None:
            capacity = caps[tiers[i]]
        elif isinstance(caps, list):
            capacity = caps[i % len(caps)]
        elif device is not None and config.mask.masked:
            if not device.memory_fits:
                raise DeviceTooSmallError(
                    f"client {i}: device cannot train even the smallest submodel "
                    f"(r = {device.capacity:g} needs {device.memory.total} bytes); "
                    "remove it from the fleet, add smaller capacity_levels or use a smaller model"
                )
            capacity = device.capacity
        else:
            capacity = 1.0
        from_budget = device is not None and fc.local_steps == "budget"
        local = device.local_steps if device is not None and from_budget else steps
        if from_budget and local > MAX_BUDGET_STEPS and not caps_are_lifted():  # radbo.limits
            raise ConfigError(
                f"config error: fleet.deadline_s = {fc.deadline_s:g}: client {i}'s device fits "
                f"{local:,} local steps in it, more than {MAX_BUDGET_STEPS:,} (a round would "
                "not end); lower deadline_s, or lift the cap with radbo run --force"
            )
        budget = shared.get((capacity, local))
        if budget is None:
            budget = shared[(capacity, local)] = ClientBudget(capacity=capacity, local_steps=local)
        out.append(budget)
    return out


def fleet_table(config: RunConfig) -> list[dict[str, Any]]:
    """Per client: device, tier, capacity r and local steps τ as the run will use them, the
    r the device's memory budget would allow, training memory at r against the device's
    memory, availability (per-round probability), the share of time the device's availability
    windows are open (``window_share``, 1 without windows), the share of time it is available
    (``available_share`` = window share x availability) and the expected round time at (r, τ)
    (what ``radbo fleet`` prints).

    τ is ``local_steps``, how ``[fleet] local_steps`` sets it is ``local_steps_schedule``.
    Drawn uniformly (``"uniform"``, ``"uniform_per_round"``), rows also hold the inclusive
    ``local_steps_range``; drawn once per client, ``local_steps`` is the client's draw, which
    it runs every round; drawn afresh every round it is ``None`` (no single value), and the
    round time is its mean over the range.
    """
    exp = build(config)
    sim = exp.simulation
    schedule = config.fleet.local_steps
    drawn = schedule in ("uniform", "uniform_per_round")
    rows = []
    for i, budget in enumerate(sim.round_budgets(0, range(len(sim.budgets)))):
        steps = None if schedule == "uniform_per_round" else budget.local_steps
        row: dict[str, Any] = {
            "client": i,
            "device": "-",
            "tier": "-",
            "capacity": budget.capacity,
            "local_steps": steps,
            "local_steps_schedule": schedule,
        }
        if drawn:
            row["local_steps_range"] = list(config.fleet.local_steps_range)
        if exp.fleet is not None and exp.device_budgets is not None and exp.planner is not None:
            profile = exp.fleet[i]
            ends = (steps,) if steps is not None else config.fleet.local_steps_range
            at = [exp.planner.at(profile, budget.capacity, t) for t in ends]
            actual = at[0]
            row.update(
                device=profile.name,
                tier=profile.tier or profile.name,
                budget_capacity=exp.device_budgets[i].capacity,
                memory_mb=actual.memory.total / 1e6,
                device_memory_mb=profile.memory_bytes / 1e6,
                memory_fits=actual.memory_fits,
                availability=profile.availability,
                window_share=profile.window_share,
                available_share=profile.available_share,
                # linear in τ: the mean of a uniform τ's round time is that of the ends'
                round_time_s=sum(b.round_time_s for b in at) / len(at),
            )
        rows.append(row)
    return rows
