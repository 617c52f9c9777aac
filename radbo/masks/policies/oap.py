"""OAP, online adaptive pruning: each round, every layer pruned by its own filters' magnitude."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from radbo.masks.policies.importance import top_channels
from radbo.masks.structure import StructurePlan, kept_count


class OAPPolicy:
    """Keep, in each group, the ``kept_count(C, r)`` root filters of largest mean ``|w|``.

    "OAP" is the RABO paper's row for its reference [40]: Hanhan Zhou, Tian Lan, Guru Prasad
    Venkataramani, and Wenbo Ding, "Every parameter matters: Ensuring the convergence of
    federated learning with dynamic heterogeneous models reduction", Advances in Neural
    Information Processing Systems, 36, 2024. What the sources radbo could read say:

    - the RABO paper (``papers/rabo_rafbo.txt``) lists OAP among the single-level submodel
      baselines of Table II and cites [40] among "studies about model pruning" for its
      Assumption 5 (the influence of the submodel); it does not describe the method further;
    - [40]'s abstract (and that of its 2022 preprint, "On the Convergence of Heterogeneous
      Federated Learning with Arbitrary Adaptive Online Model Pruning") describes heterogeneous
      local models obtained by pruning a shared global model online, i.e. anew in every round,
      with an arbitrary adaptive pruning policy, and names two factors of convergence: the
      pruning-induced noise and the minimum coverage index.

    No text of the method's mask rule or code was found, so radbo reads "OAP" as *online
    adaptive pruning* in its plainest form, and this is an assumption, not the paper's
    algorithm: in every round each client's submodel is the global model of that round pruned
    to its capacity by magnitude, layer by layer. A group (the channels Torch-Pruning couples to
    a root conv / linear layer) keeps the ``kept_count(C, r)`` root channels whose own filter,
    the root layer's weight slice ``W[c]``, has the largest mean ``|w|`` (the L1 filter norm
    of magnitude pruning; ties to the lower index; returned sorted). Unlike ``importance``
    (Torch-Pruning's group L2 norm over every coupled tensor, each layer normalised by its
    mean) it looks only at the filter being pruned, which is what pruning a trained layer
    by magnitude does; unlike ``fiarse`` every layer keeps the same fraction. Keeping the
    largest filters keeps the pruning noise ``||w - w * m||`` of each layer small; the minimum
    coverage index, [40]'s other factor, is what radbo's ``coverage`` policy controls (RABO's
    C_x^* is that index), and the engine reports it for any policy (``coverage_x_min``).

    The pruning is computed once per round and cached (keyed by plan and round): the engine
    loads the round's global model into the plan first, and clients of equal capacity share
    one submodel in a round. The client and the generator are ignored.

    >>> from radbo.models import MLP
    >>> model = MLP(2, [3], 2)
    >>> plan = StructurePlan(model, model.example_input(), model.output_layers)
    >>> plan.load_state({**model.state_dict(), "body.0.weight": torch.tensor(
    ...     [[0.1, -0.1], [-3.0, 1.0], [0.5, 0.5]])})
    >>> OAPPolicy()(plan, {"body.0": 2 / 3}, round=0, client=0,
    ...             generator=torch.Generator())["body.0"].tolist()
    [1, 2]
    """

    def __init__(self) -> None:
        self._cache: tuple[StructurePlan, int, dict[str, Tensor]] | None = None

    def filter_magnitudes(self, plan: StructurePlan, round: int) -> dict[str, Tensor]:
        """Mean ``|w|`` of each root filter of every group in ``round`` (cached per round)."""
        if self._cache is not None and self._cache[0] is plan and self._cache[1] == round:
            return self._cache[2]
        magnitudes: dict[str, Tensor] = {}
        for group, channels in plan.groups.items():
            # the root layer (a Conv2d or Linear): its output channels are the group's
            weight = plan.model.get_parameter(f"{group}.weight").detach()
            weight = weight.to(device="cpu", dtype=torch.float64)
            magnitudes[group] = weight.abs().reshape(channels, -1).mean(1)
        self._cache = (plan, round, magnitudes)
        return magnitudes

    def __call__(
        self,
        plan: StructurePlan,
        ratios: Mapping[str, float],
        *,
        round: int,
        client: int,
        generator: torch.Generator,
    ) -> dict[str, Tensor]:
        """Kept root channels per group named in ``ratios`` (see :class:`MaskPolicy`)."""
        magnitudes = self.filter_magnitudes(plan, round)
        return {
            group: top_channels(magnitudes[group], kept_count(plan.channels(group), ratio))
            for group, ratio in ratios.items()
        }
