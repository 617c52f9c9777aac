"""Dist-ProtoNet: prototypical networks trained on the clients' episodes, federated with FedAvg.

Papers: Snell, Swersky and Zemel, "Prototypical networks for few-shot learning", Advances in
Neural Information Processing Systems 30, 2017 (the RABO paper's reference [25]); McMahan et
al., "Communication-Efficient Learning of Deep Networks from Decentralized Data" (FedAvg),
AISTATS 2017, arXiv:1602.05629. The "Dist-ProtoNet" row of the RABO paper's Table II
(``papers/rabo_rafbo.txt``, Sec. V-A) is this method on the full model.

Each local step takes one of the client's episodes (the few-shot task's episode sampler: the
support set is the step's inner minibatch, the query set its outer one), embeds both with the
backbone x in one forward pass (the features the head reads, :func:`radbo.tasks.few_shot.
head_inputs`), averages each class's support embeddings into its prototype c_k and scores each
query embedding z by ``-||z - c_k||^2`` (Snell et al., eqs. 1-2); the loss is the query set's
cross-entropy over the episode's N classes (:meth:`radbo.tasks.FewShot.prototype_loss`). SGD
with ``lr`` on x only, ``local_steps`` steps; the client returns the summed gradients of x in
submodel coordinates and the server takes FedAvg's coverage-weighted step (as
:class:`~radbo.algorithms.fedavg.FedAvg`: ``x_s <- x_s - lr * mean_{i in N_s} G_{i,s}``), so
``[mask]`` policies apply as they do to FedAvg; Table II runs it on the full model.

**The head y is not trained**: a prototypical network has no classifier, the prototypes are
its head. y is carried unchanged from its initial value (and not sent up), so that the model
keeps the task's shape; the few-shot evaluation fits a fresh head on each test episode's
features anyway, and ``[task] prototypes = true`` adds ProtoNet's own nearest-prototype rule
beside it (:class:`radbo.tasks.few_shot.FewShotEvaluator`).

It runs only on the ``few_shot`` task (a config with another task is refused when read).
Deviations from Snell et al.: their training episodes use more ways than testing ("higher
way"), which here is the task's one ``ways``; radbo embeds with the model's backbone (the
head's input) rather than a separate embedding network.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from torch import Tensor

from radbo.algorithms.base import ALGORITHMS, Wiring
from radbo.algorithms.fedavg import FedAvg, FedAvgConfig

__all__ = ["ProtoNet", "ProtoNetConfig"]


@ALGORITHMS.register
class ProtoNetConfig(FedAvgConfig):
    """Dist-ProtoNet hyperparameters (see the module docstring): FedAvg's; the batch sizes are
    the episode's (``ways * shots`` support, ``ways * queries`` query examples)."""

    # its own tag: FedAvg's narrowed to a kind of its own, which the type checker calls unsafe
    name: Literal["protonet"] = "protonet"  # type: ignore[assignment]

    tasks: ClassVar[tuple[str, ...] | None] = ("few_shot",)

    def build(self, wiring: Wiring) -> ProtoNet:
        return self.bind(ProtoNet, wiring, use_budget_steps=wiring.budget_steps)


class ProtoNet(ProtoNetConfig, FedAvg):
    """Dist-ProtoNet: FedAvg's rounds with the prototypical loss on x alone."""

    def trained_names(self) -> tuple[str, ...]:
        """x only: the head y is carried unchanged (see the module docstring)."""
        return self.outer_names

    def local_loss(self, problem: Any) -> Callable[..., Tensor]:
        """The episode's prototypical loss (:meth:`radbo.tasks.FewShot.prototype_loss`)."""
        loss: Callable[..., Tensor] | None = getattr(problem, "prototype_loss", None)
        if loss is None:
            raise TypeError(
                f"ProtoNet trains on few-shot episodes; the problem {type(problem).__name__} "
                'has no prototype_loss (use [task] name = "few_shot")'
            )
        return loss
