"""The ``[task]`` section: which bilevel problem (inner and outer losses) a run solves."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import Field
from torch import Tensor, nn

from radbo.data import DatasetSummary
from radbo.problem import ClientData, MinibatchSampler, Sampler
from radbo.registry import Registry, Section
from radbo.typing import Params

__all__ = ["TASKS", "InnerL2", "TaskConfig"]

#: The registered ``[task]`` kinds.
TASKS: Registry[TaskConfig] = Registry("task", "name")


def InnerL2(default: float) -> Any:  # noqa: N802 - a Field factory, named like a type
    """The ``inner_l2`` field every task has: the L2 weight on y that makes g strongly convex."""
    return Field(default, ge=0, allow_inf_nan=False, description="L2 weight mu on y in g")


class TaskConfig(Section):
    """Base of every ``[task]`` kind.

    Class attributes a kind sets:
        model: the ``[model]`` the task needs, when x lives in a dedicated model (``None``: any
            model without a task of its own).
        maskable: whether submodels make sense (``False`` when nothing can be pruned).
        episodic: a client's inner and outer minibatches come from the same examples (no
            ``outer_fraction`` split; e.g. few-shot episodes' support and query sets).

    Hooks a kind may override (defaults: the data as it is, uniform minibatches, one output per
    class, the standard test-set evaluation): :meth:`split_data`, :meth:`sampler`,
    :meth:`num_outputs`, :meth:`evaluator`.
    """

    name: str

    #: the models this task runs on (its x lives in them), or ``None``: any but those that
    #: name another task
    models: ClassVar[tuple[str, ...] | None] = None
    maskable: ClassVar[bool] = True
    episodic: ClassVar[bool] = False

    def build(self, train: DatasetSummary) -> Any:
        """The :class:`~radbo.problem.BilevelProblem` for the training set ``train``
        summarises (its labels, classes, sample shape and name; no features: a Flower node
        builds it holding only its own client's examples)."""
        raise NotImplementedError

    def split_data(self, train: Any, test: Any, disjoint: bool) -> tuple[Any, Any]:
        """The (training, test) sets the task runs on, from the data's splits (``disjoint``:
        the splits hold different classes, numbered independently)."""
        return train, test

    def sampler(self, train: Any, clients: Sequence[ClientData]) -> Sampler:
        """How clients draw their minibatches."""
        return MinibatchSampler()

    def num_outputs(self, train: Any) -> int:
        """The model's outputs for the training set ``train`` (default: one per class)."""
        return int(train.num_classes)

    def evaluator(
        self,
        model: nn.Module,
        test: Any,
        outer_names: Sequence[str],
        inner_names: Sequence[str],
        calibration: Tensor | None,
        seed: int,
    ) -> Callable[[Params], dict[str, float]] | None:
        """The task's own evaluation of a model state (``None``: test-set accuracy, balanced
        accuracy and loss of the model itself)."""
        return None
