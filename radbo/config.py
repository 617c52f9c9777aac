"""Typed run configuration (pydantic v2), parsed from TOML at the edge (CLI or :func:`load_config`).

Every model forbids unknown keys, so a typo is an error that names the field. Validation
errors are turned into one line per problem by :func:`format_validation_error`:
``config error: algorithm.inner_lr = -1.0: Input should be greater than 0``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)


class ConfigError(ValueError):
    """A configuration file is missing, unreadable or invalid; the message is user-facing."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- data -----------------------------------------------------------------------------------
_OuterFraction = Annotated[
    float, Field(gt=0, lt=1, description="share of each client's data used by the outer loss f_i")
]
_Limit = Annotated[int, Field(ge=1, description="keep at most this many examples of the split")]
_Imbalance = Annotated[
    float,
    Field(
        ge=1,
        allow_inf_nan=False,
        description="long-tailed training set: class c of C keeps imbalance**(-c/(C-1)) of "
        "its examples (1 = unchanged)",
    ),
]


class _DataSection(_Strict):
    """A ``[data]`` kind. Its dump leaves out ``imbalance`` at the default 1, so that configs
    without it dump (in ``results.json`` and checkpoints) as they did before it existed."""

    @model_serializer(mode="wrap")
    def _omit_default_imbalance(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and getattr(self, "imbalance", None) == 1.0:
            data.pop("imbalance", None)
        return data


class DigitsData(_DataSection):
    """scikit-learn's bundled handwritten digits (1797 8x8 images, no download)."""

    name: Literal["digits"] = "digits"
    test_fraction: float = Field(0.2, gt=0, lt=1, description="held-out test share")
    outer_fraction: _OuterFraction = 0.3
    imbalance: _Imbalance = 1.0


class _FileData(_DataSection):
    """A data set read from files the user already has in ``root`` (radbo never downloads).

    The official training split is the training data, the official test split the test set.
    ``limit_train`` / ``limit_test`` keep at most that many examples of each split: a
    class-stratified subset drawn from the run seed (all of the split when it is smaller).
    ``imbalance`` (every kind) makes the training set long-tailed after that (see
    :func:`radbo.data.long_tail_subset`); the test set stays as it is.
    """

    name: str
    root: str = Field(min_length=1, description="folder holding the data set's files")
    outer_fraction: _OuterFraction = 0.3
    limit_train: _Limit | None = None
    limit_test: _Limit | None = None
    imbalance: _Imbalance = 1.0


class MNISTData(_FileData):
    """MNIST from the IDX files in ``root`` (``train-images-idx3-ubyte`` ..., optionally
    ``.gz``; also torchvision's ``root/MNIST/raw``): 60000 train and 10000 test 1x28x28."""

    name: Literal["mnist"]


class CIFAR10Data(_FileData):
    """CIFAR-10, binary version, in ``root`` or ``root/cifar-10-batches-bin``
    (``data_batch_1.bin`` ... ``data_batch_5.bin``, ``test_batch.bin``): 50000 train and
    10000 test 3x32x32."""

    name: Literal["cifar10"]


DataConfig = Annotated[DigitsData | MNISTData | CIFAR10Data, Field(discriminator="name")]


class IIDPartition(_Strict):
    kind: Literal["iid"] = "iid"


class ShardsPartition(_Strict):
    kind: Literal["shards"] = "shards"
    classes_per_client: int = Field(2, ge=1)


class DirichletPartition(_Strict):
    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0)


Partition = Annotated[
    IIDPartition | ShardsPartition | DirichletPartition, Field(discriminator="kind")
]


# -- model and task -------------------------------------------------------------------------
_Width = Annotated[int, Field(ge=1)]
#: BatchNorm running statistics: averaged over clients like parameters, or static BN (sBN).
BatchNormMode = Literal["aggregate", "static"]
_Calibration = Annotated[
    int, Field(ge=1, description="training examples the server recomputes static BN over")
]


