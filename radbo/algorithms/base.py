"""The ``[algorithm]`` section and what every algorithm shares.

An algorithm is two classes in one file:

* its **config** -- a :class:`AlgorithmConfig` subclass registered in :data:`ALGORITHMS`, whose
  fields are the algorithm's hyperparameters, each declared once (type, default, bounds,
  meaning), validated when a run config is read or the algorithm is constructed;
* the **algorithm** itself -- a subclass of that config adding only what a run wires in (which
  tensors are x, y and buffers, the estimator, ...) and the phases: state plus pure functions
  (see :class:`radbo.client.Phase`).

``config.build(wiring)`` turns the validated section into the algorithm for a run; the
Python API constructs the algorithm class directly with the same keyword arguments
(``RABO(inner_lr=0.5, outer_names=..., inner_names=...)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, TypeVar, cast

import torch
from pydantic import Field, model_validator

from radbo.hypergrad import ESTIMATORS, Estimator
from radbo.registry import Registry, Section
from radbo.typing import Params

__all__ = [
    "ALGORITHMS",
    "AlgorithmConfig",
    "Wiring",
    "clone",
    "draw_clients",
]

#: The registered ``[algorithm]`` kinds.
ALGORITHMS: Registry[AlgorithmConfig] = Registry("algorithm", "name")

A = TypeVar("A", bound="AlgorithmConfig")

#: How clients are weighted in aggregation: equally, or by their number of examples.
Weighting = Literal["uniform", "data_size"]

#: What the server does when a round blows up (see :mod:`radbo.simulation.divergence`).
Divergence = Literal["rollback", "stop", "warn", "off"]

#: The divergence guard's fields of every ``[algorithm]`` kind.
DIVERGENCE_FIELDS = (
    "divergence",
    "divergence_factor",
    "divergence_norm_factor",
    "divergence_damping",
)


@dataclass(frozen=True)
class Wiring:
    """What a run wires into an algorithm besides its hyperparameters.

    Attributes:
        outer_names / inner_names / buffer_names: which model tensors are x, y and buffers.
        estimator: the ``[estimator]`` (``None`` for an algorithm that takes none).
        aggregate_buffers: whether clients send BatchNorm running statistics to be averaged
            (``False``: static BatchNorm, recomputed on the server).
        budget_steps: whether each client's local-step count comes from its budget (the
            fleet's ``local_steps`` is not ``"fixed"``).
        seed: the seed of the algorithm's own server-side draws.
        population_steps: ``sum_j p_j tau_j`` over every client of the fleet (weights ``p``
            normalised), the mean local steps a round's full population would run; ShroFBO's
            printed rho needs it.
    """

    outer_names: tuple[str, ...]
    inner_names: tuple[str, ...]
    buffer_names: tuple[str, ...] = ()
    estimator: Estimator | None = None
    aggregate_buffers: bool = True
    budget_steps: bool = False
    seed: int = 0
    population_steps: float | None = None


class AlgorithmConfig(Section):
    """Base of every ``[algorithm]`` kind.

    Class attributes a kind sets:
        estimator_uses: what it can use an estimator for, in order of preference
            (``"hypergradient"``, ``"products"``, ``"penalty"``; see
            :class:`radbo.hypergrad.Estimator`). Every registered estimator offering one of
            them is accepted; ``()`` means it takes no estimator, and an ``[estimator]``
            section is refused. An estimator setting that does not matter for the use is
            refused too, rather than silently ignored.
        default_estimator: the estimator it runs with when the config has no ``[estimator]``.
        default_estimator_settings: settings of that default estimator other than its own
            defaults (FedSVRBGD-FO: the paper's penalty ``lam = 50``).
        estimators: the only estimator names it takes (RAFBO: ``("finite_difference",)``), or
            ``None`` (default): every registered estimator offering one of ``estimator_uses``.
        full_model: it trains the full model on every client (masks are refused).
        tasks: the only ``[task]`` kinds it runs on (ProtoNet: ``("few_shot",)``), or ``None``
            (default): every task; a config with another task is refused.
        flower_actions: the ``train.<action>`` Flower message types its phases use besides
            ``train`` (see :func:`radbo.flower.message_type`).
        step_sizes: its step-size fields, which the divergence guard damps together after a
            rollback (:meth:`damped`; default ``inner_lr`` and ``outer_lr``).

    The ``divergence*`` fields configure the server's divergence guard
    (:mod:`radbo.simulation.divergence`): what it does when a round's loss exceeds
    ``divergence_factor`` x its smoothed running minimum (and its first value), a loss or
    the model turns non-finite, or the RMS of the x and y entries jumps above
    ``divergence_norm_factor`` x its largest value so far (and above 1). Default: roll back
    to the last good round and multiply every step size by ``divergence_damping`` (0.5); a
    run that never trips it is unchanged, bit for bit.
    """

    name: str
    weighting: Weighting = Field(
        "uniform", description="client weights p_i: uniform, or proportional to data size"
    )
    divergence: Divergence = Field(
        "rollback",
        description="on a blow-up: roll back to the last good round and damp the step sizes, "
        "stop with an error, warn, or do nothing",
    )
    divergence_factor: float = Field(
        5.0,
        gt=1,
        le=1e6,
        allow_inf_nan=False,
        description="a round loss above this many times its smoothed running minimum (and "
        "above its first value) is a blow-up",
    )
    divergence_norm_factor: float = Field(
        10.0,
        gt=1,
        le=1e6,
        allow_inf_nan=False,
        description="rms(x, y) above this many times its largest value so far (and above 1) "
        "is a blow-up",
    )
    divergence_damping: float = Field(
        0.5,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="each rollback multiplies every step size by this",
    )

    estimator_uses: ClassVar[tuple[str, ...]] = ()
    default_estimator: ClassVar[str | None] = None
    default_estimator_settings: ClassVar[dict[str, Any]] = {}
    estimators: ClassVar[tuple[str, ...] | None] = None
    full_model: ClassVar[bool] = False
    tasks: ClassVar[tuple[str, ...] | None] = None
    flower_actions: ClassVar[tuple[str, ...]] = ()
    step_sizes: ClassVar[tuple[str, ...]] = ("inner_lr", "outer_lr")
    # the divergence settings came after configs were first stored (see Section)
    dump_omits_defaults: ClassVar[tuple[str, ...]] = DIVERGENCE_FIELDS

    if TYPE_CHECKING:
        # Every kind declares these fields itself (its own default, bounds and meaning); they
        # are named here for the type checker only, so that pydantic sees no field of the base.
        inner_lr: float
        outer_lr: float
        batch_size: int
        outer_batch_size: int

    def accepted_estimators(self) -> tuple[str, ...]:
        """The registered estimator names this config accepts (those of :attr:`estimators`
        among them, when it names some)."""
        return tuple(
            tag
            for tag in ESTIMATORS
            if ESTIMATORS[tag].capabilities & set(self.estimator_uses)
            and (self.estimators is None or tag in self.estimators)
        )

    def estimator_use(self, estimator: Estimator) -> str | None:
        """What this algorithm uses ``estimator`` for (``None`` if nothing)."""
        return next((u for u in self.estimator_uses if u in estimator.capabilities), None)

    @property
    def local_steps_default(self) -> int:
        """The local steps every client runs when the fleet does not set them (T, tau, K)."""
        raise NotImplementedError

    def baseline_settings(self) -> dict[str, Any]:
        """The settings a full-model baseline run of this config reuses: step sizes, local
        steps, batch sizes, client weighting and hypergradient clipping."""
        return {
            "inner_lr": self.inner_lr,
            "outer_lr": self.outer_lr,
            "inner_steps": self.local_steps_default,
            "batch_size": self.batch_size,
            "outer_batch_size": self.outer_batch_size,
            "weighting": self.weighting,
            "max_hypergrad_norm": getattr(self, "max_hypergrad_norm", None),
            **self.divergence_settings(),
        }

    def divergence_settings(self) -> dict[str, Any]:
        """The ``divergence*`` fields, which a paired baseline run reuses."""
        return {name: getattr(self, name) for name in DIVERGENCE_FIELDS}

    def damped(self, scale: float) -> Self:
        """A copy with every step size (:attr:`step_sizes`) multiplied by ``scale``; all else,
        the estimator and the wiring included, is shared.

        >>> from radbo.algorithms import RABOConfig
        >>> RABOConfig(inner_lr=0.5, outer_lr=0.1).damped(0.25).inner_lr
        0.125
        """
        return self.model_copy(update={n: getattr(self, n) * scale for n in self.step_sizes})

    def build(self, wiring: Wiring) -> Any:
        """The algorithm this section configures, wired for a run."""
        raise NotImplementedError

    def bind(self, cls: type[A], wiring: Wiring, **extra: Any) -> A:
        """``cls`` (the algorithm class, a subclass of this config) with these validated
        hyperparameters and ``wiring``'s names, buffers mode and ``extra``; no second
        validation."""
        names = {
            "outer_names": tuple(wiring.outer_names),
            "inner_names": tuple(wiring.inner_names),
            "buffer_names": tuple(wiring.buffer_names),
            "aggregate_buffers": wiring.aggregate_buffers,
        }
        values = {k: getattr(self, k) for k in type(self).model_fields}
        fields = cls.model_fields
        wired = {k: v for k, v in {**names, **extra}.items() if k in fields}
        if wiring.estimator is not None and "estimator" in fields:
            wired["estimator"] = wiring.estimator
        # model_construct builds a ``cls``; the pydantic mypy plugin types it as the bound's
        return cast(A, cls.model_construct(**values, **wired))


class AlgorithmBase(Section):
    """Fields every algorithm class adds to its config: the wiring of a run. Constructing an
    algorithm checks the wiring: x and y are disjoint, and its ``estimator`` (if it has one)
    offers one of the config's ``estimator_uses`` and is one of its ``estimators`` (when the
    config names some)."""

    outer_names: tuple[str, ...]
    inner_names: tuple[str, ...]
    buffer_names: tuple[str, ...] = ()
    aggregate_buffers: bool = True

    @model_validator(mode="after")
    def _check_wiring(self) -> Self:
        owner = type(self).__name__
        if set(self.outer_names) & set(self.inner_names):
            raise ValueError(f"{owner}: outer and inner parameter names must be disjoint")
        estimator = getattr(self, "estimator", None)
        uses: tuple[str, ...] = getattr(self, "estimator_uses", ())
        if estimator is not None and not estimator.capabilities & set(uses):
            raise ValueError(
                f"{owner} needs an estimator offering {' or '.join(map(repr, uses))}; "
                f"{estimator.name!r} offers {sorted(estimator.capabilities)}"
            )
        only: tuple[str, ...] | None = getattr(self, "estimators", None)
        if estimator is not None and only is not None and estimator.name not in only:
            raise ValueError(
                f"{owner} takes estimator {' or '.join(map(repr, only))}; got {estimator.name!r}"
            )
        return self

    def model_state(self, state: Any) -> Params:
        """All model tensors (x, y and buffers) in full-model coordinates."""
        return {**state.x, **state.y, **state.buffers}

    def reply_keys(self, *groups: Iterable[str], buffers: bool = False) -> UpdateKeys:
        """A client work's ``update_keys``: the names in ``groups``, and the buffer names when
        ``buffers`` and the algorithm aggregates them (``aggregate_buffers``)."""
        names = [n for group in groups for n in group]
        if buffers and self.aggregate_buffers:
            names += self.buffer_names
        return UpdateKeys(frozenset(names))

    def client_tensors(self, runtime: Any, cohort: Any) -> tuple[Any, Params, Params, Params]:
        """A cohort's module, x, y and (cloned, so local BatchNorm updates stay local)
        buffers."""
        module = cohort.module(runtime)
        x = cohort.params(self.outer_names)
        y = cohort.params(self.inner_names)
        buffers = cohort.params(self.buffer_names, clone=True)
        return module, x, y, buffers


@dataclass(frozen=True)
class UpdateKeys:
    """The exact update keys of a client work whose replies do not depend on the task
    (:attr:`radbo.client.ClientWork.update_keys`)."""

    keys: frozenset[str]

    def __call__(self, task: Any) -> frozenset[str]:
        return self.keys


def prefixed(prefix: str, names: Iterable[str]) -> list[str]:
    """``"prefix:name"`` for every name (:func:`radbo.masks.index.alias`'s keys)."""
    return [f"{prefix}:{n}" for n in names]


def clone(tensors: Params) -> Params:
    """Detached copies of ``tensors``."""
    return {k: t.detach().clone() for k, t in tensors.items()}


def draw_clients(candidates: Sequence[int], k: int | None, generator: torch.Generator) -> list[int]:
    """``k`` of ``candidates`` drawn uniformly without replacement, in random order (all of
    them when ``k`` is ``None`` or not smaller): one ``randperm`` of ``len(candidates)`` from
    ``generator`` either way."""
    order = torch.randperm(len(candidates), generator=generator)
    if k is not None:
        order = order[:k]
    return [candidates[i] for i in order.tolist()]
