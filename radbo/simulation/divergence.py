"""Keeping a run from blowing up: the divergence guard and the task's box on x.

**The divergence guard** (``[algorithm] divergence``, fields of
:class:`radbo.algorithms.AlgorithmConfig`). After every round the server looks at what it
already has: the round's losses (every metric named ``*loss``: ``outer_loss``,
``inner_loss``, ``train_loss``, ...; the test loss of the rounds it evaluates, as
``test_loss``) and the root mean square of its x and y entries, ``rms(x, y) = ||(x, y)|| /
sqrt(number of entries)`` (in float64). A round *diverged* when

* the model holds NaN or Inf, or a loss is +-Inf (or the test loss is NaN);
* ``rms(x, y)`` jumps above ``divergence_norm_factor`` (10) x its largest value so far and
  above 1. The second condition gives the jump a scale: a state that starts at zeros grows
  by large factors in its first rounds (measured: SimFBO on a 3-dimensional quadratic from
  x = y = 0, rms 0.002 -> 0.24 in round 1), while a blow-up takes the entries far past the
  size trained weights have (``feature_l2``: 1.487 -> 757.3 in one round);
* a loss exceeds ``divergence_factor`` (5) x its running minimum *and* its first value.
  The running minimum is that of the loss smoothed over rounds (an exponential moving
  average, weight :data:`SMOOTHING` 0.9 on the past): the minimum of the raw minibatch
  losses is their luckiest draw, and an ordinary batch ten times above it is noise, not a
  blow-up (measured: RABO on ``feature_l2`` with minibatches of 32 had a raw minimum of
  0.059 and a batch at 0.589 in round 1211 of an otherwise sound run). The first-value
  condition keeps a loss that shrinks towards 0 (a training loss on a fitted model) from
  tripping it on noise; a loss whose first value is 0 (a toy problem started at its
  optimum) has no scale to compare with and is left to the other checks. The losses are the
  raw ones: a blow-up trips the round it shows.
  Why 5: in sound runs the largest raw loss above its first value was 2.8 x its smoothed
  minimum (that ``feature_l2`` run, 1,500 rounds; in the examples' runs no loss ever rose
  above its first value), and the unclipped non-iid demo, whose model decays over a few
  rounds before its norm jumps, is caught in round 10 at 5 (inner loss 10.1 against a
  smoothed minimum near 1.6) but only at the jump in round 11 at 10, when the last good
  state is already at chance accuracy.

A round metric that is NaN means no client's result reached that phase (every update was
rejected or lost, see :meth:`radbo.simulation.Simulation.step`): nothing was measured, so
it is not a divergence. Only rounds that pass update the smoothed losses, their minima, the
first values and the largest norm. On a divergence the policy decides:

* ``"rollback"`` (default): the state goes back to the last good round's (the previous
  state, restored exactly; the clock and the ledger keep the diverged round's cost) -- or,
  when a training loss (a ``*loss`` metric other than the test loss) tripped the guard, to the
  good state before that one: a round's training losses are measured at the state it starts
  from (the inner loss along its inner steps from it, the outer loss at its x), so they show
  that state bad, whose own round passed before its last step was ever evaluated (measured on
  few-shot Omniglot without clipping: restoring it made every later round trip again, at any
  step size; ``BENCHMARKS.md``, "RABO on Omniglot"). That earlier state is part of the
  engine's checkpointed state, so a resumed run rolls back alike. Then every
  step size of the algorithm (its ``step_sizes``) is multiplied by ``divergence_damping``
  (0.5) -- the damped algorithm runs all later rounds, server and client work alike -- and
  the round's record says so (``record["divergence"]``). Damping all step sizes rather than
  guessing which one diverged is deliberate: the server sees a blow-up, not its cause (in
  the ``feature_l2`` case the inner step became unstable because the outer step drove x
  there). After :data:`MAX_ROLLBACKS` rollbacks the run stops with :class:`DivergenceError`.
* ``"stop"``: :class:`DivergenceError` (``radbo run`` prints its one line, exit code 2).
* ``"warn"``: a :class:`RuntimeWarning` when a divergence starts, the record of every
  diverged round says so, and the run goes on with the diverged state.
* ``"off"``: nothing is watched.

The guard only reads, so a run that never trips it is bitwise the run without it. Its
running values are part of :meth:`radbo.simulation.Simulation.state_dict`, so a resumed run
makes the same rollbacks with the same damped step sizes.

**The box on x.** A task whose inner curvature moves with x (``feature_l2``: the per-feature
L2 weight ``exp(x_j)`` is part of g's Hessian in y) can bound x so that the algorithm's inner
step on g stays stable: :class:`BoxedProblem`. The engine projects the state's x onto the
box after every round (a projected step on x); see :class:`radbo.tasks.FeatureL2`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, is_dataclass, replace
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from radbo.schema import is_finite, short
from radbo.typing import Params

__all__ = [
    "check_guard_history",
    "replay_test_loss",
    "MAX_ROLLBACKS",
    "SMOOTHING",
    "BoxedProblem",
    "DivergenceError",
    "DivergenceGuard",
    "project_outer",
    "state_rms",
]

#: Rollbacks after which a ``"rollback"`` run gives up (step sizes x 0.5**20, about 1e-6).
MAX_ROLLBACKS = 20

#: Weight of the past in the smoothed losses whose running minimum the guard compares with.
SMOOTHING = 0.9

Policy = Literal["rollback", "stop", "warn", "off"]
Bounds = Mapping[str, tuple[float | None, float | None]]


class DivergenceError(RuntimeError):
    """A run diverged and its ``[algorithm] divergence`` policy is ``"stop"``, or rolling
    back and damping did not stop it; the message is one line for the user."""


@runtime_checkable
class BoxedProblem(Protocol):
    """A bilevel problem that bounds its outer variable x."""

    def outer_bounds(self, inner_lr: float | None) -> Bounds:
        """``{x tensor name: (lower, upper)}`` (``None``: unbounded that side) keeping a
        gradient step of size ``inner_lr`` on g stable (``inner_lr`` is ``None`` for an
        algorithm without one)."""
        ...


def project_outer(state: Any, bounds: Bounds) -> Any:
    """``state`` with each bounded tensor of its ``x`` clamped into its box (a dataclass state
    with an ``x`` field; anything else is returned as it is). Values inside the box are kept
    bit for bit.

    >>> from radbo.algorithms import RABOState
    >>> s = RABOState(x={"a": torch.tensor([-1.0, 3.0])}, y={}, buffers={})
    >>> project_outer(s, {"a": (None, 2.0)}).x["a"].tolist()
    [-1.0, 2.0]
    """
    if not bounds or not is_dataclass(state) or isinstance(state, type):
        return state
    x = getattr(state, "x", None)
    if not isinstance(x, Mapping):
        return state
    boxed = {name: t if name not in bounds else t.clamp(*bounds[name]) for name, t in x.items()}
    return replace(state, x=boxed)


def state_rms(state: Any, model_state: Params) -> float:
    """``rms(x, y) = ||(x, y)|| / sqrt(entries)`` of an algorithm state in float64 (``x`` and
    ``y`` fields; all of ``model_state`` for a state without them; 0 without entries); NaN
    when any model tensor (buffers included) holds NaN or Inf. One read from the device for
    the whole state.

    >>> from radbo.algorithms import RABOState
    >>> state = RABOState(x={"a": torch.tensor([3.0, 4.0])}, y={"b": torch.zeros(2)}, buffers={})
    >>> state_rms(state, {})
    2.5
    """
    x, y = getattr(state, "x", None), getattr(state, "y", None)
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        tensors = [*x.values(), *y.values()]
    else:
        tensors = list(model_state.values())
    tensors = [t for t in tensors if t.is_floating_point()]
    squares = [t.detach().double().pow(2).sum() for t in tensors]
    finite = [torch.isfinite(t).all() for t in model_state.values() if t.is_floating_point()]
    entries = sum(t.numel() for t in tensors)
    if entries == 0:
        return 0.0
    total = torch.stack(squares).sum()
    if finite:
        total = torch.where(torch.stack(finite).all(), total, torch.nan)
    return math.sqrt(float(total) / entries)


def round_losses(
    metrics: Mapping[str, Any], evaluation: Mapping[str, float] | None
) -> dict[str, float]:
    """The losses the guard watches in a round: its ``*loss`` metrics, and the test loss
    (``test_loss``) when it was evaluated."""
    out = {
        k: float(v)
        for k, v in metrics.items()
        if k.endswith("loss") and isinstance(v, int | float) and not isinstance(v, bool)
    }
    if evaluation is not None and "loss" in evaluation:
        out["test_loss"] = float(evaluation["loss"])
    return out


@dataclass
class DivergenceGuard:
    """The running values of the divergence guard and its settings (see the module).

    Attributes:
        policy / factor / norm_factor / damping: the ``[algorithm] divergence*`` settings.
        first: each watched loss's first value.
        smoothed / lowest: each watched loss smoothed over good rounds (exponential moving
            average, starting at its first value) and the smallest value of that average.
        largest_norm: the largest ``rms(x, y)`` over good rounds (and the start).
        good_rounds: rounds done at the last good state (the state a rollback restores).
        rollbacks: rollbacks so far; the step sizes run at ``damping ** rollbacks``.
        diverging: the last round diverged (``"warn"`` warns once per episode).
    """

    policy: Policy = "rollback"
    factor: float = 5.0
    norm_factor: float = 10.0
    damping: float = 0.5
    first: dict[str, float] = field(default_factory=dict)
    smoothed: dict[str, float] = field(default_factory=dict)
    lowest: dict[str, float] = field(default_factory=dict)
    largest_norm: float | None = None
    good_rounds: int = 0
    rollbacks: int = 0
    diverging: bool = False
    #: whether the last :meth:`check` found a training loss (a ``*loss`` metric other than
    #: ``test_loss``) diverged rather than the model, its norm or the test loss
    tripped_training_loss: bool = False

    @classmethod
    def of(cls, algorithm: Any) -> DivergenceGuard | None:
        """The guard ``algorithm``'s ``divergence*`` fields configure; ``None`` when it is
        ``"off"`` or the algorithm has no such fields."""
        policy: Policy = getattr(algorithm, "divergence", "off")
        if policy == "off":
            return None
        return cls(
            policy=policy,
            factor=float(algorithm.divergence_factor),
            norm_factor=float(algorithm.divergence_norm_factor),
            damping=float(algorithm.divergence_damping),
        )

    @property
    def lr_scale(self) -> float:
        """The factor on every step size after the rollbacks so far."""
        return float(self.damping**self.rollbacks)

    def start(self, norm: float, rounds_done: int) -> None:
        """Take the starting state (after ``rounds_done`` rounds, ``rms(x, y) = norm``) as
        good."""
        self.largest_norm = norm if math.isfinite(norm) else 0.0
        self.good_rounds = rounds_done

    def check(self, losses: Mapping[str, float], norm: float) -> str | None:
        """Why a round with these losses and ``rms(x, y) = norm`` diverged, or ``None``
        (:attr:`tripped_training_loss` says whether a training loss was the reason)."""
        self.tripped_training_loss = False
        if math.isnan(norm):
            return "the model holds NaN or Inf"
        if math.isinf(norm):
            return "rms(x, y) overflows float64"
        top = self.largest_norm or 0.0
        if norm > self.norm_factor * top and norm > 1.0:
            return (
                f"rms(x, y) = {norm:.4g} jumped above {self.norm_factor:g} x its largest "
                f"value so far, {top:.4g}"
            )
        for key, value in losses.items():
            if math.isinf(value) or (math.isnan(value) and key == "test_loss"):
                self.tripped_training_loss = key != "test_loss"
                return f"{key} is {value}"
            if math.isnan(value) or key not in self.lowest or not self.first[key] > 0:
                continue  # nothing measured, nothing to compare with, or no scale (first 0)
            low, first = self.lowest[key], self.first[key]
            if value > self.factor * low and value > first:
                self.tripped_training_loss = key != "test_loss"
                return (
                    f"{key} = {value:.4g} rose above {self.factor:g} x its (smoothed) running "
                    f"minimum {low:.4g} and above its first value {first:.4g}"
                )
        return None

    def accept(self, losses: Mapping[str, float], norm: float, rounds_done: int) -> None:
        """Fold a good round into the running values."""
        for key, value in losses.items():
            if math.isfinite(value):
                self.first.setdefault(key, value)
                past = self.smoothed.get(key, value)
                average = SMOOTHING * past + (1.0 - SMOOTHING) * value
                self.smoothed[key] = average
                self.lowest[key] = min(self.lowest.get(key, average), average)
        self.largest_norm = max(self.largest_norm or 0.0, norm)
        self.good_rounds = rounds_done
        self.diverging = False

    def state_dict(self) -> dict[str, Any]:
        """The running values, JSON-ready (for checkpoints)."""
        return {
            "first": dict(self.first),
            "smoothed": dict(self.smoothed),
            "lowest": dict(self.lowest),
            "largest_norm": self.largest_norm,
            "good_rounds": self.good_rounds,
            "rollbacks": self.rollbacks,
            "diverging": self.diverging,
        }

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ``ValueError`` for values it cannot have
        written (a non-finite or negative number, a rollback count outside 0 to
        :data:`MAX_ROLLBACKS`)."""
        first = {str(k): _finite(v, "first") for k, v in data["first"].items()}
        smoothed = {str(k): _finite(v, "smoothed") for k, v in data["smoothed"].items()}
        lowest = {str(k): _finite(v, "lowest") for k, v in data["lowest"].items()}
        norm = data["largest_norm"]
        largest = None if norm is None else _finite(norm, "largest_norm")
        rollbacks, good = data["rollbacks"], data["good_rounds"]
        if not (type(rollbacks) is int and 0 <= rollbacks <= MAX_ROLLBACKS):
            raise ValueError(f"divergence rollbacks = {rollbacks!r}, not in 0..{MAX_ROLLBACKS}")
        if not (type(good) is int and good >= 0):
            raise ValueError(f"divergence good_rounds = {good!r}, not a count")
        if largest is not None and largest < 0:
            raise ValueError(f"divergence largest_norm = {largest!r} < 0")
        if not first.keys() == smoothed.keys() == lowest.keys():
            raise ValueError("divergence first, smoothed and lowest name different losses")
        self.first, self.smoothed, self.lowest = first, smoothed, lowest
        self.largest_norm = largest
        self.good_rounds, self.rollbacks = good, rollbacks
        self.diverging = bool(data["diverging"])