class MLPModel(_Strict):
    """MLP on flattened inputs (any shape): hidden layers are x, the head is y."""

    name: Literal["mlp"] = "mlp"
    hidden: list[_Width] = Field(default_factory=lambda: [128], min_length=1)


class CNNModel(_Strict):
    """Small CNN with BatchNorm (any image size and channel count): conv backbone is x, head is y.

    ``batchnorm`` (every model with BatchNorm layers has it): ``"aggregate"`` averages the
    clients' running statistics coordinate-wise like parameters; ``"static"`` (HeteroFL's sBN)
    has clients normalise with batch statistics only and the server recompute the statistics of
    the global model over ``calibration_samples`` training examples before each evaluation.
    """

    name: Literal["cnn"] = "cnn"
    channels: list[_Width] = Field(default_factory=lambda: [16, 32], min_length=1)
    batchnorm: BatchNormMode = "aggregate"
    calibration_samples: _Calibration = 512


class CNN7Model(_Strict):
    """FedNest's 7-layer LeNet-5 CNN (no BatchNorm; images of at least 16x16): the two convs
    and two hidden linear layers are x, the head is y."""

    name: Literal["cnn7"]
    channels: list[_Width] = Field(default_factory=lambda: [6, 16], min_length=2, max_length=2)
    hidden: list[_Width] = Field(default_factory=lambda: [120, 84], min_length=2, max_length=2)


class ResNet12Model(_Strict):
    """ResNet-12 (MetaOptNet / RFS; images of at least 16x16): backbone is x, head is y."""

    name: Literal["resnet12"]
    widths: list[_Width] = Field(
        default_factory=lambda: [64, 160, 320, 640], min_length=4, max_length=4
    )
    batchnorm: BatchNormMode = "aggregate"
    calibration_samples: _Calibration = 512


class ResNet18Model(_Strict):
    """ResNet-18, CIFAR-style stem (HeteroFL / FedRolex; images of at least 9x9): backbone is x,
    head is y."""

    name: Literal["resnet18"]
    widths: list[_Width] = Field(
        default_factory=lambda: [64, 128, 256, 512], min_length=4, max_length=4
    )
    batchnorm: BatchNormMode = "aggregate"
    calibration_samples: _Calibration = 512


class LogisticModel(_Strict):
    """Logistic regression on flattened inputs with one L2 weight per input feature: the
    classifier is y, the log weights ``log_l2`` are x (task ``feature_l2``)."""

    name: Literal["logistic"]
    init_log_l2: float = Field(-3.0, description="initial log L2 weight of every feature")


class VSMLPModel(_Strict):
    """MLP classifier on flattened inputs with per-class VS-loss hyperparameters (task
    ``vs_loss``): the whole network is y (its hidden layers are prunable), the VS-loss weights,
    shifts and logit scales are x. ``hidden = []`` is a linear classifier."""

    name: Literal["vs_mlp"]
    hidden: list[_Width] = Field(default_factory=lambda: [128])


ModelConfig = Annotated[
    MLPModel | CNNModel | CNN7Model | ResNet12Model | ResNet18Model | LogisticModel | VSMLPModel,
    Field(discriminator="name"),
]


class HyperRepresentationTask(_Strict):
    """Backbone = x, head = y (``papers/rabo_rafbo.txt`` Sec. V-A, FedNest, FedMSA)."""

    name: Literal["hyper_representation"] = "hyper_representation"
    inner_l2: float = Field(1e-2, ge=0, description="L2 weight on y making g strongly convex")


class FeatureL2Task(_Strict):
    """Hyperparameter optimization: x = one log L2 weight per input feature of a logistic
    regression y (model ``logistic``); f is the validation cross-entropy."""

    name: Literal["feature_l2"]
    inner_l2: float = Field(1e-3, ge=0, description="extra L2 on all of y (the bias too)")


