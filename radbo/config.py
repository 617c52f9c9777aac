"""Typed run configuration (pydantic v2), parsed from TOML at the edge (CLI or :func:`load_config`).

A run config is a :class:`RunConfig`: top-level settings plus one section per part of a run.
The sections whose kind is chosen by a tag -- ``[data]``, ``[partition]``, ``[model]``,
``[task]``, ``[algorithm]``, ``[estimator]`` -- are tagged unions of the kinds registered in
their registry (:mod:`radbo.registry`); each kind's class lives beside what it builds (an
algorithm's config in the algorithm's file) and declares its settings once. ``[fleet]``,
``[mask]``, ``[baseline]`` and ``[runtime]`` are plain sections defined here.

Every model forbids unknown keys, so a typo is an error that names the field. Validation
errors are turned into one line per problem by :func:`format_validation_error`:
``config error: algorithm.inner_lr = -1.0: Input should be greater than 0`` (at most
:data:`radbo.limits.MAX_ERROR_LINES` lines, then ``config error: and K more problems``).
Values are taken as typed (:func:`parse_config`): a boolean or a string is not a number,
``rounds = true`` and ``seed = "0"`` are errors.
"""

from __future__ import annotations

import copy
import difflib
import re
import tomllib
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from radbo.algorithms import ALGORITHMS, AlgorithmConfig, RABOConfig
from radbo.data import DATA, PARTITIONS, DataConfig, DigitsData, DirichletPartition, PartitionConfig
from radbo.errors import problem_line, problem_lines, problems, value_text
from radbo.hypergrad import ESTIMATORS, Estimator
from radbo.limits import (
    MAX_CLIENTS,
    MAX_ERROR_LINES,
    MAX_ROUNDS,
    Steps,
    StepSize,
    capped,
    caps_lifted,
)
from radbo.masks.policies import POLICIES
from radbo.models import MODELS, MLPConfig, ModelConfig
from radbo.registry import ConfigError, Registry, Section, all_tags
from radbo.simulation import BACKENDS, gpu_refusal
from radbo.tasks import TASKS, HyperRepresentation, TaskConfig
from radbo.tomlfile import read_toml

__all__ = [
    "BaselineConfig",
    "ConfigError",
    "FleetConfig",
    "LoggingConfig",
    "MaskConfig",
    "RunConfig",
    "RuntimeConfig",
    "TraceConfig",
    "apply_overrides",
    "format_validation_error",
    "load_config",
    "parse_config",
    "parse_override",
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

    path: str = Field(
        description="trace file {client id: {computation: ms/sample, communication: kbit/s}}, "
        "JSON or TOML"
    )
    flops_per_sample: float = Field(
        gt=0, allow_inf_nan=False, description="FLOPs per sample, turning ms/sample into FLOP/s"
    )
    memory_bytes: int = Field(gt=0, description="training memory of every traced device (bytes)")
    availability: float = Field(
        1.0, ge=0, le=1, allow_inf_nan=False, description="chance a client is available in a round"
    )
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
    ) = Field(
        None,
        min_length=1,
        description="capacity r: a list cycled over clients, or a table device tier -> r; "
        "default: the largest of capacity_levels the device's memory fits (1 without devices)",
    )
    clients_per_round: int | None = Field(
        None, ge=1, description="clients sampled per round (default: all available)"
    )
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
    devices: dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = Field(
        None, description="device catalog id -> weight: a mix assigned to clients by the run seed"
    )
    file: str | None = Field(None, description="a fleet file of device profiles, TOML or JSON")
    trace: TraceConfig | None = Field(None, description="a FedScale-style device trace")
    deadline_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description='simulated seconds a round\'s local steps must fit (local_steps = "budget")',
    )
    capacity_levels: list[Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [1.0, 0.5, 0.25, 0.125, 0.0625],
        min_length=1,
        description="the capacities a device's memory budget chooses from",
    )
    local_steps: Literal["fixed", "budget", "uniform", "uniform_per_round"] = Field(
        "fixed",
        description="fixed: the algorithm's T / tau; budget: what fits deadline_s on the device; "
        "uniform: drawn once per client from local_steps_range; uniform_per_round: every round",
    )
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

    policy: str = Field(
        "importance",
        description="leading, rolling, random, importance, coverage, fiarse or oap (the "
        "registered mask policies), or none: every client trains the full model",
    )
    mask_x: bool = Field(True, description="prune x's layers to the client's capacity")
    mask_y: bool = Field(True, description="prune y's layers to the client's capacity")
    coverage_k: int = Field(
        2, ge=1, description="coverage: clients holding each trained coordinate (C_x*)"
    )
    rolling_stride: int = Field(
        1, ge=1, description="rolling: channels the window advances per round"
    )

    @property
    def masked(self) -> bool:
        """Whether clients train submodels (a mask policy other than ``none``)."""
        return self.policy != "none"

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

    enabled: bool = Field(
        False, description="also run the full-model baseline and report the savings against it"
    )
    algorithm: Literal["fedmbo_style", "fedmbo"] = Field(
        "fedmbo_style",
        description="fedmbo_style: RABO's round on the full model with a Neumann hypergradient; "
        "fedmbo: FedMBO itself with the run's T, steps and batch sizes",
    )
    terms: Steps = Field(10, ge=1, description="Neumann terms (<= 10,000 without --force)")
    eta: StepSize = Field(
        0.1, gt=0, allow_inf_nan=False, description="Neumann step (<= 1000 without --force)"
    )
    clients_per_phase: int | None = Field(None, ge=1, description="FedMBO's n")


