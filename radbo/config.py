"""Typed run configuration (pydantic v2), parsed from TOML at the edge (CLI or :func:`load_config`).

Every model forbids unknown keys, so a typo is an error that names the field. Validation
errors are turned into one line per problem by :func:`format_validation_error`:
``config error: algorithm.inner_lr = -1.0: Input should be greater than 0``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration file is missing, unreadable or invalid; the message is user-facing."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- data -----------------------------------------------------------------------------------
class DigitsData(_Strict):
    """scikit-learn's bundled handwritten digits (1797 8x8 images, no download)."""

    name: Literal["digits"] = "digits"
    test_fraction: float = Field(0.2, gt=0, lt=1, description="held-out test share")
    outer_fraction: float = Field(
        0.3, gt=0, lt=1, description="share of each client's data used by the outer loss f_i"
    )


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
class MLPModel(_Strict):
    """Digits MLP: hidden layers are x, the head is y."""

    name: Literal["mlp"] = "mlp"
    hidden: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [128], min_length=1)


class CNNModel(_Strict):
    """Small CNN with BatchNorm: conv backbone is x, head is y."""

    name: Literal["cnn"] = "cnn"
    channels: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [16, 32], min_length=1
    )


ModelConfig = Annotated[MLPModel | CNNModel, Field(discriminator="name")]


class HyperRepresentationTask(_Strict):
    name: Literal["hyper_representation"] = "hyper_representation"
    inner_l2: float = Field(1e-2, ge=0, description="L2 weight on y making g strongly convex")


# -- fleet and masks ------------------------------------------------------------------------
class FleetConfig(_Strict):
    """Clients and their capacities. ``capacities`` is cycled over clients: client i gets
    ``capacities[i % len(capacities)]``."""

    num_clients: int = Field(10, ge=1)
    capacities: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: [1.0], min_length=1
    )
    clients_per_round: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_sample(self) -> FleetConfig:
        if self.clients_per_round is not None and self.clients_per_round > self.num_clients:
            raise ValueError(
                f"clients_per_round = {self.clients_per_round} exceeds num_clients = "
                f"{self.num_clients}"
            )
        return self


class MaskConfig(_Strict):
    """Mask policy (``none`` = every client trains the full model) and which blocks to mask."""

    policy: Literal["importance", "leading", "none"] = "importance"
    mask_x: bool = True
    mask_y: bool = True


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


EstimatorConfig = Annotated[CGEstimator | NeumannEstimator, Field(discriminator="name")]


class RABOConfig(_Strict):
    """RABO hyper-parameters (Alg. 1 of the RABO paper)."""

    name: Literal["rabo"] = "rabo"
    inner_lr: float = Field(0.1, gt=0, description="beta")
    outer_lr: float = Field(0.1, gt=0, description="alpha")
    inner_steps: int = Field(5, ge=1, description="T")
    batch_size: int = Field(32, ge=1)
    outer_batch_size: int = Field(32, ge=1)
    max_hypergrad_norm: float | None = Field(None, gt=0)
    weighting: Literal["uniform", "data_size"] = "uniform"


AlgorithmConfig = Annotated[RABOConfig, Field(discriminator="name")]


class RunConfig(_Strict):
    """A whole run: what ``radbo run CONFIG.toml`` reads."""

    seed: int = 0
    rounds: int = Field(50, ge=1)
    eval_every: int = Field(5, ge=1)
    output_dir: str = "runs/radbo"
    data: DigitsData = Field(default_factory=DigitsData)
    partition: Partition = Field(default_factory=DirichletPartition)
    model: ModelConfig = Field(default_factory=MLPModel)
    task: HyperRepresentationTask = Field(default_factory=HyperRepresentationTask)
    fleet: FleetConfig = Field(default_factory=FleetConfig)
    mask: MaskConfig = Field(default_factory=MaskConfig)
    algorithm: AlgorithmConfig = Field(default_factory=RABOConfig)
    estimator: EstimatorConfig = Field(default_factory=CGEstimator)


def _location(loc: tuple[Any, ...]) -> str:
    # pydantic puts the discriminator tag in the location of union members; drop it.
    parts = [str(p) for p in loc if not (isinstance(p, str) and p in _TAGS)]
    return ".".join(parts) or "<root>"


_TAGS = {
    "iid", "shards", "dirichlet", "mlp", "cnn", "cg", "neumann", "rabo",
}  # fmt: skip


def format_validation_error(error: ValidationError) -> str:
    """One line per problem: ``config error: FIELD = VALUE: what is allowed``."""
    lines = []
    for e in error.errors():
        where = _location(tuple(e["loc"]))
        value = e.get("input")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see the README for the allowed keys)"
        if isinstance(value, dict):
            value_text = "{...}"
        else:
            value_text = repr(value)
        lines.append(f"config error: {where} = {value_text}: {msg}")
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