class VSLossTask(_Strict):
    """Loss-function tuning on long-tailed data: x = the per-class VS-loss hyperparameters
    (weight, additive shift, logit scale) of model ``vs_mlp``, y = the network; g is the VS loss
    on the training split, f the class-balanced cross-entropy on the validation split."""

    name: Literal["vs_loss"]
    inner_l2: float = Field(1e-3, ge=0, description="L2 on all of y")


TaskConfig = Annotated[
    HyperRepresentationTask | FeatureL2Task | VSLossTask, Field(discriminator="name")
]


# -- fleet and masks ------------------------------------------------------------------------
class TraceConfig(_Strict):
    """A FedScale-style trace file: ``{client id: {computation: ms/sample, communication: kbit/s}}``
    in JSON or TOML. ``flops_per_sample`` converts ms/sample to FLOP/s."""

    path: str
    flops_per_sample: float = Field(gt=0)
    memory_bytes: int = Field(gt=0)
    availability: float = Field(1.0, ge=0, le=1)


class FleetConfig(_Strict):
    """Clients, their devices and what each can afford.

    Devices come from one source at most: ``devices`` (a tier mix of catalog ids -> weights,
    assigned by the run seed), ``file`` (a fleet file, TOML or JSON) or ``trace``. Without one,
    clients have no device profile (no availability draws, no simulated clock).

    ``capacities`` fixes each client's capacity ratio r: a list is cycled over clients (client
    i gets ``capacities[i % len]``), a table maps device tiers to r (``{laptop = 1.0,
    phone-low = 0.25}``; needs devices). Without it r comes from the device's memory budget
    (the largest of ``capacity_levels`` whose training memory fits), or is 1 without devices.
    ``local_steps``: ``"fixed"`` (the algorithm's T / tau for everyone), ``"budget"`` (from the
    device and the round deadline) or ``"uniform"`` (drawn once per client uniformly from
    ``local_steps_range``, inclusive: SimFBO/ShroFBO's heterogeneous-computation experiment)
    or ``"uniform_per_round"`` (drawn again every round).
    """

    num_clients: int = Field(10, ge=1)
    capacities: (
        list[Annotated[float, Field(gt=0, le=1)]]
        | dict[str, Annotated[float, Field(gt=0, le=1)]]
        | None
    ) = Field(None, min_length=1)
    clients_per_round: int | None = Field(None, ge=1)
    dropout: float = Field(
        0.0, ge=0, lt=1, description="chance a sampled client drops out mid-round"
    )
    overcommit: float = Field(
        0.0, ge=0, description="sample ceil(K (1 + oc)) clients, aggregate the first K results"
    )
    phase_deadline_s: float | None = Field(
        None, gt=0, description="discard results arriving later in a phase (simulated s)"
    )
    devices: dict[str, Annotated[float, Field(ge=0)]] | None = None
    file: str | None = None
    trace: TraceConfig | None = None
    deadline_s: float = Field(60.0, gt=0)
    capacity_levels: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: [1.0, 0.5, 0.25, 0.125, 0.0625], min_length=1
    )
    local_steps: Literal["fixed", "budget", "uniform", "uniform_per_round"] = "fixed"
    local_steps_range: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]] = (1, 10)

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


class MaskConfig(_Strict):
    """Mask policy (``none`` = every client trains the full model) and which blocks to mask.

    ``coverage`` assigns channel segments so that every coordinate trained in a round is held
    by at least ``coverage_k`` clients (RABO's C_x*, Fig. 3); ``rolling`` advances its window
    by ``rolling_stride`` channels per round (FedRolex).
    """

    policy: Literal["importance", "leading", "rolling", "random", "coverage", "none"] = "importance"
    mask_x: bool = True
    mask_y: bool = True
    coverage_k: int = Field(2, ge=1)
    rolling_stride: int = Field(1, ge=1)


