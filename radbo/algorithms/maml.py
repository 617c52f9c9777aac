"""Dist-MAML: model-agnostic meta-learning on the clients' episodes, federated with FedAvg.

Papers: Finn, Abbeel and Levine, "Model-agnostic meta-learning for fast adaptation of deep
networks", International Conference on Machine Learning, PMLR, pages 1126-1135, 2017 (the RABO
paper's reference [7]); McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data" (FedAvg), AISTATS 2017, arXiv:1602.05629. The "Dist-MAML" row of the RABO
paper's Table II (``papers/rabo_rafbo.txt``, Sec. V-A) is this method on the full model.

Each local step takes one of the client's episodes (support set S = the step's inner minibatch,
query set Q = its outer one) and every parameter w = (x, y):

    w_0 = w,   w_{k+1} = w_k - inner_lr * grad L_S(w_k)   (k < inner_steps)
    G = d L_Q(w_K) / d w,   w <- w - lr * G

where L is the task's loss of one set: on ``few_shot`` the episode's cross-entropy, which is the
task's inner loss g without its L2 on the head (MAML adapts with the plain task loss, and so
support and query losses are the same function; the L2 only makes radbo's bilevel problem
strongly convex in y). ``first_order = false`` differentiates through the inner steps
(``create_graph``): ``G = prod_k (I - inner_lr H_S(w_k)) grad L_Q(w_K)``, a Hessian-vector
product per inner step; ``first_order = true`` is first-order MAML (FOMAML, the same paper's
Sec. 5.2): ``G = grad L_Q(w_K)``. The client returns the summed G of its ``local_steps`` steps
in submodel coordinates and the server takes FedAvg's coverage-weighted step with ``lr`` on x
and y (:class:`~radbo.algorithms.fedavg.FedAvg`), so ``[mask]`` policies apply as they do to
FedAvg; Table II runs it on the full model.

The head is adapted too: with ``[task] head = "classes"`` it has one row per meta-training
class, of which an episode's loss reads its own N. BatchNorm running statistics move with
every forward pass (the inner steps' and the query's), as in FedAvg's local steps. It runs only
on the ``few_shot`` task (a config with another task is refused when read).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from radbo.algorithms.base import ALGORITHMS, Wiring
from radbo.algorithms.fedavg import FedAvg, FedAvgConfig
from radbo.autodiff import scalar
from radbo.client import ClientResult, ClientRuntime, ClientTask, Cohort, Prepared
from radbo.limits import Steps, StepSize
from radbo.loops import LocalSteps, Work, local_steps
from radbo.problem import Batch
from radbo.typing import Params

__all__ = ["MAML", "MAMLConfig"]


@ALGORITHMS.register
class MAMLConfig(FedAvgConfig):
    """Dist-MAML hyperparameters (see the module docstring): FedAvg's (``lr`` is the
    meta-step and the server's step, ``local_steps`` the episodes per round), and the
    adaptation's steps, step size and order."""

    # its own tag: FedAvg's narrowed to a kind of its own, which the type checker calls unsafe
    name: Literal["maml"] = "maml"  # type: ignore[assignment]
    local_steps: Steps = Field(
        5, ge=1, description="meta-steps (episodes) per round (<= 10,000 without --force)"
    )
    inner_steps: Steps = Field(
        1, ge=1, description="adaptation steps on the support set (<= 10,000 without --force)"
    )
    inner_lr: StepSize = Field(
        0.1,
        gt=0,
        allow_inf_nan=False,
        description="adaptation step size (<= 1000 without --force)",
    )
    first_order: bool = Field(
        False,
        description="first-order MAML: the query gradient at the adapted point, not "
        "differentiated through the adaptation",
    )

    tasks: ClassVar[tuple[str, ...] | None] = ("few_shot",)
    step_sizes: ClassVar[tuple[str, ...]] = ("lr", "inner_lr")

    def build(self, wiring: Wiring) -> MAML:
        return self.bind(MAML, wiring, use_budget_steps=wiring.budget_steps)


