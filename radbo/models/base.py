"""Base class of radbo's model zoo: a model that knows its outer (x) and inner (y) parameters."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field
from torch import Tensor, nn

from radbo.registry import Registry, Section


class BilevelModel(nn.Module):
    """An ``nn.Module`` whose parameters split into outer variables x and inner variables y.

    Subclasses set :attr:`inner_modules` (names of the submodules whose parameters are the
    inner variables y; every other parameter is outer, x), :attr:`output_layers` (layers whose
    output channels must never be pruned, e.g. the classifier) and :attr:`input_shape` (shape of
    one example, without the batch dimension), and list in :attr:`loss_only_parameters` any
    parameter only a loss reads.
    """

    inner_modules: tuple[str, ...] = ()
    output_layers: tuple[str, ...] = ()
    input_shape: tuple[int, ...] = ()
    #: parameters the forward pass does not use, only a loss (hyperparameters such as
    #: :class:`~radbo.models.logistic.FeatureL2Logistic`'s ``log_l2``); never pruned
    loss_only_parameters: tuple[str, ...] = ()

    def inner_param_names(self) -> list[str]:
        """Names (as in ``named_parameters``) of the inner variables y, in model order."""
        return [n for n, _ in self.named_parameters() if self._is_inner(n)]

    def outer_param_names(self) -> list[str]:
        """Names (as in ``named_parameters``) of the outer variables x, in model order."""
        return [n for n, _ in self.named_parameters() if not self._is_inner(n)]

    def _is_inner(self, name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in self.inner_modules)

    def example_input(self, batch_size: int = 1) -> Tensor:
        """A zero input batch of the right shape and the model's dtype (used to trace the
        dependency graph)."""
        import torch

        first = next(self.parameters(), None)
        dtype = torch.get_default_dtype() if first is None else first.dtype
        return torch.zeros(batch_size, *self.input_shape, dtype=dtype)


#: The registered ``[model]`` kinds.
MODELS: Registry[ModelConfig] = Registry("model", "name")

#: A layer width (at least 1).
Width = Annotated[int, Field(ge=1)]

#: BatchNorm running statistics: averaged over clients like parameters, or static BN (sBN).
BatchNormMode = Literal["aggregate", "static"]


class ModelConfig(Section):
    """Base of every ``[model]`` kind: its settings, and how it builds the model.

    Class attributes a kind sets:
        flat: the model takes flat vectors (it flattens inputs of any shape), else square
            images ``(C, S, S)``.
        min_image_size: the smallest image side an image model takes.
        task: the ``[task]`` this model belongs to, when it carries the task's x itself
            (``None``: any task that has no model of its own).
    """

    name: str

    flat: ClassVar[bool] = False
    min_image_size: ClassVar[int] = 1
    task: ClassVar[str | None] = None

    @property
    def static_batchnorm(self) -> bool:
        """Whether the model's BatchNorm layers use static BN (see :class:`BatchNormConfig`)."""
        return getattr(self, "batchnorm", None) == "static"

    def build(self, input_shape: tuple[int, ...], classes: int) -> BilevelModel:
        """The model for inputs of ``input_shape`` (one example) and ``classes`` outputs;
        raises ``ValueError`` for inputs it cannot take."""
        raise NotImplementedError

    def image(self, input_shape: tuple[int, ...], source: str = "the data") -> tuple[int, int]:
        """(channels, side) of square images ``(C, S, S)`` large enough for the model;
        ``ValueError`` naming ``source`` otherwise."""
        shape = tuple(input_shape)
        if len(shape) != 3 or shape[1] != shape[2]:
            raise ValueError(
                f"needs square images (C, S, S), but {source} gives inputs of shape {shape}; "
                "use mlp"
            )
        channels, size = shape[0], shape[2]
        if size < self.min_image_size:
            least = self.min_image_size
            raise ValueError(
                f"needs images of at least {least}x{least}, but {source} gives "
                f"{channels}x{size}x{size}; use a larger data set or another model"
            )
        return channels, size


class BatchNormConfig(ModelConfig):
    """A model with BatchNorm layers.

    ``batchnorm``: ``"aggregate"`` averages the clients' running statistics coordinate-wise
    like parameters; ``"static"`` (HeteroFL's sBN) has clients normalise with batch statistics
    only and the server recompute the statistics of the global model over
    ``calibration_samples`` training examples before each evaluation.
    """

    batchnorm: BatchNormMode = "aggregate"
    calibration_samples: int = Field(
        512, ge=1, description="training examples the server recomputes static BN over"
    )
