"""Exact second-order products by autograd, for algorithms that track ``v`` themselves."""

from __future__ import annotations

from typing import ClassVar, Literal

from radbo.autodiff import InnerSystem, Linearization
from radbo.hypergrad.base import ESTIMATORS, Estimator
from radbo.typing import BilevelLoss, Params

__all__ = ["Autograd"]


@ESTIMATORS.register
class Autograd(Estimator):
    """Exact ``∇²_yy g · u`` and ``∇²_xy g · v`` by autograd double backward
    (``[estimator] name = "autograd"``; :class:`~radbo.autodiff.InnerSystem`).

    For algorithms that carry ``v`` as a sequence of their own (SimFBO / ShroFBO, FedMSA) or
    build the Neumann series across clients (FedMBO) and need only the products at a point.
    Cost per point: one gradient of g with ``create_graph``; one product per call.

    >>> import torch
    >>> g = lambda x, y: (x["a"] * y["w"] ** 2).sum()           # ∇_w g = 2 a w
    >>> system = Autograd().linearize(g, {"a": torch.tensor([3.0])}, {"w": torch.tensor([2.0])})
    >>> system.both((torch.tensor([1.0]),))                    # (2 w v, 2 a v)
    ((tensor([4.]),), (tensor([6.]),))
    """

    name: Literal["autograd"] = "autograd"

    capabilities: ClassVar[frozenset[str]] = frozenset({"products"})

    def linearize(
        self, inner_loss: BilevelLoss, x: Params, y: Params, *, lead: int = 0, with_x: bool = True
    ) -> Linearization:
        return InnerSystem(inner_loss, x, y, lead=lead)