class MAML(MAMLConfig, FedAvg):
    """Dist-MAML: FedAvg's rounds whose local steps are MAML meta-steps on x and y."""

    def prepare_client(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        """One episode per local step: its support set and its query set."""
        gen = task.generator()
        steps = task.budget.local_steps if self.use_budget_steps else self.local_steps
        support, query = runtime.sampler.pair_steps(
            task.data, self.batch_size, self.outer_batch_size, steps, gen
        )
        return Prepared(steps={"support": support, "query": query}, num_steps=steps)

    def adapt(
        self,
        cohort: Cohort,
        module: nn.Module,
        loss: Callable[..., Tensor],
        params: Params,
        buffers: Params,
        support: Batch,
    ) -> Params:
        """``w_K``: ``inner_steps`` SGD steps of size ``inner_lr`` on the support loss from
        ``params`` (x and y). Second order keeps the steps' gradients on the graph, so that
        differentiating a function of ``w_K`` by ``params`` goes through them; first order
        takes them as constants (``w_K`` then moves with ``params`` one for one)."""
        fast = params
        for _ in range(self.inner_steps):
            value = cohort.loss(loss, module, *self.split(fast), buffers, support)
            grads = torch.autograd.grad(
                scalar("support loss", value, cohort.lead),
                list(fast.values()),
                create_graph=not self.first_order,
            )
            fast = {n: p - self.inner_lr * g for (n, p), g in zip(fast.items(), grads, strict=True)}
        return fast

    def split(self, params: Params) -> tuple[Params, Params]:
        """``(x, y)`` of a dict holding both."""
        return (
            {n: params[n] for n in self.outer_names},
            {n: params[n] for n in self.inner_names},
        )

    def run_client(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        """``local_steps`` meta-steps on x and y; returns the summed meta-gradients and the
        buffers. A stacked cohort replays its steps from a CUDA graph where the runtime has
        them (:meth:`~radbo.client.Cohort.run_steps`)."""
        module = cohort.module(runtime)
        params = cohort.params(self.trained_names(), clone=True)
        buffers = cohort.params(self.buffer_names, clone=True)
        # a frozen algorithm (step sizes, inner steps, order) and the module skeleton: the
        # capture's key
        key = ("maml.step", id(self), id(module))
        draws = [("support", self.batch_size), ("query", self.outer_batch_size)]

        def run(state: Any, step_data: Any, steps: Any, counts: Any) -> LocalSteps[Any]:
            params, buffers = state
            return self._meta_steps(
                runtime, cohort, module, params, buffers, step_data, steps, counts
            )

        done = cohort.run_steps(runtime, key, (params, buffers), draws, run)
        carry, n_grad, n_hvp = done.carry, done.n_grad, done.n_hvp
        _, total, buffers, loss_value = carry
        update = {**total, **(buffers if self.aggregate_buffers else {})}
        return cohort.replies(
            update,
            {"train_loss": loss_value},
            n_grad=n_grad,
            n_hvp=n_hvp,
            samples=cohort.step_samples("support", "query"),
        )

    def _meta_steps(
        self,
        runtime: ClientRuntime,
        cohort: Cohort,
        module: nn.Module,
        params: Params,
        buffers: Params,
        step_data: Callable[[str, int], Tensor],
        steps: int | list[int],
        counts: Tensor | None = None,
    ) -> LocalSteps[Any]:
        """``steps`` meta-steps from ``params`` (each client its number; or ``steps`` times,
        each client masked past its entry of ``counts``, a tensor on the device), step t on
        the episode ``step_data("support", t)``, ``step_data("query", t)``; the carry ends as
        ``(params, summed meta-gradients, buffers, query loss)``."""
        loss: Callable[..., Tensor] = runtime.problem.outer_loss
        total = {n: torch.zeros_like(t) for n, t in params.items()}
        hvps = 0 if self.first_order else self.inner_steps
        Carry = tuple[Params, Params, Params, Any]  # params, summed meta-gradients, buffers, loss

        def step(t: int, carry: Carry) -> tuple[Carry, Work]:
            params, total, buffers, _ = carry
            support = runtime.batch(step_data("support", t))
            query = runtime.batch(step_data("query", t))
            start = {n: p.detach().requires_grad_(True) for n, p in params.items()}
            # the forward passes update the BatchNorm running statistics in ``buffers``
            adapted = self.adapt(cohort, module, loss, start, buffers, support)
            value = cohort.loss(loss, module, *self.split(adapted), buffers, query)
            meta = torch.autograd.grad(
                scalar("query loss", value, cohort.lead), list(start.values())
            )
            with torch.no_grad():
                stepped = {
                    n: p - self.lr * g for (n, p), g in zip(start.items(), meta, strict=True)
                }
                summed = {n: total[n] + g for n, g in zip(start, meta, strict=True)}
            work = Work(n_grad=self.inner_steps + 1, n_hvp=hvps)
            return (stepped, summed, buffers, value.detach()), work

        start = (params, total, buffers, float("nan"))
        return local_steps(step, start, steps, name="maml.step", counts=counts)
