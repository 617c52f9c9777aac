"""The divergence guard around the engine's rounds: judge each round, roll back, damp.

:class:`DivergenceWatch` wraps :meth:`radbo.simulation.Simulation.iterate`'s rounds rather
than observing them: a diverged round can replace the state the round left (a rollback) and
the algorithm later rounds run (its step sizes damped), so it is a step of the loop, with
the :class:`~radbo.simulation.divergence.DivergenceGuard`'s running values, the good state
before the last good one and the algorithm as configured as its state. The rules are those
of :mod:`radbo.simulation.divergence`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from radbo.checkpoint import state_from_tensors, state_to_tensors
from radbo.simulation.divergence import (
    MAX_ROLLBACKS,
    DivergenceError,
    DivergenceGuard,
    round_losses,
    state_rms,
)
from radbo.typing import Params

__all__ = ["DivergenceWatch"]

#: key prefix of the guard's earlier good state among the engine's checkpoint tensors
PREVIOUS = "divergence_previous/"


class JudgedRound(Protocol):
    """What the watch reads from a round's record and writes into it
    (:class:`radbo.simulation.RoundRecord`)."""

    round: int
    metrics: dict[str, float]
    evaluation: dict[str, float] | None
    divergence: dict[str, Any] | None


@dataclass
class DivergenceWatch:
    """The divergence guard of a run, with what a rollback needs.

    Attributes:
        guard: the guard's settings and running values.
        undamped: the algorithm as configured, once a rollback damped it (``None`` before).
        previous: the good state before the last good one (a training loss that trips the
            guard was measured at the last good state, so a rollback goes back to this one),
            ``None`` when not known.
        current: the state the last judged round left.
        saved_previous: ``previous`` as restored from a checkpoint, ``(tensors, scalars)``,
            until :meth:`begin` has a state to shape it like.
    """

    guard: DivergenceGuard
    undamped: Any = None
    previous: Any = None
    current: Any = None
    saved_previous: tuple[dict[str, Tensor], dict[str, Any]] | None = None

    @classmethod
    def of(cls, algorithm: Any) -> DivergenceWatch | None:
        """The watch ``algorithm``'s ``divergence*`` settings configure (``None``: off)."""
        guard = DivergenceGuard.of(algorithm)
        return None if guard is None else cls(guard)

    def begin(self, state: Any, algorithm: Any, start_round: int) -> None:
        """Get ready to judge rounds from ``state`` on (``start_round`` rounds done): a guard
        not resumed takes ``state`` as good; the state before it is the restored one, or
        unknown unless ``state`` is where the last judged round left off."""
        if self.guard.largest_norm is None:  # not resumed: the start is good
            self.guard.start(state_rms(state, algorithm.model_state(state)), start_round)
        if self.saved_previous is not None:  # resumed: shaped like the state it precedes
            self.previous = state_from_tensors(state, *self.saved_previous)
            self.saved_previous = None
        elif state is not self.current:  # not where the last round left off: unknown
            self.previous = None

    def judge(
        self,
        algorithm: Any,
        before: Any,
        after: Any,
        record: JudgedRound,
        evaluate: Callable[[Params], dict[str, float]] | None,
    ) -> tuple[Any, Any]:
        """The state a round from ``before`` to ``after`` leaves under the guard, and the
        algorithm later rounds run: ``after`` and ``algorithm`` when the round is sound (or
        the policy only warns); on a rollback the last good state ``before`` -- or, when a
        training loss tripped the guard, the one before it (:attr:`previous`): a round's
        training losses are measured at the state it starts from, so they show ``before``
        bad -- and ``algorithm`` damped. ``record.divergence`` says what happened; a rolled
        back round's evaluation (by ``evaluate``) is of the state rolled back to."""
        guard = self.guard
        losses = round_losses(record.metrics, record.evaluation)
        norm = state_rms(after, algorithm.model_state(after))
        q = record.round
        reason = guard.check(losses, norm)
        if reason is None:
            guard.accept(losses, norm, q + 1)
            return self._leave(after, before), algorithm
        if guard.policy == "stop":
            raise DivergenceError(
                f"divergence in round {q}: {reason}; stopped ([algorithm] divergence = "
                f'"stop"; "rollback" rolls back and damps the step sizes)'
            )
        if guard.policy == "warn":
            record.divergence = {"round": q, "reason": reason, "action": "warn"}
            if not guard.diverging:
                warnings.warn(
                    f"divergence in round {q}: {reason}; continuing ([algorithm] divergence "
                    '= "warn")',
                    RuntimeWarning,
                    stacklevel=3,
                )
            guard.diverging = True
            return self._leave(after, before), algorithm
        if guard.rollbacks >= MAX_ROLLBACKS:
            raise DivergenceError(
                f"divergence in round {q}: {reason}; still diverging after {MAX_ROLLBACKS} "
                f"rollbacks (step sizes x {guard.lr_scale:.3g}); lower the step sizes"
            )
        guard.rollbacks += 1
        guard.diverging = True
        algorithm = self._damped(algorithm)
        target, earlier = before, self.previous
        if guard.tripped_training_loss and self.previous is not None and guard.good_rounds > 0:
            target, earlier = self.previous, None
            guard.good_rounds -= 1
        record.divergence = {
            "round": q,
            "reason": reason,
            "action": "rollback",
            "rolled_back_to": guard.good_rounds,
            "lr_scale": guard.lr_scale,
        }
        if record.evaluation is not None and evaluate is not None:
            record.divergence["evaluation"] = record.evaluation
            record.evaluation = evaluate(algorithm.model_state(target))
        return self._leave(target, earlier), algorithm

    def _leave(self, state: Any, previous: Any) -> Any:
        """``state``, now the current one, with ``previous`` the good state before it."""
        self.previous, self.current = previous, state
        return state

    def _damped(self, algorithm: Any) -> Any:
        """The configured algorithm (``algorithm`` before the first rollback) with its step
        sizes x the guard's ``lr_scale``."""
        if self.undamped is None:
            self.undamped = algorithm
        damped = getattr(self.undamped, "damped", None)
        if damped is None:
            raise DivergenceError(
                f"divergence: {type(self.undamped).__name__} has no step sizes to damp; "
                'set [algorithm] divergence = "stop" or "off"'
            )
        return damped(self.guard.lr_scale)

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The guard's running values (``"divergence"``) and the good state before the last
        good one, as ``divergence_previous/...`` tensors and its scalars
        (``"divergence_previous"``), for the engine's checkpoint state."""
        tensors: dict[str, Tensor] = {}
        data: dict[str, Any] = {"divergence": self.guard.state_dict()}
        if self.previous is not None:
            previous, scalars = state_to_tensors(self.previous)
            tensors.update({f"{PREVIOUS}{k}": t for k, t in previous.items()})
            data["divergence_previous"] = scalars
        return tensors, data

    @classmethod
    def restored(
        cls,
        undamped: Any,
        tensors: Mapping[str, Tensor],
        meta: Mapping[str, Any],
        template: Any = None,
    ) -> tuple[DivergenceWatch | None, Any, set[str]]:
        """The watch of the configured algorithm ``undamped`` with :meth:`state_dict` output
        restored from the engine's checkpoint state ``(tensors, meta)``, the algorithm it runs
        (damped after rollbacks) and the names of the tensors it took. ``ValueError`` (or
        :class:`~radbo.checkpoint.CheckpointError` from the state before the last good one,
        when it is not shaped like ``template``) when they do not fit; a state written before
        the guard existed has none: the guard starts afresh, as then."""
        guard = DivergenceGuard.of(undamped)
        saved = meta.get("divergence")
        if guard is None:
            if saved is not None:
                raise ValueError("the engine state has a divergence guard state; this run's is off")
            return None, undamped, set()
        algorithm = undamped
        if saved is not None:
            guard.load_state_dict(saved)
            if guard.rollbacks:
                damped = getattr(undamped, "damped", None)
                if damped is None:
                    raise ValueError(
                        f"the divergence guard rolled back {guard.rollbacks} times, but "
                        f"{type(undamped).__name__} has no step sizes to damp"
                    )
                algorithm = damped(guard.lr_scale)
        watch = cls(guard, undamped=None if algorithm is undamped else undamped)
        scalars = meta.get("divergence_previous")
        if scalars is None:
            return watch, algorithm, set()
        previous = {k[len(PREVIOUS) :]: t for k, t in tensors.items() if k.startswith(PREVIOUS)}
        if not isinstance(scalars, Mapping):
            raise ValueError("the divergence guard's previous state has no scalars")
        if template is not None:  # the state it must fit (begin rebuilds it from this)
            state_from_tensors(template, previous, scalars)
        watch.saved_previous = (previous, dict(scalars))
        return watch, algorithm, {f"{PREVIOUS}{k}" for k in previous}