# -- estimator and algorithm ----------------------------------------------------------------
class CGEstimator(_Strict):
    """Exact implicit hypergradient, v by conjugate gradient (RABO eq. (7))."""

    name: Literal["cg"] = "cg"
    max_iter: int = Field(10, ge=1)
    tol: float = Field(1e-10, ge=0)
    damping: float = Field(0.0, ge=0)


class NeumannEstimator(_Strict):
    """Implicit hypergradient, v by a truncated Neumann series."""

    name: Literal["neumann"] = "neumann"
    terms: int = Field(20, ge=1)
    eta: float = Field(0.1, gt=0)


class FiniteDifferenceEstimator(_Strict):
    """RAFBO's second-order-free hypergradient (RABO paper Alg. 2, corrected; see README)."""

    name: Literal["finite_difference"] = "finite_difference"
    num_coordinates: int | None = Field(None, ge=1, description="|P|; default all of x")
    fraction: float | None = Field(None, gt=0, le=1, description="|P| as a share of dim(x)")
    mu: float = Field(1e-3, gt=0)
    hvp_mu: float = Field(1e-3, gt=0)
    cg_iters: int = Field(10, ge=1)
    tol: float = Field(1e-10, ge=0)
    damping: float = Field(0.0, ge=0)
    as_printed: bool = False
    rescale: bool = False

    @model_validator(mode="after")
    def _one_size(self) -> FiniteDifferenceEstimator:
        if self.num_coordinates is not None and self.fraction is not None:
            raise ValueError("give num_coordinates or fraction, not both")
        return self


class FirstOrderEstimator(_Strict):
    """Fully first-order penalty hypergradient (``papers/fedsbo_first_order.txt``)."""

    name: Literal["first_order"] = "first_order"
    lam: float = Field(10.0, gt=0)
    inner_steps: int = Field(10, ge=1)
    lr: float = Field(0.1, gt=0)


EstimatorConfig = Annotated[
    CGEstimator | NeumannEstimator | FiniteDifferenceEstimator | FirstOrderEstimator,
    Field(discriminator="name"),
]


class RABOConfig(_Strict):
    """RABO hyper-parameters (Alg. 1 of the RABO paper); ``rafbo`` is RABO with the
    finite-difference estimator (Alg. 2)."""

    name: Literal["rabo", "rafbo"] = "rabo"
    inner_lr: float = Field(0.1, gt=0, description="beta")
    outer_lr: float = Field(0.1, gt=0, description="alpha")
    inner_steps: int = Field(5, ge=1, description="T")
    batch_size: int = Field(32, ge=1)
    outer_batch_size: int = Field(32, ge=1)
    max_hypergrad_norm: float | None = Field(None, gt=0)
    weighting: Literal["uniform", "data_size"] = "uniform"


class SimFBOConfig(_Strict):
    """SimFBO / ShroFBO hyper-parameters (Alg. 1 of ``papers/simfbo_shrofbo.txt``)."""

    name: Literal["simfbo", "shrofbo"] = "shrofbo"
    inner_lr: float = Field(0.05, gt=0, description="eta_y")
    v_lr: float = Field(0.05, gt=0, description="eta_v")
    outer_lr: float = Field(0.05, gt=0, description="eta_x")
    server_lr_y: float = Field(0.2, gt=0, description="gamma_y")
    server_lr_v: float = Field(0.05, gt=0, description="gamma_v")
    server_lr_x: float = Field(0.05, gt=0, description="gamma_x")
    radius: float | None = Field(10.0, gt=0, description="r of the projection on v")
    coefficient: float = Field(1.0, gt=0, description="a_i^(t,k)")
    local_steps: int = Field(5, ge=1, description="tau when fleet.local_steps = 'fixed'")
    batch_size: int = Field(32, ge=1)
    outer_batch_size: int = Field(32, ge=1)
    products: Literal["autograd", "finite_difference", "first_order"] = "autograd"
    fd_mu: float = Field(1e-3, gt=0, description="relative step of finite-difference products")
    penalty: float = Field(10.0, gt=0, description="lambda of the first-order penalty")
    weighting: Literal["uniform", "data_size"] = "uniform"


