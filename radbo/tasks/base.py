"""The ``[task]`` section: which bilevel problem (inner and outer losses) a run solves."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from radbo.registry import Registry, Section

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
    """

    name: str

    model: ClassVar[str | None] = None
    maskable: ClassVar[bool] = True

    def build(self, train: Any) -> Any:
        """The :class:`~radbo.problem.BilevelProblem` for the training set ``train``."""
        raise NotImplementedError
