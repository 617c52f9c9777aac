"""FIARSE's importance-aware submodels: one model-wide magnitude threshold across all groups."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from radbo.masks.structure import StructurePlan, kept_count


class FiarsePolicy:
    """Keep the channels of largest mean ``|w|`` of the whole model, above one shared threshold.

    FIARSE (Feijie Wu, Xingchen Wang, Yaqing Wang, Tianci Liu, Lu Su, and Jing Gao, "FIARSE:
    Model-Heterogeneous Federated Learning via Importance-Aware Submodel Extraction", NeurIPS
    2024, arXiv:2407.19389; the RABO paper's reference [33], printed there as "Fiarise") takes
    a parameter's importance to be its magnitude ``|w|`` and gives a client of model size r the
    parameters whose magnitude reaches a threshold chosen for the *whole* model. What radbo
    follows, from the public repository github.com/HarliWu/FIARSE (``fiarse/server.py`` and
    ``fiarse/model/resnet_masked.py``, ``BetaResNet.generate_mask``):

    1. **When.** Every round, before local training, the server extracts each sampled client's
       submodel from the *current* global model (``generate_mask`` on a copy of the global
       model): the submodel moves with the weights, round after round.
    2. **Importance.** ``|w|`` of every conv / linear weight and bias, with no per-layer
       normalisation (normalisation layers are not masked).
    3. **Threshold.** One threshold for the whole model: the ``int(numel * r)``-th largest
       ``|w|`` over all layers concatenated (``torch.topk``), so the layers keep different
       fractions, and the kept set is every parameter at or above it.

    radbo's submodels are structured (whole channels, so that a client trains a physically
    smaller network), so here:

    - the importance of a root channel is the mean ``|w|`` over the conv / linear entries that
      removing it removes (:meth:`StructurePlan.channel_magnitudes`): FIARSE's per-parameter
      importance averaged over the channel, on the same scale in every group;
    - the budget is counted in channels: the groups asked for the same ratio r share
      ``sum_g kept_count(C_g, r)`` channels (what per-group policies keep in total), and they go
      to the channels of largest importance across those groups, i.e. every channel at or
      above one threshold. A group keeps at least its most important channel (a structured
      network with an empty layer has no path to the output), and those channels are taken
      first. Ties go to the earlier group in model order, then to the lower channel index;
      kept channels are returned sorted. A group asked for ratio 1 keeps everything.

    Because the layers keep different fractions, a client's FLOPs and memory at capacity r can
    differ from a uniform-width submodel's (FIARSE counts parameters, not FLOPs, as well); the
    engine meters the submodel actually trained. FIARSE's local training differs from plain
    SGD on the submodel: its masked layers recompute ``w * 1{|w| >= threshold}`` in every
    forward pass with a surrogate derivative of the mask (``Bern`` in
    ``fiarse/model/model_utils.py``), which scales a kept parameter's gradient by
    ``1 + 2 t |w| / (|w| + t)^2`` and drops a parameter that falls below the threshold t
    during the round. That is a per-parameter rule; radbo's clients train the extracted
    structured submodel with ``fedavg``'s plain local step, so that part is not reproduced.

    Magnitudes are computed once per round and cached (keyed by plan and round, as in
    :class:`~radbo.masks.policies.ImportancePolicy`): the engine loads the round's global
    model into the plan first.

    >>> from radbo.models import MLP
    >>> model = MLP(8, [8], 3)
    >>> plan = StructurePlan(model, model.example_input(), model.output_layers)
    >>> FiarsePolicy()(plan, {"body.0": 1.0}, round=0, client=0,
    ...                generator=torch.Generator())["body.0"].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """

    def __init__(self) -> None:
        self._cache: tuple[StructurePlan, int, dict[str, Tensor]] | None = None

    def magnitudes(self, plan: StructurePlan, round: int) -> dict[str, Tensor]:
        """Per-group channel importance of ``round`` (computed on first use in the round)."""
        if self._cache is not None and self._cache[0] is plan and self._cache[1] == round:
            return self._cache[2]
        magnitudes = plan.channel_magnitudes()
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
        magnitudes = self.magnitudes(plan, round)
        by_ratio: dict[float, list[str]] = {}
        for group in plan.groups:  # model order: the tie-break between groups
            if group in ratios:
                by_ratio.setdefault(ratios[group], []).append(group)
        kept: dict[str, Tensor] = {}
        for ratio, groups in by_ratio.items():
            kept.update(_pooled_top(plan, magnitudes, groups, ratio))
        return {group: kept[group] for group in ratios}


def _pooled_top(
    plan: StructurePlan, magnitudes: Mapping[str, Tensor], groups: list[str], ratio: float
) -> dict[str, Tensor]:
    """The kept channels of ``groups`` sharing a budget of ``sum kept_count(C_g, ratio)``:
    each group's most important channel, then the most important of all the rest."""
    budget = sum(kept_count(plan.channels(g), ratio) for g in groups)
    chosen: dict[str, list[int]] = {}
    rest_score, rest_group, rest_channel = [], [], []
    for position, group in enumerate(groups):
        score = torch.nan_to_num(magnitudes[group], nan=float("-inf"))
        # A stable descending sort keeps equal scores in index order: ties -> lower index.
        order = torch.sort(score, descending=True, stable=True).indices
        chosen[group] = [int(order[0])]
        rest_score.append(score[order[1:]])
        rest_group.append(torch.full((order.numel() - 1,), position))
        rest_channel.append(order[1:])
    # Candidates are laid out group by group, each in its own descending order, so a stable
    # sort breaks ties by the earlier group, then the lower channel index.
    pooled = torch.sort(torch.cat(rest_score), descending=True, stable=True).indices
    taken = pooled[: budget - len(groups)]
    owners = torch.cat(rest_group)[taken].tolist()
    for owner, channel in zip(owners, torch.cat(rest_channel)[taken].tolist(), strict=True):
        chosen[groups[owner]].append(channel)
    return {g: torch.sort(torch.tensor(c, dtype=torch.long)).values for g, c in chosen.items()}