class FedMBOConfig(_Strict):
    """FedMBO baseline (Alg. 1 + PHE Alg. 2 of ``papers/fedmbo.txt``): full model, minibatch
    SGD on y and a randomized Neumann hypergradient built across freshly sampled clients."""

    name: Literal["fedmbo"]
    inner_lr: float = Field(0.1, gt=0, description="beta")
    outer_lr: float = Field(0.1, gt=0, description="alpha")
    inner_steps: int = Field(5, ge=1, description="T, minibatch-SGD rounds on y")
    batch_size: int = Field(32, ge=1, description="S")
    outer_batch_size: int = Field(32, ge=1)
    neumann_terms: int = Field(10, ge=1, description="N")
    eta: float = Field(0.1, gt=0, description="1 / l_g,1")
    clients_per_phase: int | None = Field(None, ge=1, description="n; default all available")
    max_hypergrad_norm: float | None = Field(None, gt=0)
    weighting: Literal["uniform", "data_size"] = "uniform"


class FedMSAConfig(_Strict):
    """FedMSA baseline (Alg. 1 with eq. (10) of ``papers/fedmsa.txt``): momentum directions
    from all sampled clients, then K local variance-reduced steps on one of them."""

    name: Literal["fedmsa"]
    outer_lr: float = Field(0.05, gt=0, description="alpha")
    inner_lr: float = Field(0.1, gt=0, description="beta_w")
    v_lr: float = Field(0.1, gt=0, description="beta_v")
    momentum: float = Field(0.5, ge=0, le=1, description="rho")
    local_steps: int = Field(5, ge=1, description="K")
    batch_size: int = Field(32, ge=1)
    outer_batch_size: int = Field(32, ge=1)
    weighting: Literal["uniform", "data_size"] = "uniform"


AlgorithmConfig = Annotated[
    RABOConfig | SimFBOConfig | FedMBOConfig | FedMSAConfig, Field(discriminator="name")
]


class BaselineConfig(_Strict):
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
    terms: int = Field(10, ge=1, description="Neumann terms")
    eta: float = Field(0.1, gt=0, description="Neumann step")
    clients_per_phase: int | None = Field(None, ge=1, description="FedMBO's n")