class RuntimeConfig(Section):
    """How the simulation runs (not what it computes).

    ``backend``: ``"auto"`` (the default) runs each workload family stacked or one by one
    (:class:`radbo.simulation.AutoBackend`): on a CPU stacked where one client's operations
    average at most a million FLOPs (the demo MLP, CNN7: rounds 1.1-5.6x faster stacked), one by
    one where they are larger (pfl-research's CIFAR-10 CNN, whose rounds ran 0.89-0.94x as fast
    stacked), on a GPU always stacked. The choice comes from counts of the work, not a clock
    (``auto_choice = "size"``), so a seed gives the same results on every run; ``auto_choice =
    "timing"`` chooses from one timing of both sides instead, which follows the machine but can
    differ between runs. ``"sequential"`` runs clients one after another: the reference
    arithmetic, which the processes and Flower backends equal bitwise and stacked families equal
    to float rounding. ``"batched"`` stacks every group of clients whose work has the same
    shapes (:class:`radbo.simulation.BatchedBackend`). ``"processes"`` runs a phase's clients in
    parallel in ``workers`` worker processes, each with one intra-op thread
    (:class:`radbo.simulation.ProcessBackend`; bitwise equal to the sequential backend with
    ``threads = 1``). ``workers``: the processes backend's worker count (default: every CPU this
    process may use, ``len(os.sched_getaffinity(0))``; other backends ignore it). On an idle
    2-core machine a steady demo round (9 clients) ran 1.5x faster on 2 workers than on 1
    (``benchmarks/workers.py``); with the cores busy with other work it ran slower.
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
    ``memory_format``: ``"channels_last"`` hands client work its image minibatches in NHWC
    layout (``torch.channels_last``), which oneDNN's convolutions and max pooling run faster
    on CPUs: a sequential round of pfl-research's CIFAR-10 FedAvg setup took 6-19 % less time
    (``benchmarks/vs_pfl.py --backends sequential,sequential:channels_last``). Results differ
    from ``"contiguous"`` (NCHW, the default) by float rounding only; stacked cohorts
    (``backend = "batched"``) and inputs that are not images keep their layout.
    ``allocator``: ``"retain"`` (the default) has :func:`radbo.run` ask glibc's malloc to keep
    freed memory for reuse (:func:`radbo.allocator.retain_freed_memory`): large tensors freed
    at the end of one round are not unmapped and faulted in again in the next, which at
    1,000 batched demo clients per round took about 25,000 page faults and 56 ms of system
    time a round (``benchmarks/host_settings.py --setting allocator``), and at 50 batched
    clients of pfl-research's CIFAR-10 CNN 78,000-314,000 (``--setting trim``). The process's
    resident memory then stays at its high-water mark. This is the process's setting and
    lasts after the run (glibc cannot restore its adaptive thresholds); other C libraries
    are left as they are. ``"system"`` leaves the allocator alone. Results are the same
    either way.
    ``cuda_graphs`` (experimental): on a GPU with the batched backend, a stacked cohort's
    phase is captured once as a CUDA graph per shape (cohorts padded to a multiple of 8
    clients) and replayed in later rounds (:class:`radbo.graphs.PhaseGraphs`); so far RABO's
    and RAFBO's inner phase (clients of unequal step counts masked on the device) and outer
    phase, and the local steps of FedAvg (HeteroFL, FedRolex), Dist-ProtoNet, Dist-MAML,
    SimFBO, ShroFBO, FedSVRBGD-FO, AggITD (its lower level and backward sweep) and FedNest /
    LFedNest (on y; FedNest's on x too); the rest runs as without. On an H200 the inner phase of 37
    demo clients took 23.1 ms eager and 0.98 ms replayed (``benchmarks/compile_step.py --device cuda
    --graphs``); the engine's path has not run on a GPU yet. Results differ from ``false``
    by float rounding only (padded cohorts run kernels of another batch size).
    """

    backend: Annotated[str, BACKENDS] = Field(
        "auto",
        description="a registered backend (radbo.simulation.BACKENDS) -- auto: stacked or one "
        "by one per workload family (auto_choice); sequential: one client after another (the "
        "reference arithmetic); batched: clients of equal shapes stacked (equal to float "
        "rounding); processes: worker processes (bitwise equal to sequential)",
    )
    auto_choice: Literal["size", "timing"] = Field(
        "size",
        description="how backend = 'auto' chooses: size: stacked where one client's operations "
        "average <= 1e6 FLOPs on a CPU, always on a GPU (the same every run); timing: the "
        "faster side of one timing (follows the machine; runs may differ)",
    )
    dtype: Literal["float32", "float64"] = Field(
        "float32", description="floating-point type of data, models and all client work"
    )
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
    memory_format: Literal["contiguous", "channels_last"] = Field(
        "contiguous",
        description="layout of the image minibatches of client work: contiguous (NCHW) or "
        "channels_last (NHWC; faster convolutions on CPUs, same results to float rounding)",
    )
    allocator: Literal["retain", "system"] = Field(
        "retain",
        description="retain: glibc's malloc keeps freed memory for reuse from the run's start "
        "(no page faults re-mapping large tensors every round; the process's memory stays at "
        "its high-water mark; process-wide); system: the C library's own behaviour",
    )
    cuda_graphs: bool = Field(
        False,
        description="replay stacked cohorts' phases from CUDA graphs (device = cuda, backend = "
        "batched; RABO's and RAFBO's phases, the local steps of FedAvg, Dist-ProtoNet, "
        "Dist-MAML, SimFBO, ShroFBO, FedSVRBGD-FO, AggITD, FedNest and LFedNest; "
        "experimental)",
    )
    dump_omits_defaults: ClassVar[tuple[str, ...]] = (
        "auto_choice",
        "workers",
        "device",
        "memory_format",
        "allocator",
        "cuda_graphs",
    )

    @model_validator(mode="after")
    def _device_backend(self) -> RuntimeConfig:
        refusal = gpu_refusal(self.backend)
        if self.device != "cpu" and refusal:
            able = " or ".join(f'"{name}"' for name in sorted(BACKENDS) if not gpu_refusal(name))
            raise ValueError(f'device = "{self.device}" needs backend = {able}: {refusal}')
        if self.cuda_graphs and (self.device == "cpu" or self.backend != "batched"):
            raise ValueError(
                'cuda_graphs = true needs device = "cuda" and backend = "batched" (it replays '
                f'stacked cohorts on a GPU), got device = "{self.device}" and backend = '
                f'"{self.backend}"'
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

    data: Literal["server", "node"] = Field(
        "server",
        description="server: tasks carry their example indices; node: each node reads its "
        "data-root",
    )
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


class LoggingConfig(Section):
    """What a run logs besides ``results.json`` and ``metrics.csv`` (:mod:`radbo.experiment.logs`).

    ``tensorboard``: also write each round's metrics row (the columns of ``metrics.csv``) as
    TensorBoard scalars to ``<output_dir>/tensorboard/run`` (and ``.../baseline``) while the run
    runs, with ``torch.utils.tensorboard``; needs the optional extra ``radbo[tensorboard]``.
    """

    tensorboard: bool = Field(False, description="write TensorBoard scalars per round")


class RunConfig(Section):
    """A whole run: what ``radbo run CONFIG.toml`` reads."""

    seed: int = Field(0, ge=0, le=2**63 - 1, description="the run seed (a TOML integer >= 0)")
    rounds: Annotated[int, _ROUNDS_CAP] = Field(
        50, ge=1, description="rounds of the run (<= 1,000,000 without --force)"
    )
    eval_every: int = Field(5, ge=1, description="evaluate every N rounds and after the last")
    output_dir: str = Field(
        "runs/radbo", description="where results, ledger, plots and checkpoints are written"
    )
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
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    dump_omits_defaults: ClassVar[tuple[str, ...]] = ("flower", "logging")

    @model_validator(mode="before")
    @classmethod
    def _default_tags(cls, data: Any) -> Any:
        return _with_default_tags(data)

    @model_validator(mode="after")
    def _check_task_and_model(self) -> RunConfig:
        # tasks whose x lives in a dedicated model, and that model
        task, model = self.task, self.model
        needs = []
        if task.models is not None and model.name not in task.models:
            named = " or ".join(f'"{m}"' for m in task.models)
            needs.append(f'task "{task.name}" needs model {named}')
        if model.task is not None and task.name != model.task:
            needs.append(f'model "{model.name}" needs task "{model.task}"')
        if needs:
            raise ValueError(
                f"task {task.name!r} does not go with model {model.name!r}: {' and '.join(needs)}"
            )
        if not task.maskable and self.mask.masked:
            raise ValueError(
                f'task "{task.name}" has nothing to prune (x is not in the forward pass and the '
                f'classifier keeps its outputs); set [mask] policy = "none" (got '
                f"{self.mask.policy!r})"
            )
        return self

    @model_validator(mode="after")
    def _check_full_model_algorithms(self) -> RunConfig:
        if self.algorithm.full_model and self.mask.masked:
            raise ValueError(
                f"algorithm {self.algorithm.name} trains the full model on every client; set "
                f'[mask] policy = "none" (got {self.mask.policy!r})'
            )
        return self

    @model_validator(mode="after")
    def _check_algorithm_task(self) -> RunConfig:
        tasks = self.algorithm.tasks
        if tasks is not None and self.task.name not in tasks:
            raise ValueError(
                f"algorithm {self.algorithm.name} runs only on [task] name = "
                f"{_or(tuple(repr(t) for t in tasks))}; got {self.task.name!r}"
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


def _with_default_tags(data: Any) -> Any:
    """``data`` (a run config mapping) with the tags it leaves out: a section given without
    its tag key means the default kind, as when it is absent; an algorithm that uses an
    estimator gets its default one when ``[estimator]`` is absent."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    for section, key, kind in _DEFAULT_TAGS:
        value = data.get(section)
        if isinstance(value, dict) and key not in value:
            data[section] = {key: kind, **value}
    algorithm = data.get("algorithm", {"name": "rabo"})
    name = (
        algorithm.get("name") if isinstance(algorithm, dict) else getattr(algorithm, "name", None)
    )
    default = None
    settings: dict[str, Any] = {}
    if isinstance(name, str) and name in ALGORITHMS:
        default = ALGORITHMS[name].default_estimator
        settings = ALGORITHMS[name].default_estimator_settings
    estimator = data.get("estimator")
    if estimator is None and default is not None:
        data["estimator"] = {"name": default, **settings}
    elif isinstance(estimator, dict) and "name" not in estimator:
        data["estimator"] = {"name": default or "cg", **estimator}
    return data


# -- strict scalars ---------------------------------------------------------------------------
class _Refused:
    """A value that pydantic's lax mode would convert but a config field does not take: a
    boolean or a string for a number (``rounds = true``, ``seed = "0"``), a number or a
    string for a boolean, a float for an integer (``rounds = 2.0``). Put in the value's place
    before validation (:func:`_strict_section`), it fails the field's type check, so the
    error names the key like any other; messages show the value as given and ``hint``."""

    __slots__ = ("hint", "value")

    def __init__(self, value: Any, hint: str) -> None:
        self.value = value
        self.hint = hint

    def __repr__(self) -> str:
        return repr(self.value)


_SCALARS = (int, float, bool, str, type(None))


def _members(annotation: Any) -> list[Any]:
    """The types a value of ``annotation`` may have: a union's members, ``Annotated`` unwrapped."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [m for arg in get_args(annotation) for m in _members(arg)]
    return [annotation]


def _strict_scalar(value: Any, members: list[Any]) -> Any:
    """``value``, or a :class:`_Refused` for it where ``members`` (scalar types and literals)
    take it only by a lax conversion."""
    kinds: set[type] = set()
    for member in members:
        if get_origin(member) is Literal:
            kinds.update(type(v) for v in get_args(member))
        elif member in _SCALARS:
            kinds.add(member)
        else:  # a model, a path, Any, ...: its own rules
            return value
    numbers = bool(kinds & {int, float})
    if isinstance(value, bool):
        if numbers and bool not in kinds:
            return _Refused(value, "a boolean is not a number")
    elif isinstance(value, int | float):
        if bool in kinds and not numbers:
            return _Refused(value, "a number is not a boolean: write true or false")
        if isinstance(value, float) and int in kinds and float not in kinds:
            return _Refused(value, "an integer is written without a decimal point")
    elif isinstance(value, str) and str not in kinds:
        if numbers:
            return _Refused(value, "a string is not a number: write it without quotes")
        if bool in kinds:
            return _Refused(value, "a string is not a boolean: write true or false, unquoted")
    return value


def _strict_value(value: Any, annotation: Any, metadata: Sequence[Any] = ()) -> Any:
    """``value`` (given for a field of ``annotation``) with every scalar in it that the field
    would take only by a lax conversion replaced by a :class:`_Refused`."""
    section = _section_type(annotation, metadata)
    if isinstance(value, dict) and section is not None:
        if isinstance(section, Registry):
            tag = value.get(section.key)
            if not isinstance(tag, str) or tag not in section:
                return value  # an unknown kind: pydantic says so
            section = section[tag]
        return _strict_section(value, section)
    members = _members(annotation)
    if isinstance(value, list):
        for member in members:
            args = get_args(member)
            if get_origin(member) is list or (
                get_origin(member) is tuple and len(args) == 2 and args[1] is Ellipsis
            ):
                return [_strict_value(v, args[0]) for v in value]
            if get_origin(member) is tuple and len(args) == len(value):
                return [_strict_value(v, a) for v, a in zip(value, args, strict=True)]
        return value
    if isinstance(value, dict):
        for member in members:
            if get_origin(member) is dict:
                item = get_args(member)[1]
                return {k: _strict_value(v, item) for k, v in value.items()}
        return value
    return _strict_scalar(value, members)


def _strict_section(data: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """``data`` (the settings of a section ``model``) with the values its fields would take
    only by a lax conversion replaced by :class:`_Refused` (:func:`_strict_value`): in a
    config, a boolean is never a number nor a number a boolean, a string is neither, and an
    integer field takes no float (a float field takes an integer)."""
    out = dict(data)
    fields = model.model_fields
    for key, value in data.items():
        field = fields.get(key) if isinstance(key, str) else None
        if field is not None:
            out[key] = _strict_value(value, field.annotation, field.metadata)
    return out


_TYPE_ERRORS = {"list_type", "dict_type", "model_type", "float_type", "int_type", "string_type"}


def _location(loc: tuple[Any, ...], tags: set[str] | None = None) -> str:
    # pydantic puts discriminator tags and union member types ("list[...]") in the location
    # of union members; drop both.
    tags = all_tags() if tags is None else tags
    parts = [
        str(p)
        for p in loc
        if not (isinstance(p, str) and (p in tags or "[" in p or p.startswith("function-")))
    ]
    return ".".join(parts) or "<root>"


def _unknown_field(loc: tuple[Any, ...]) -> str:
    """What an unknown key's error says: the closest allowed key of its section when one is
    close (``did you mean 'inner_lr'?``), else where the allowed keys are listed."""
    section = _section_at(loc[:-1])
    if section is not None and loc and isinstance(loc[-1], str):
        close = difflib.get_close_matches(loc[-1], list(section.model_fields), n=1)
        if close:
            return f"unknown field (did you mean {close[0]!r}?)"
    return "unknown field (check the spelling; see the README for the allowed keys)"


def _section_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config class whose fields a validation error at ``loc + (key,)`` is about: ``loc``
    walked from :class:`RunConfig` through its sections (a tagged section's tag, which pydantic
    puts in the location, picks the registered class). ``None`` where ``loc`` leaves the
    sections (a table of values such as ``fleet.capacities``)."""
    model: type[BaseModel] = RunConfig
    parts = list(loc)
    while parts:
        field = model.model_fields.get(str(parts.pop(0)))
        found = None if field is None else _section_type(field.annotation, field.metadata)
        if isinstance(found, Registry):
            tag = parts.pop(0) if parts else None
            if tag not in found:
                return None
            found = found[str(tag)]
        if found is None:
            return None
        model = found
    return model


def _section_type(annotation: Any, metadata: Sequence[Any]) -> type[BaseModel] | Registry | None:
    """The section class (or the registry of a tagged section) a field's annotation holds."""
    for item in metadata:
        if isinstance(item, Registry):
            return item
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = get_args(annotation)
    if get_origin(annotation) is Annotated:
        return _section_type(args[0], args[1:])
    for arg in args:  # a union such as ``TraceConfig | None``
        found = _section_type(arg, ())
        if found is not None:
            return found
    return None


def format_validation_error(
    error: ValidationError, *, max_lines: int | None = MAX_ERROR_LINES
) -> str:
    """One line per problem: ``config error: FIELD = VALUE: what is allowed``; at most
    ``max_lines`` of them (:data:`radbo.limits.MAX_ERROR_LINES`; ``None``: all), then one
    line ``config error: and K more problems``.

    For a field that accepts several types (a union), errors saying "not this type" are
    dropped when another member reports a real problem, and merged into one line otherwise.
    """
    merged = _merged_problems(error)

    def line(where: str, value: Any, found: list[tuple[tuple[Any, ...], str | None]]) -> str:
        msgs = [_unknown_field(loc) if msg is None else msg for loc, msg in found]
        rest = [m.removeprefix("Input should be ") for m in msgs[1:]]
        text = " or ".join([msgs[0], *rest])
        if isinstance(value, _Refused):
            text += f" ({value.hint})"
        if where == "<root>":  # a rule across sections: no single field to name
            return f"config error: {text}"
        return problem_line("config error", where, value_text(value), text)

    return problem_lines(
        (line(where, value, found) for (where, _), (value, found) in merged.items()),
        len(merged),
        prefix="config error",
        max_lines=max_lines,
    )


def _merged_problems(
    error: ValidationError,
) -> dict[tuple[str, int], tuple[Any, list[tuple[tuple[Any, ...], str | None]]]]:
    """The problems of ``error`` by the line that shows them: ``(field, key) -> (value,
    [(location, message), ...])``, a union's "not this type" errors dropped when another of
    its members reports a real problem and merged into one line otherwise (message ``None``:
    an unknown key, whose did-you-mean search is made only for the lines shown)."""
    tags = all_tags()
    rows = []
    for p in problems(error):
        msg = None if p.type == "extra_forbidden" else p.message
        # a refused scalar (a boolean for a number, ...) is a real problem, not a union member
        # saying "not my type"
        is_type = p.type in _TYPE_ERRORS and not isinstance(p.value, _Refused)
        rows.append((_location(p.loc, tags), p.loc, p.value, msg, is_type))
    # every field holding a real problem, and the fields it lies in
    specific: set[str] = set()
    for where, _, _, _, is_type in rows:
        if not is_type:
            parts = where.split(".")
            specific.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    merged: dict[tuple[str, int], tuple[Any, list[tuple[tuple[Any, ...], str | None]]]] = {}
    for i, (where, loc, value, msg, is_type) in enumerate(rows):
        if is_type:
            if where in specific:
                continue
            key = (where, -1)  # type errors of one field share a line
        elif isinstance(value, _Refused):
            key = (where, -2)  # as the union members refusing it
        else:
            key = (where, i)
        merged.setdefault(key, (value, []))[1].append((loc, msg))
    return merged


def parse_config(data: dict[str, Any], *, force: bool = False) -> RunConfig:
    """Validate a config mapping; raises :class:`ConfigError` with a readable message.

    ``force`` lifts the caps on values that would hang a run (:mod:`radbo.limits`: rounds,
    steps per round, fleet size, step sizes); the physical bounds hold regardless.

    Scalars are taken as they are typed: a boolean is not a number (``rounds = true``), a
    string is not a number (``seed = "0"``), a number is not a boolean, and an integer field
    takes no float (``rounds = 2.0``); a float field takes an integer. Each is one line
    naming the key, as every other problem."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"config error: a run config is a table of settings, got {type(data).__name__}"
        )
    try:
        data = _strict_section(_with_default_tags(data), RunConfig)
        with caps_lifted(force):
            return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    except RecursionError:  # pydantic recursing through absurdly deep nesting
        raise ConfigError("config error: the config is nested too deeply") from None


def load_config(
    path: str | Path, *, force: bool = False, overrides: Sequence[str] = ()
) -> RunConfig:
    """Read and validate a TOML run configuration (``force``: see :func:`parse_config`), with
    ``overrides`` (``"algorithm.inner_lr=0.2"``, see :func:`apply_overrides`) applied to the
    file's settings before they are validated."""
    return parse_config(apply_overrides(read_toml(path), overrides), force=force)


# -- command-line overrides -----------------------------------------------------------------
_KEY = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
# a value TOML cannot parse is taken as a string when it is one bare word: few_shot, a/path
_BARE_WORD = re.compile(r"[^\s\"'\[\]{}=,#]+")
_OVERRIDE_HINT = "write KEY=VALUE with a dotted key and a TOML value, e.g. algorithm.inner_lr=0.2"


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``"section.key=value"`` as ``(("section", "key"), value)``, the value parsed as a TOML
    value (``0.2``, ``50``, ``[64, 32]``, ``true``, ``"few_shot"``, ``{laptop = 1.0}``); a value
    TOML cannot parse that is one bare word (``few_shot``, ``runs/x``: the shell strips the
    quotes of ``task.name="few_shot"``) is that string. Anything else is a
    :class:`ConfigError` of one line.

    >>> parse_override("algorithm.inner_lr=0.2")
    (('algorithm', 'inner_lr'), 0.2)
    >>> parse_override("model.hidden=[64]"), parse_override("task.name=few_shot")
    ((('model', 'hidden'), [64]), (('task', 'name'), 'few_shot'))
    """
    key, equals, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not equals or not _KEY.fullmatch(key):
        raise ConfigError(
            f"config error: override {value_text(text)} is not KEY=VALUE: {_OVERRIDE_HINT}"
        )
    if "\n" in value or "\r" in value:
        raise ConfigError(
            f"config error: override {key} = {value_text(value)}: a value is one line"
        )
    try:
        document = tomllib.loads(f"value = {value}")
    except (ValueError, RecursionError):
        if _BARE_WORD.fullmatch(value):
            return tuple(key.split(".")), value
        raise ConfigError(
            f"config error: override {key} = {value_text(value)} is not a TOML value (a "
            f"string with spaces or symbols needs quotes: {key}='\"a b\"'; a list: [1, 2])"
        ) from None
    return tuple(key.split(".")), document["value"]


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the config mapping ``data`` (a TOML file's tables) with each override of
    ``overrides`` (``"key.sub=value"``, :func:`parse_override`) set, in order, creating the
    tables it names. The result is validated like a file (:func:`parse_config`), so a
    misspelt key is an unknown field with a did-you-mean suggestion.

    >>> apply_overrides({"fleet": {"num_clients": 10}}, ["fleet.num_clients=50", "seed=3"])
    {'fleet': {'num_clients': 50}, 'seed': 3}
    """
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        where = data
        for depth, part in enumerate(path[:-1]):
            inner = where.setdefault(part, {})
            if not isinstance(inner, dict):
                table = ".".join(path[: depth + 1])
                raise ConfigError(
                    f"config error: override {text}: {table} = {value_text(inner)} is not a "
                    f"table, so it has no key {path[depth + 1]!r}"
                )
            where = inner
        where[path[-1]] = value
    return data