def _finite(value: Any, name: str) -> float:
    """``value`` as a float, when it is a finite number (``ValueError`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"divergence {name} holds {value!r}, not a finite number")
    return float(value)


def check_guard_history(guard: Mapping[str, Any], rows: list[dict[str, Any]]) -> None:
    """A checkpoint's divergence-guard state (its JSON) against its round records: its
    rollbacks are the rounds that rolled back, its last good round the one the rounds leave
    (each round that passed moves it to its end, a rollback to where it rolled back to), and it
    is diverging when the last round diverged; raises ``ValueError`` saying what does not
    fit."""
    good: Any = 0
    rollbacks = 0
    for row in rows:
        divergence = row.get("divergence")
        if divergence is None:
            good = row["round"] + 1
        elif not isinstance(divergence, dict) or divergence.get("action") not in (
            "rollback",
            "warn",
        ):
            raise ValueError(f"round {row['round']}'s divergence is {short(divergence)}")
        elif divergence["action"] == "rollback":
            rollbacks += 1
            good = divergence.get("rolled_back_to")
    found = {
        "good_rounds": good,
        "rollbacks": rollbacks,
        "diverging": bool(rows) and "divergence" in rows[-1],
    }
    for key, value in found.items():
        saved = guard.get(key)
        if saved != value or type(saved) is not type(value):
            raise ValueError(
                f"the divergence guard's {key} is {short(saved)}, but the rounds give {value!r}"
            )


def replay_test_loss(
    guard: dict[str, Any], rows: list[dict[str, Any]], smoothing: float = SMOOTHING
) -> None:
    """Set the guard's first, smoothed and lowest ``test_loss`` (its JSON state ``guard``) to
    what :meth:`DivergenceGuard.accept` makes of the test losses of ``rows`` that passed the
    guard (rows without ``divergence``), in order."""
    first: float | None = None
    smoothed: float | None = None
    lowest: float | None = None
    for row in rows:
        value = row.get("test_loss")
        if "divergence" in row or not is_finite(value):
            continue
        value = float(value)
        if first is None:
            first = value
        past = value if smoothed is None else smoothed
        smoothed = smoothing * past + (1.0 - smoothing) * value
        lowest = smoothed if lowest is None else min(lowest, smoothed)
    for part, figure in (("first", first), ("smoothed", smoothed), ("lowest", lowest)):
        values = guard[part]
        if figure is None:
            values.pop("test_loss", None)
        else:
            values["test_loss"] = figure
