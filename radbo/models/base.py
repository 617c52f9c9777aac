"""Base class of radbo's model zoo: a model that knows its outer (x) and inner (y) parameters."""

from __future__ import annotations

from torch import Tensor, nn


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
        """A zero input batch of the right shape (used to trace the dependency graph)."""
        import torch

        return torch.zeros(batch_size, *self.input_shape)
