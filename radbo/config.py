"""Typed run configuration (pydantic v2), parsed from TOML at the edge (CLI or :func:`load_config`).

A run config is a :class:`RunConfig`: top-level settings plus one section per part of a run.
The sections whose kind is chosen by a tag -- ``[data]``, ``[partition]``, ``[model]``,
``[task]``, ``[algorithm]``, ``[estimator]`` -- are tagged unions of the kinds registered in
their registry (:mod:`radbo.registry`); each kind's class lives beside what it builds (an
algorithm's config in the algorithm's file) and declares its settings once. ``[fleet]``,
``[mask]``, ``[baseline]`` and ``[runtime]`` are plain sections defined here.

Every model forbids unknown keys, so a typo is an error that names the field. Validation
errors are turned into one line per problem by :func:`format_validation_error`:
``config error: algorithm.inner_lr = -1.0: Input should be greater than 0``.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from radbo.algorithms import ALGORITHMS, AlgorithmConfig, RABOConfig
from radbo.data import DATA, PARTITIONS, DataConfig, DigitsData, DirichletPartition, PartitionConfig
from radbo.hypergrad import ESTIMATORS, Estimator
from radbo.limits import MAX_CLIENTS, MAX_ROUNDS, Steps, StepSize, capped, caps_lifted
from radbo.masks.policies import POLICIES
from radbo.models import MODELS, MLPConfig, ModelConfig
from radbo.registry import ConfigError, Section, all_tags
from radbo.tasks import TASKS, HyperRepresentation, TaskConfig
from radbo.tomlfile import read_toml

__all__ = [
    "BaselineConfig",
    "ConfigError",
    "FleetConfig",
    "MaskConfig",
    "RunConfig",
    "RuntimeConfig",
    "TraceConfig",
    "format_validation_error",
    "load_config",
    "parse_config",
]


_CLIENTS_CAP = capped(MAX_CLIENTS, "a larger fleet's tables fill the memory of a workstation")
_ROUNDS_CAP = capped(MAX_ROUNDS, "a run of more rounds would not end")


# -- fleet and masks ------------------------------------------------------------------------
class TraceConfig(Section):
    """A FedScale-style trace file: ``{client id: {computation: ms/sample, communication: kbit/s}}``
    in JSON or TOML. ``flops_per_sample`` converts ms/sample to FLOP/s.

    ``behavior`` (optional) is a FedScale-style client behaviour trace in JSON or TOML,
    ``{client id: {active: [s, ...], inactive: [s, ...], finish_time: s}}``: client c is on
    from ``active[i]`` to ``inactive[i]`` seconds of a cycle of ``finish_time`` seconds on the
    virtual clock, and is sampled only in rounds that start while it is on (then with
    probability ``availability``). See :meth:`radbo.devices.Fleet.from_trace`."""

    path: str
    flops_per_sample: float = Field(gt=0, allow_inf_nan=False)
    memory_bytes: int = Field(gt=0)
    availability: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    behavior: str | None = Field(
        None, description="FedScale-style client behaviour trace (on/off windows), JSON or TOML"
    )


class FleetConfig(Section):
    """Clients, their devices and what each can afford.

    Devices come from one source at most: ``devices`` (a tier mix of catalog ids -> weights,
    assigned by the run seed), ``file`` (a fleet file, TOML or JSON) or ``trace``. Without one,
    clients have no device profile (no availability draws, no simulated clock).

    ``num_clients`` is bounded by the data: every client needs one inner and one outer example
    (one for episodic tasks), so a partition of N training examples serves at most about N / 2
    clients (:meth:`radbo.data.PartitionConfig.max_clients`; the build error names the exact
    limit); ``[partition] allow_overlap = true`` lets a larger fleet share examples.

    ``capacities`` fixes each client's capacity ratio r: a list is cycled over clients (client
    i gets ``capacities[i % len]``), a table maps device tiers to r (``{laptop = 1.0,
    phone-low = 0.25}``; needs devices). Without it r comes from the device's memory budget
    (the largest of ``capacity_levels`` whose training memory fits), or is 1 without devices.
    ``local_steps``: ``"fixed"`` (the algorithm's T / tau for everyone), ``"budget"`` (from the
    device and the round deadline) or ``"uniform"`` (drawn once per client uniformly from
    ``local_steps_range``, inclusive: SimFBO/ShroFBO's heterogeneous-computation experiment)
    or ``"uniform_per_round"`` (drawn again every round).
    """

    num_clients: Annotated[int, _CLIENTS_CAP] = Field(
        10, ge=1, description="clients of the fleet (<= 1,000,000 without --force)"
    )
    capacities: (
        list[Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]]
        | dict[str, Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]]
        | None
    ) = Field(None, min_length=1)
    clients_per_round: int | None = Field(None, ge=1)
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        allow_inf_nan=False,
        description="chance a sampled client drops out mid-round",
    )
    overcommit: float = Field(
        0.0,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="sample ceil(K (1 + oc)) clients, aggregate the first K results (oc <= 1000)",
    )
    phase_deadline_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="discard results arriving later in a phase (simulated s)",
    )
    devices: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = None
    file: str | None = None
    trace: TraceConfig | None = None
    deadline_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    capacity_levels: list[Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [1.0, 0.5, 0.25, 0.125, 0.0625], min_length=1
    )
    local_steps: Literal["fixed", "budget", "uniform", "uniform_per_round"] = "fixed"
    local_steps_range: tuple[Annotated[Steps, Field(ge=1)], Annotated[Steps, Field(ge=1)]] = Field(
        (1, 10), description="inclusive range of uniform local steps (<= 10,000 without --force)"
    )

    @model_validator(mode="after")
    def _check(self) -> FleetConfig:
        if self.clients_per_round is not None and self.clients_per_round > self.num_clients:
            raise ValueError(
                f"clients_per_round = {self.clients_per_round} exceeds num_clients = "
                f"{self.num_clients}"
            )
        sources = [k for k in ("devices", "file", "trace") if getattr(self, k) is not None]
        if len(sources) > 1:
            raise ValueError(f"give at most one device source, got {' and '.join(sources)}")
        if self.devices is not None and not any(w > 0 for w in self.devices.values()):
            raise ValueError("devices needs at least one device with a positive weight")
        if isinstance(self.capacities, dict) and not sources:
            raise ValueError("capacities by device tier needs devices, file or trace")
        low, high = self.local_steps_range
        if low > high:
            raise ValueError(f"local_steps_range = [{low}, {high}] must have low <= high")
        if self.local_steps == "budget" and not sources:
            raise ValueError('local_steps = "budget" needs devices, file or trace')
        return self

    @property
    def has_devices(self) -> bool:
        return any(getattr(self, k) is not None for k in ("devices", "file", "trace"))


class MaskConfig(Section):
    """Mask policy (``none`` = every client trains the full model) and which blocks to mask.

    ``coverage`` assigns channel segments so that every coordinate trained in a round is held
    by at least ``coverage_k`` clients (RABO's C_x*, Fig. 3); ``rolling`` advances its window
    by ``rolling_stride`` channels per round (FedRolex).
    """

    policy: str = Field("importance", description="a registered mask policy, or none")
    mask_x: bool = True
    mask_y: bool = True
    coverage_k: int = Field(2, ge=1)
    rolling_stride: int = Field(1, ge=1)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, policy: str) -> str:
        if policy != "none" and policy not in POLICIES:
            names = [repr(p) for p in [*POLICIES, "none"]]
            raise ValueError(f"Input should be {', '.join(names[:-1])} or {names[-1]}")
        return policy


class BaselineConfig(Section):
    """The full-model reference run a savings report compares with, on the same fleet, data,
    seed and number of rounds (iterations), every client on the full model (capacity 1, no
    masks).

    ``algorithm = "fedmbo_style"`` (default) is RABO's two-phase round with a truncated Neumann
    hypergradient of ``terms`` terms and step ``eta``: the same local work as the run, minus
    the masks. ``"fedmbo"`` is FedMBO itself (``papers/fedmbo.txt``, Alg. 1 + PHE): T
    minibatch-SGD communication rounds on y with the run's T, step sizes and batch sizes, and
    the randomized Neumann chains with N = ``terms``, 1/l = ``eta`` and ``clients_per_phase``
    clients per communication round (default: all available).
    """

    enabled: bool = False
    algorithm: Literal["fedmbo_style", "fedmbo"] = "fedmbo_style"
    terms: Steps = Field(10, ge=1, description="Neumann terms (<= 10,000 without --force)")
    eta: StepSize = Field(
        0.1, gt=0, allow_inf_nan=False, description="Neumann step (<= 1000 without --force)"
    )
    clients_per_phase: int | None = Field(None, ge=1, description="FedMBO's n")


class RuntimeConfig(Section):
    """How the simulation runs (not what it computes).

    ``backend``: ``"sequential"`` runs clients one after another; ``"batched"`` runs clients
    whose work has the same shapes as one stacked computation (:class:`radbo.simulation.
    BatchedBackend`; equal to the sequential backend up to float rounding); ``"processes"``
    runs a phase's clients in parallel in ``workers`` worker processes, each with one intra-op
    thread (:class:`radbo.simulation.ProcessBackend`; bitwise equal to the sequential backend
    with ``threads = 1``). ``workers``: the processes backend's worker count (default: every
    CPU this process may use, ``len(os.sched_getaffinity(0))``; other backends ignore it). On
    an idle 2-core machine a steady demo round (9 clients) ran 1.5x faster on 2 workers than
    on 1 (``benchmarks/workers.py``); with the cores busy with other work it ran slower.
    ``dtype``: the floating-point type of data, models and every client computation.
    ``threads``: torch's intra-op threads while :func:`radbo.run` runs (the caller's setting
    is restored after; with ``"processes"`` they serve this process's server-side work, each
    worker runs with 1); ``None`` leaves torch's own choice. radbo's work is many tiny
    operations, where intra-op threads only add synchronisation: on a busy 2-core machine a
    tiny forward+backward took 648 ms (median) with torch's default of 2 threads against
    0.18 ms with 1, and a demo round used about 30x more CPU; hence the default 1.
    ``device``: where data, models and every client and server computation live: ``"cpu"``
    or ``"cuda"`` / ``"cuda:N"`` (a GPU; with the sequential or batched backend). The run is
    built on the CPU as always (same initial weights, partitions and masks) and then moved;
    random draws (minibatches, client sampling, masks) stay on CPU generators, so a GPU run
    draws what a CPU run draws and differs from it only by floating-point rounding.
    """

    backend: Literal["sequential", "batched", "processes"] = "sequential"
    dtype: Literal["float32", "float64"] = "float32"
    threads: int | None = Field(
        1, ge=1, le=1024, description="torch intra-op threads during a run (None: torch's)"
    )
    workers: int | None = Field(
        None, ge=1, le=1024, description="worker processes of backend = 'processes' (None: CPUs)"
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:[0-9]{1,3})?)$",
        description='where the run computes: "cpu", "cuda" or "cuda:N"',
    )
    dump_omits_defaults: ClassVar[tuple[str, ...]] = ("workers", "device")

    @model_validator(mode="after")
    def _device_backend(self) -> RuntimeConfig:
        if self.device != "cpu" and self.backend == "processes":
            raise ValueError(
                f'device = "{self.device}" needs backend = "sequential" or "batched": '
                "forked worker processes cannot share a GPU context"
            )
        return self


class FlowerConfig(Section):
    """How a run behaves on Flower (:mod:`radbo.flower`); ignored by ``radbo run``.

    ``data``: ``"server"`` (the default; Flower's simulation runtime) partitions the training
    set on the server and sends each task its client's example indices, as the in-process
    engine does; ``"node"`` sends no data at all: each SuperNode loads its own client's
    examples from its ``data-root`` node config (written by ``radbo flower partition``).
    ``reply_timeout_s``: how long the server waits for a phase's replies; a node that has not
    replied by then (or is gone) is a dropped client for that phase. ``discovery_timeout_s``:
    how long the server waits before round 0 for a node to serve every client.
    ``max_update_ratio``: when set, a reply whose update has a larger L2 norm than this
    multiple of the broadcast tensors' norm is rejected (a bound against wild updates).
    ``poll_interval_s``: how often the server asks the SuperLink for a phase's replies while
    it waits for them (> 0 and at most ``reply_timeout_s``); the default 0.1 s costs the
    SuperLink little and adds about half of it to each phase (Flower's own
    ``send_and_receive`` asks every 3 s).
    """

    data: Literal["server", "node"] = "server"
    reply_timeout_s: float = Field(
        300.0, gt=0, le=86_400, allow_inf_nan=False, description="seconds to wait for replies"
    )
    discovery_timeout_s: float = Field(
        120.0, gt=0, le=86_400, allow_inf_nan=False, description="seconds to wait for nodes"
    )
    max_update_ratio: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="reject updates larger than this x model"
    )
    poll_interval_s: float = Field(
        0.1, gt=0, le=86_400, allow_inf_nan=False, description="seconds between reply pulls"
    )
    dump_omits_defaults: ClassVar[tuple[str, ...]] = ("poll_interval_s",)

    @model_validator(mode="after")
    def _check_poll_interval(self) -> FlowerConfig:
        if self.poll_interval_s > self.reply_timeout_s:
            raise ValueError(
                f"poll_interval_s = {self.poll_interval_s:g} exceeds reply_timeout_s = "
                f"{self.reply_timeout_s:g}: set poll_interval_s at most reply_timeout_s"
            )
        return self


class RunConfig(Section):
    """A whole run: what ``radbo run CONFIG.toml`` reads."""

    seed: int = Field(0, ge=0, le=2**63 - 1, description="the run seed (a TOML integer >= 0)")
    rounds: Annotated[int, _ROUNDS_CAP] = Field(
        50, ge=1, description="rounds of the run (<= 1,000,000 without --force)"
    )
    eval_every: int = Field(5, ge=1)
    output_dir: str = "runs/radbo"
    checkpoint_every: int | None = Field(
        None, ge=1, description="write a checkpoint every N rounds (and after the last)"
    )
    data: Annotated[DataConfig, DATA] = Field(default_factory=DigitsData)
    partition: Annotated[PartitionConfig, PARTITIONS] = Field(default_factory=DirichletPartition)
    model: Annotated[ModelConfig, MODELS] = Field(default_factory=MLPConfig)
    task: Annotated[TaskConfig, TASKS] = Field(default_factory=HyperRepresentation)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    mask: MaskConfig = Field(default_factory=MaskConfig)
    algorithm: Annotated[AlgorithmConfig, ALGORITHMS] = Field(default_factory=RABOConfig)
    estimator: Annotated[Estimator, ESTIMATORS] | None = None
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    flower: FlowerConfig = Field(default_factory=FlowerConfig)
    dump_omits_defaults: ClassVar[tuple[str, ...]] = ("flower",)

    @model_validator(mode="before")
    @classmethod
    def _default_tags(cls, data: Any) -> Any:
        # A section given without its tag key means the default kind, as when it is absent;
        # an algorithm that uses an estimator gets its default one when [estimator] is absent.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for section, key, kind in _DEFAULT_TAGS:
            value = data.get(section)
            if isinstance(value, dict) and key not in value:
                data[section] = {key: kind, **value}
        algorithm = data.get("algorithm", {"name": "rabo"})
        name = (
            algorithm.get("name")
            if isinstance(algorithm, dict)
            else getattr(algorithm, "name", None)
        )
        default = None
        settings: dict[str, Any] = {}
        if isinstance(name, str) and name in ALGORITHMS:
            default = ALGORITHMS[name].default_estimator
            settings = ALGORITHMS[name].default_estimator_settings
            if name == "rafbo":
                default = "finite_difference"
        estimator = data.get("estimator")
        if estimator is None and default is not None:
            data["estimator"] = {"name": default, **settings}
        elif isinstance(estimator, dict) and "name" not in estimator:
            data["estimator"] = {"name": default or "cg", **estimator}
        return data

    @model_validator(mode="after")
    def _check_task_and_model(self) -> RunConfig:
        # tasks whose x lives in a dedicated model, and that model
        task, model = self.task, self.model
        needs = []
        if task.model is not None and model.name != task.model:
            needs.append(f'task "{task.name}" needs model "{task.model}"')
        if model.task is not None and task.name != model.task:
            needs.append(f'model "{model.name}" needs task "{model.task}"')
        if needs:
            raise ValueError(
                f"task {task.name!r} does not go with model {model.name!r}: {' and '.join(needs)}"
            )
        if not task.maskable and self.mask.policy != "none":
            raise ValueError(
                f'task "{task.name}" has nothing to prune (x is not in the forward pass and the '
                f'classifier keeps its outputs); set [mask] policy = "none" (got '
                f"{self.mask.policy!r})"
            )
        return self

    @model_validator(mode="after")
    def _check_full_model_algorithms(self) -> RunConfig:
        if self.algorithm.full_model and self.mask.policy != "none":
            raise ValueError(
                f"algorithm {self.algorithm.name} trains the full model on every client; set "
                f'[mask] policy = "none" (got {self.mask.policy!r})'
            )
        return self

    @model_validator(mode="after")
    def _check_estimator(self) -> RunConfig:
        algorithm, estimator = self.algorithm, self.estimator
        if estimator is None:
            return self
        accepted = algorithm.accepted_estimators()
        if not accepted:
            raise ValueError(
                f"algorithm {algorithm.name} takes no estimator; remove the [estimator] section"
            )
        if estimator.name not in accepted:
            raise ValueError(
                f"algorithm {algorithm.name} takes estimator {_or(accepted)}; got "
                f"{estimator.name!r}"
            )
        use = algorithm.estimator_use(estimator)
        relevant = estimator.fields_for(use or "")
        if relevant is not None:
            defaults = type(estimator)(name=estimator.name)
            idle = sorted(
                f
                for f in estimator.model_fields_set - relevant - {"name"}
                if getattr(estimator, f) != getattr(defaults, f)
            )
            if idle:
                keep = ", ".join(sorted(relevant)) or "none"
                raise ValueError(
                    f"estimator {estimator.name} setting(s) {', '.join(idle)} have no effect with "
                    f"algorithm {algorithm.name}, which uses only its {use} (settings that "
                    f"matter: {keep}); remove them"
                )
        return self


def _or(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


for _registry in (DATA, PARTITIONS, MODELS, TASKS, ALGORITHMS, ESTIMATORS):
    _registry.attach(RunConfig)

_DEFAULT_TAGS = (
    ("data", "name", "digits"),
    ("partition", "kind", "dirichlet"),
    ("model", "name", "mlp"),
    ("algorithm", "name", "rabo"),
    ("task", "name", "hyper_representation"),
)

_TYPE_ERRORS = {"list_type", "dict_type", "model_type", "float_type", "int_type", "string_type"}


def _location(loc: tuple[Any, ...]) -> str:
    # pydantic puts discriminator tags and union member types ("list[...]") in the location
    # of union members; drop both.
    tags = all_tags()
    parts = [
        str(p)
        for p in loc
        if not (isinstance(p, str) and (p in tags or "[" in p or p.startswith("function-")))
    ]
    return ".".join(parts) or "<root>"


def _value_text(value: Any) -> str:
    """A value as a message shows it: tables as ``{...}``, long values cut to 100 characters."""
    if isinstance(value, dict):
        return "{...}"
    try:
        text = repr(value)
    except RecursionError:  # a list nested thousands deep (possible from Python, not TOML)
        text = reprlib.repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def format_validation_error(error: ValidationError) -> str:
    """One line per problem: ``config error: FIELD = VALUE: what is allowed``.

    For a field that accepts several types (a union), errors saying "not this type" are
    dropped when another member reports a real problem, and merged into one line otherwise.
    """
    rows = []
    for e in error.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see the README for the allowed keys)"
        rows.append((_location(tuple(e["loc"])), e.get("input"), msg, e["type"] in _TYPE_ERRORS))
    specific = [where for where, _, _, is_type in rows if not is_type]
    problems: dict[tuple[str, int], tuple[Any, list[str]]] = {}
    for i, (where, value, msg, is_type) in enumerate(rows):
        if is_type:
            if any(o == where or o.startswith(where + ".") for o in specific):
                continue
            key = (where, -1)  # type errors of one field share a line
        else:
            key = (where, i)
        problems.setdefault(key, (value, []))[1].append(msg)
    lines = []
    for (where, _), (value, msgs) in problems.items():
        value_text = _value_text(value)
        rest = [m.removeprefix("Input should be ") for m in msgs[1:]]
        text = " or ".join([msgs[0], *rest])
        if where == "<root>":  # a rule across sections: no single field to name
            lines.append(f"config error: {text}")
        else:
            lines.append(f"config error: {where} = {value_text}: {text}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], *, force: bool = False) -> RunConfig:
    """Validate a config mapping; raises :class:`ConfigError` with a readable message.

    ``force`` lifts the caps on values that would hang a run (:mod:`radbo.limits`: rounds,
    steps per round, fleet size, step sizes); the physical bounds hold regardless."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"config error: a run config is a table of settings, got {type(data).__name__}"
        )
    try:
        with caps_lifted(force):
            return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    except RecursionError:  # pydantic recursing through absurdly deep nesting
        raise ConfigError("config error: the config is nested too deeply") from None


def load_config(path: str | Path, *, force: bool = False) -> RunConfig:
    """Read and validate a TOML run configuration (``force``: see :func:`parse_config`)."""
    return parse_config(read_toml(path), force=force)
