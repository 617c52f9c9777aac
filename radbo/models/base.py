"""Base class of radbo's model zoo: a model that knows its outer (x) and inner (y) parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, ClassVar, Literal

from pydantic import Field
from torch import Tensor, nn

from radbo.models.functional import has_functional_form
from radbo.registry import Registry, Section


class BilevelModel(nn.Module):
    """An ``nn.Module`` whose parameters split into outer variables x and inner variables y.

    Subclasses set :attr:`inner_modules` (names of the submodules whose parameters are the
    inner variables y; every other parameter is outer, x), :attr:`output_layers` (layers whose
    output channels must never be pruned, e.g. the classifier) and :attr:`input_shape` (shape of
    one example, without the batch dimension), and list in :attr:`loss_only_parameters` any
    parameter only a loss reads.

    A subclass may also give its forward pass a functional form, :meth:`_functional_forward`,
    which :meth:`functional_forward` (and so :func:`radbo.problem.forward`) uses instead of
    ``torch.func.functional_call``.
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

    def functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor | None:
        """``self(inputs)`` computed from the tensors of ``state`` (every parameter and buffer,
        keyed like ``state_dict``) without re-parametrising the module: bitwise what
        ``torch.func.functional_call(self, state, (inputs,))`` returns, BatchNorm buffers of
        ``state`` updated in place the same way. Shapes come from ``state``, so a pruned
        skeleton of the same class computes with the submodel's shapes.

        ``None`` when there is no functional form: the class (or the subclass that last
        overrode ``forward``) defines no :meth:`_functional_forward`, a submodule is of a type
        :mod:`radbo.models.functional` has no rule for, or a module hook is installed.
        """
        if not _has_own_form(type(self)) or not has_functional_form(self):
            return None
        return self._functional_forward(state, inputs)

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        """The functional form of ``forward`` (see :meth:`functional_forward`); subclasses
        write it with the layer rules of :mod:`radbo.models.functional`, the same ops in the
        same order as their ``forward``."""
        raise NotImplementedError

    #: the body outputs :meth:`reusing_body` keeps (``None`` outside it), by input tensor
    _reused: dict[int, tuple[Tensor, Tensor]] | None = None

    @contextmanager
    def reusing_body(self) -> Iterator[None]:
        """Within the block the functional forward pass computes the body -- everything before
        the inner modules, the outer parameters' work -- once per input tensor and reuses it.

        For work that changes only the inner parameters at fixed x, buffers and inputs (RABO's
        refit of y before its hypergradient): each step then costs the head's work only, with
        bitwise the same results. The caller promises that x and the buffers do not change
        inside the block (a BatchNorm layer in training mode normalises with batch statistics,
        which the reused output already holds; its running statistics are then not updated
        again, which only matters to callers that read them back).
        """
        self._reused = {}
        try:
            yield
        finally:
            self._reused = None

    def _body(self, inputs: Tensor, compute: Callable[[], Tensor]) -> Tensor:
        """``compute()``, the body's output for ``inputs``; inside :meth:`reusing_body` the
        first one computed for this very tensor."""
        reused = self._reused
        if reused is None:
            return compute()
        hit = reused.get(id(inputs))
        if hit is not None and hit[0] is inputs:
            return hit[1]
        out = compute()
        reused[id(inputs)] = (inputs, out)  # holding inputs keeps its id from being reused
        return out

    def example_input(self, batch_size: int = 1) -> Tensor:
        """A zero input batch of the right shape and the model's dtype (used to trace the
        dependency graph)."""
        import torch

        first = next(self.parameters(), None)
        dtype = torch.get_default_dtype() if first is None else first.dtype
        return torch.zeros(batch_size, *self.input_shape, dtype=dtype)


_OWN_FORM: dict[type, bool] = {}


def _has_own_form(cls: type[BilevelModel]) -> bool:
    """Whether ``cls``'s ``_functional_forward`` is defined where its ``forward`` is or below
    (a subclass that overrides ``forward`` alone loses the functional form it inherited)."""
    known = _OWN_FORM.get(cls)
    if known is None:

        def owner(name: str) -> type:
            return next(c for c in cls.__mro__ if name in vars(c))

        form = owner("_functional_forward")
        known = _OWN_FORM[cls] = form is not BilevelModel and issubclass(form, owner("forward"))
    return known


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

    batchnorm: BatchNormMode = Field(
        "aggregate",
        description="aggregate: running statistics averaged like parameters; static: HeteroFL's "
        "sBN, batch statistics on clients, recomputed by the server before each evaluation",
    )
    calibration_samples: int = Field(
        512, ge=1, description="training examples the server recomputes static BN over"
    )