class RunConfig(_Strict):
    """A whole run: what ``radbo run CONFIG.toml`` reads."""

    seed: int = 0
    rounds: int = Field(50, ge=1)
    eval_every: int = Field(5, ge=1)
    output_dir: str = "runs/radbo"
    checkpoint_every: int | None = Field(
        None, ge=1, description="write a checkpoint every N rounds (and after the last)"
    )
    data: DataConfig = Field(default_factory=DigitsData)
    partition: Partition = Field(default_factory=DirichletPartition)
    model: ModelConfig = Field(default_factory=MLPModel)
    task: TaskConfig = Field(default_factory=HyperRepresentationTask)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    mask: MaskConfig = Field(default_factory=MaskConfig)
    algorithm: AlgorithmConfig = Field(default_factory=RABOConfig)
    estimator: EstimatorConfig = Field(default_factory=CGEstimator)
    baseline: BaselineConfig = Field(default_factory=BaselineConfig)

    @model_validator(mode="after")
    def _check_task_and_model(self) -> RunConfig:
        # tasks whose x lives in a dedicated model, and that model
        for task, model in (("feature_l2", "logistic"), ("vs_loss", "vs_mlp")):
            if (self.task.name == task) != (self.model.name == model):
                raise ValueError(
                    f"task {self.task.name!r} does not go with model {self.model.name!r}: "
                    f'task "{task}" needs model "{model}" and model "{model}" needs task '
                    f'"{task}"'
                )
        hpo = self.task.name == "feature_l2"
        if hpo and self.mask.policy != "none":
            raise ValueError(
                'task "feature_l2" has nothing to prune (x is not in the forward pass and the '
                f'classifier keeps its outputs); set [mask] policy = "none" (got '
                f"{self.mask.policy!r})"
            )
        return self

    @model_validator(mode="after")
    def _check_full_model_baselines(self) -> RunConfig:
        if self.algorithm.name in ("fedmbo", "fedmsa") and self.mask.policy != "none":
            raise ValueError(
                f"algorithm {self.algorithm.name} trains the full model on every client; set "
                f'[mask] policy = "none" (got {self.mask.policy!r})'
            )
        return self

    @model_validator(mode="after")
    def _check_rafbo(self) -> RunConfig:
        if self.algorithm.name == "rafbo" and self.estimator.name != "finite_difference":
            raise ValueError(
                f"algorithm rafbo is RABO with the finite_difference estimator; got estimator "
                f"{self.estimator.name!r} (use algorithm rabo for other estimators)"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_tags(cls, data: Any) -> Any:
        # A section given without its tag key means the default kind, as when it is absent.
        if not isinstance(data, dict):
            return data
        data = dict(data)
        algorithm = data.get("algorithm")
        if isinstance(algorithm, dict) and algorithm.get("name") == "rafbo":
            data.setdefault("estimator", {"name": "finite_difference"})
        for section, key, default in _DEFAULT_TAGS:
            value = data.get(section)
            if isinstance(value, dict) and key not in value:
                data[section] = {key: default, **value}
        return data


_DEFAULT_TAGS = (
    ("data", "name", "digits"),
    ("partition", "kind", "dirichlet"),
    ("model", "name", "mlp"),
    ("algorithm", "name", "rabo"),
    ("estimator", "name", "cg"),
    ("task", "name", "hyper_representation"),
)


_TAGS = {
    "digits", "mnist", "cifar10", "iid", "shards", "dirichlet", "mlp", "cnn", "cnn7", "resnet12",
    "resnet18", "cg", "neumann", "finite_difference",
    "first_order", "rabo", "rafbo", "simfbo", "shrofbo", "fedmbo", "fedmsa", "logistic",
    "hyper_representation", "feature_l2", "vs_mlp", "vs_loss",
}  # fmt: skip
_TYPE_ERRORS = {"list_type", "dict_type", "model_type", "float_type", "int_type", "string_type"}


def _location(loc: tuple[Any, ...]) -> str:
    # pydantic puts discriminator tags and union member types ("list[...]") in the location
    # of union members; drop both.
    parts = [
        str(p)
        for p in loc
        if not (isinstance(p, str) and (p in _TAGS or "[" in p or p.startswith("function-")))
    ]
    return ".".join(parts) or "<root>"


def format_validation_error(error: ValidationError) -> str:
    """One line per problem: ``config error: FIELD = VALUE: what is allowed``.

    For a field that accepts several types (a union), errors saying "not this type" are
    dropped when another member reports a real problem, and merged into one line otherwise.
    """
    rows = []
    for e in error.errors():
        msg = e["msg"]
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
        value_text = "{...}" if isinstance(value, dict) else repr(value)
        rest = [m.removeprefix("Input should be ") for m in msgs[1:]]
        text = " or ".join([msgs[0], *rest])
        if where == "<root>":  # a rule across sections: no single field to name
            lines.append(f"config error: {text.removeprefix('Value error, ')}")
        else:
            lines.append(f"config error: {where} = {value_text}: {text}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any]) -> RunConfig:
    """Validate a config mapping; raises :class:`ConfigError` with a readable message."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a TOML run configuration."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config error: {path} does not exist or is not a file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"config error: {path} is not valid TOML: {err}") from None
    return parse_config(data)
