"""FIARSE's importance-aware submodels: one model-wide magnitude threshold across all groups."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from radbo.masks.policies.importance import importance_order
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
       normalisation (normalisation layers are neither masked nor counted).
    3. **Threshold.** One threshold for the whole model: the ``int(numel * r)``-th largest
       ``|w|`` over all layers concatenated (``torch.topk``), so the layers keep different
       fractions, and the kept set is every parameter at or above it: r is a fraction of the
       parameters.

    radbo's submodels are structured (whole channels, so that a client trains a physically
    smaller network), so here:

    - the importance of a root channel is the mean ``|w|`` over the conv / linear entries that
      removing it removes (:meth:`StructurePlan.channel_magnitudes`): FIARSE's per-parameter
      importance averaged over the channel, on the same scale in every group;
    - the budget is the number of conv / linear entries (:meth:`StructurePlan.connections_kept`)
      of the uniform-width submodel at the client's ratios (every group keeping
      ``kept_count(C, r)`` channels, as ``leading`` does), so a client at capacity r holds no
      more parameters than under the other policies;
    - the channels of every group asked for a ratio below 1 are taken in one model-wide order
      of decreasing importance, and the kept set is the longest prefix of that order within the
      budget: every channel at or above one threshold. A group keeps at least its most
      important channel (a structured network with an empty layer has no path to the output),
      and those channels come first. Ties go to the earlier group in model order, then to the
      lower channel index; kept channels are returned sorted. A group asked for ratio 1 (or not
      named) keeps everything.

    A channel of a wide layer costs more connections than one of a narrow layer, so the
    number of kept channels depends on where they lie; the layers keep different fractions, and
    a client's FLOPs at capacity r can differ from a uniform-width submodel's (FIARSE counts
    parameters, not FLOPs, as well). The engine meters the submodel actually trained.

    FIARSE's local training also differs from plain SGD on the submodel: its masked layers
    recompute ``w * 1{|w| >= t}`` in every forward pass with a surrogate derivative of the mask
    (``Bern`` in ``fiarse/model/model_utils.py``), which scales a kept parameter's gradient by
    ``1 + 2 t |w| / (|w| + t)^2`` and drops a parameter that falls below the threshold t during
    the round. That is a per-parameter rule; radbo's clients train the extracted structured
    submodel with ``fedavg``'s plain local step, so that part is not reproduced.

    Magnitudes are computed once per round (the engine loads the round's global model into the
    plan first) and selections once per round and set of ratios: clients of equal capacity
    share one submodel in a round. The client and the generator are ignored.

    >>> from radbo.models import MLP
    >>> model = MLP(8, [8], 3)
    >>> plan = StructurePlan(model, model.example_input(), model.output_layers)
    >>> FiarsePolicy()(plan, {"body.0": 1.0}, round=0, client=0,
    ...                generator=torch.Generator())["body.0"].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """

    def __init__(self) -> None:
        self._round: tuple[StructurePlan, int] | None = None
        self._magnitudes: dict[str, Tensor] = {}
        self._selections: dict[tuple[tuple[str, float], ...], dict[str, Tensor]] = {}

    def magnitudes(self, plan: StructurePlan, round: int) -> dict[str, Tensor]:
        """Per-group channel importance of ``round`` (computed on first use in the round)."""
        if self._round is None or self._round[0] is not plan or self._round[1] != round:
            self._round = (plan, round)
            self._magnitudes = plan.channel_magnitudes()
            self._selections = {}
        return self._magnitudes

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
        key = tuple(sorted(ratios.items()))
        if key not in self._selections:
            self._selections[key] = _select(plan, magnitudes, ratios)
        selection = self._selections[key]
        return {group: selection[group].clone() for group in ratios}


def _select(
    plan: StructurePlan, magnitudes: Mapping[str, Tensor], ratios: Mapping[str, float]
) -> dict[str, Tensor]:
    """The longest prefix of the model-wide importance order (each pooled group's best channel
    first) whose connections fit in those of the uniform-width submodel at ``ratios``."""
    uniform = {g: torch.arange(kept_count(plan.channels(g), r)) for g, r in ratios.items()}
    budget = plan.connections_kept(uniform)
    pooled = [g for g in plan.groups if g in uniform and uniform[g].numel() < plan.groups[g]]
    whole = {g: kept for g, kept in uniform.items() if g not in pooled}
    if not pooled:
        return whole
    best: dict[str, int] = {}
    rest_score, rest_group, rest_channel = [], [], []
    for position, group in enumerate(pooled):
        score = torch.nan_to_num(magnitudes[group], nan=float("-inf"))
        order = importance_order(score)  # ties -> lower index
        best[group] = int(order[0])
        rest_score.append(score[order[1:]])
        rest_group.append(torch.full((order.numel() - 1,), position))
        rest_channel.append(order[1:])
    # Candidates are laid out group by group, each in its own descending order, so a stable
    # sort breaks ties by the earlier group, then the lower channel index.
    ranked = torch.sort(torch.cat(rest_score), descending=True, stable=True).indices
    owners = torch.cat(rest_group)[ranked].tolist()
    channels = torch.cat(rest_channel)[ranked].tolist()

    def prefix(n: int) -> dict[str, Tensor]:
        chosen = {g: [c] for g, c in best.items()}
        for owner, channel in zip(owners[:n], channels[:n], strict=True):
            chosen[pooled[owner]].append(channel)
        return {g: torch.sort(torch.tensor(c, dtype=torch.long)).values for g, c in chosen.items()}

    # Kept connections grow with the prefix, and each group's best channel alone fits (every
    # group keeps at least one channel in the uniform submodel): the longest fitting prefix
    # is found by bisection.
    low, high = 0, len(owners)
    while low < high:
        middle = (low + high + 1) // 2
        if plan.connections_kept({**whole, **prefix(middle)}) <= budget:
            low = middle
        else:
            high = middle - 1
    return {**whole, **prefix(low)}
