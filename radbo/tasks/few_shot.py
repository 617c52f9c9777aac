"""Few-shot learning as hyper-representation: N-way K-shot episodes, the backbone is x and the
linear head is y (RABO paper, Sec. V-A: ``papers/rabo_rafbo.txt``, Table II, Figs. 2-4).

**Training.** A client's minibatches are episodes drawn from its own classes
(:class:`EpisodeSampler`, from the task's generator): N of the client's classes, K support and
Q query examples of each. The inner loss g is the support set's cross-entropy of the head y on
the backbone's features, over the episode's N classes, plus ``inner_l2 / 2 ||y||^2`` (so g is
strongly convex in y); the outer loss f is the query set's cross-entropy. The head has one row
per meta-training class and is shared across episodes and clients, as in the paper's
formulation ``y*(x) = argmin_y (1/n) sum_i (1/N_m) sum_j L_{S_j}(x, y)``; each episode's
softmax runs over the logits of its own N classes (RFS, Tian et al., "Rethinking Few-Shot
Image Classification: a Good Embedding Is All You Need?", ECCV 2020, trains its embedding the
same way with all classes at once).

With ``head = "episode"`` the head has N rows instead, and each episode's classes are assigned
to them in a random order (drawn with the episode): the label of an example is its class's slot
in the episode, not its class. No head can then be right for every episode, so the inner
problem really is the head fit on the episode's support set (from the shared starting point y),
and the outer loss rewards a backbone on whose features a few inner steps separate any N
classes -- the hyper-representation formulation of Franceschi et al., "Bilevel Programming for
Hyperparameter Optimization and Meta-Learning", ICML 2018 (arXiv:1806.04910), and ANIL
(Raghu et al., ICLR 2020). With as few meta-training classes as ways (digits: 5 classes,
5-way), ``"classes"`` makes the bilevel problem plain 5-class classification.

**Evaluation**, as the few-shot literature reports it: on classes never seen in meta-training,
``test_episodes`` N-way K-shot episodes (fixed by the run seed, the same for every algorithm),
a fresh linear head fitted on each episode's support set (L2-normalised features, multinomial
logistic regression with ``head_l2``, ``head_steps`` steps of gradient descent), accuracy on
its query set; reported as the mean over episodes and the half-width of its 95 % confidence
interval (``1.96 std / sqrt(episodes)``). With ``prototypes = true`` the evaluator also scores
ProtoNet's own rule on the same episodes and the same L2-normalised features (Snell, Swersky and
Zemel, "Prototypical networks for few-shot learning", NeurIPS 30, 2017): each query example goes
to the class whose prototype, the mean support feature, is nearest in squared Euclidean distance
(``prototype_accuracy`` and its ``prototype_accuracy_ci95``); any algorithm can report it. (ProtoNet
trains on the raw features; normalising them makes the rule comparable across algorithms, whose
features differ in scale.)

**Data.** A data set whose training and test splits share their classes (digits, MNIST,
CIFAR-10) is split by class: ``test_classes`` (default: the upper half of the classes; digits
5-9) are meta-test, the others meta-train, each with all of its examples. A data set whose
splits hold different classes (Omniglot: background / evaluation alphabets;
``disjoint_classes`` of its ``[data]`` kind) is used as it is.

**What keeps g's step stable**: as for :mod:`radbo.tasks.hyper_representation`, a head step
of size ``inner_lr`` is stable while ``inner_lr (1/2 lambda_max(E[phi phi^T]) + mu) < 2`` over
the backbone's features phi(x); x moves the bound only through the features' scale, no box
bounds it, and the ``[algorithm] divergence`` guard catches a run that blows up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from radbo.data import Dataset
from radbo.limits import StepSize
from radbo.problem import (
    Batch,
    ClientData,
    calibrate_batchnorm,
    cross_entropy,
    forward,
    l2_penalty,
    split_state,
)
from radbo.randomness import Stream, generator
from radbo.tasks.base import TASKS, InnerL2, TaskConfig
from radbo.typing import Params

__all__ = [
    "EpisodeSampler",
    "FewShot",
    "FewShotEvaluator",
    "draw_episode",
    "episode_cross_entropy",
    "head_inputs",
    "prototype_logits",
]

#: Examples per forward pass of the evaluator's feature extraction.
_EVAL_BATCH = 1024


def episode_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy over the classes present in ``targets`` only: the logits of every other
    class are left out of the softmax (an N-way episode on a head with more rows). Written
    with elementwise operations only, so it runs under ``torch.vmap``.

    >>> logits = torch.tensor([[2.0, 0.0, 9.0], [0.0, 1.0, 9.0]])
    >>> # class 2 is not in the episode: (log(1 + e^-2) + log(1 + e^-1)) / 2
    >>> round(float(episode_cross_entropy(logits, torch.tensor([0, 1]))), 4)
    0.2201
    """
    classes = torch.arange(logits.shape[-1], device=logits.device)
    present = (targets.unsqueeze(-1) == classes).any(dim=0)
    return cross_entropy(logits.masked_fill(~present, float("-inf")), targets)


def head_inputs(module: nn.Module, x: Params, y: Params, buffers: Params, inputs: Tensor) -> Tensor:
    """What the model's head (its first inner module, ``head`` by default) reads for
    ``inputs``: the backbone's features, ``[n, d]``, differentiable in x. Captured by a forward
    hook during the forward pass of :func:`radbo.problem.forward`, so it works for every model
    of the zoo, pruned skeletons included, and under ``torch.vmap``."""
    inner_modules: tuple[str, ...] = getattr(module, "inner_modules", ("head",))
    captured: list[Tensor] = []
    hook = module.get_submodule(inner_modules[0]).register_forward_hook(
        lambda _module, args, _output: captured.append(args[0])
    )
    try:
        forward(module, x, y, buffers, inputs)
    finally:
        hook.remove()
    return captured[0].flatten(1)


def prototype_logits(support: Tensor, query: Tensor, ways: int) -> Tensor:
    """ProtoNet's logits (Snell et al. 2017, eqs. 1-2): minus the squared Euclidean distance of
    each query feature to each class prototype, the mean of the class's support features.
    ``support [..., ways * shots, d]`` is grouped by class in slot order (as
    :func:`draw_episode` returns it), ``query [..., q, d]``; returns ``[..., q, ways]``. Written
    with broadcasting and sums only, so it runs batched over episodes and under ``torch.vmap``.

    >>> support = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0], [0.0, 6.0]])  # 2-way 2-shot
    >>> prototype_logits(support, torch.tensor([[1.0, 1.0]]), ways=2)  # prototypes (1,0), (0,5)
    tensor([[ -1., -17.]])
    """
    shots = support.shape[-2] // ways
    prototypes = support.unflatten(-2, (ways, shots)).mean(-2)  # [..., ways, d]
    return -(query.unsqueeze(-2) - prototypes.unsqueeze(-3)).pow(2).sum(-1)


def _mean_and_ci95(hits: Tensor) -> tuple[float, float]:
    """Mean of per-episode accuracies and the half-width of its 95 % interval
    (``1.96 std / sqrt(episodes)``; NaN for one episode)."""
    episodes = hits.numel()
    ci = 1.96 * float(hits.std()) / math.sqrt(episodes) if episodes > 1 else float("nan")
    return float(hits.mean()), ci


def _class_members(labels: Tensor, pool: Tensor) -> dict[int, Tensor]:
    """Indices of ``pool`` grouped by class, each group in pool order."""
    own = labels[pool]
    return {int(c): pool[own == c] for c in torch.unique(own).tolist()}


def draw_episode(
    members: dict[int, Tensor],
    ways: int,
    shots: int,
    queries: int,
    gen: torch.Generator,
    shuffle: bool = False,
) -> tuple[Tensor, Tensor]:
    """One N-way K-shot episode from ``members`` (class -> example indices): ``ways`` classes
    drawn uniformly (in increasing class order; in the order drawn with ``shuffle``), then for
    each ``shots`` support and ``queries`` query examples drawn without replacement. Returns
    (support, query) indices, grouped by class in that order."""
    eligible = [c for c, idx in members.items() if idx.numel() >= shots + queries]
    if len(eligible) < ways:
        raise ValueError(
            f"an episode needs {ways} classes with at least {shots + queries} examples each "
            f"(shots + queries), got {len(eligible)}"
        )
    drawn = [eligible[i] for i in torch.randperm(len(eligible), generator=gen)[:ways].tolist()]
    chosen = drawn if shuffle else sorted(drawn)
    support, query = [], []
    for c in chosen:
        idx = members[c]
        order = idx[torch.randperm(idx.numel(), generator=gen)]
        support.append(order[:shots])
        query.append(order[shots : shots + queries])
    return torch.cat(support), torch.cat(query)


@dataclass
class EpisodeSampler:
    """Minibatches as episodes of the client's own classes (see :class:`radbo.problem.Sampler`).

    ``inner`` is an episode's support set, ``outer`` its query set, ``pair`` both of one
    episode; the requested batch sizes are ignored (an episode has ``ways * shots`` support and
    ``ways * queries`` query examples). ``shuffle``: the episode's classes in a random order
    (the slots of an episode head)."""

    labels: Tensor
    ways: int
    shots: int
    queries: int
    shuffle: bool = False
    _members: dict[tuple[int, ...], dict[int, Tensor]] = field(default_factory=dict, repr=False)

    def members(self, data: ClientData) -> dict[int, Tensor]:
        """The client's examples grouped by class (cached per client)."""
        key = tuple(data.inner.tolist())
        found = self._members.get(key)
        if found is None:
            found = self._members[key] = _class_members(self.labels, data.inner)
        return found

    def pair(
        self, data: ClientData, inner_size: int, outer_size: int, gen: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        return draw_episode(
            self.members(data), self.ways, self.shots, self.queries, gen, self.shuffle
        )

    def inner(self, data: ClientData, size: int, gen: torch.Generator) -> Tensor:
        return self.pair(data, size, size, gen)[0]

    def outer(self, data: ClientData, size: int, gen: torch.Generator) -> Tensor:
        return self.pair(data, size, size, gen)[1]

    def inner_steps(self, data: ClientData, size: int, steps: int, gen: torch.Generator) -> Tensor:
        return self.pair_steps(data, size, size, steps, gen)[0]

    def outer_steps(self, data: ClientData, size: int, steps: int, gen: torch.Generator) -> Tensor:
        return self.pair_steps(data, size, size, steps, gen)[1]

    def pair_steps(
        self, data: ClientData, inner_size: int, outer_size: int, steps: int, gen: torch.Generator
    ) -> tuple[Tensor, Tensor]:
        """``steps`` episodes, one after the other, stacked."""
        pairs = [self.pair(data, inner_size, outer_size, gen) for _ in range(steps)]
        if not pairs:  # no steps: no episodes, of the episodes' sizes
            empty = data.inner.new_empty
            return empty((0, self.ways * self.shots)), empty((0, self.ways * self.queries))
        return torch.stack([s for s, _ in pairs]), torch.stack([q for _, q in pairs])


@TASKS.register
class FewShot(TaskConfig):
    """N-way K-shot few-shot learning (``[task] name = "few_shot"``; see the module docstring).

    Attributes:
        ways: N, classes per episode (default 5).
        shots: K, support examples per class (default 5).
        queries: Q, query examples per class (default 15).
        inner_l2: L2 weight on the head y in g (default 0.01).
        test_classes: the meta-test classes of a data set whose splits share their classes
            (default: the upper half); must stay unset for one whose splits are disjoint.
        test_episodes: episodes of the evaluation (default 600; at least 500 for the
            literature's confidence intervals, fewer only for quick checks).
        head_l2 / head_steps / head_lr: the per-episode head fit of the evaluation.
        head: ``"classes"`` (default): one head row per meta-training class, an episode's
            softmax over its own classes; ``"episode"``: N rows, an episode's classes assigned
            to them in a random order (see the module docstring).
        prototypes: also report ProtoNet's nearest-prototype accuracy (default off).
    """

    name: Literal["few_shot"]
    ways: int = Field(5, ge=2, description="N: classes per episode")
    shots: int = Field(5, ge=1, description="K: support examples per class")
    queries: int = Field(15, ge=1, description="Q: query examples per class")
    inner_l2: float = InnerL2(1e-2)
    test_classes: list[int] | None = Field(
        None,
        min_length=2,
        description="meta-test classes of a data set whose splits share their classes (default: "
        "the upper half); unset for one whose splits are disjoint (Omniglot)",
    )
    test_episodes: int = Field(600, ge=1, le=100_000, description="evaluation episodes")
    head_l2: float = Field(1e-2, ge=0, allow_inf_nan=False, description="L2 of the fitted heads")
    head_steps: int = Field(200, ge=1, le=100_000, description="gradient steps per head fit")
    head_lr: StepSize = Field(
        1.0, gt=0, allow_inf_nan=False, description="step of the head fit (<= 1000 without --force)"
    )
    head: Literal["classes", "episode"] = Field(
        "classes", description="head rows: one per class, or N relabelled per episode"
    )
    prototypes: bool = Field(
        False,
        description="also report the nearest-prototype rule's accuracy (ProtoNet's) on the "
        "same test episodes",
    )

    episodic: ClassVar[bool] = True
    # added after configs were first stored (see Section)
    dump_omits_defaults: ClassVar[tuple[str, ...]] = ("prototypes",)

    @model_validator(mode="after")
    def _episode_fits(self) -> FewShot:
        if self.test_classes is not None and len(set(self.test_classes)) < self.ways:
            raise ValueError(
                f"test_classes has {len(set(self.test_classes))} classes, fewer than ways = "
                f"{self.ways}"
            )
        return self

    # -- losses (the BilevelProblem) ---------------------------------------------------------
    def _cross_entropy(self, logits: Tensor, targets: Tensor) -> Tensor:
        if self.head == "classes":
            return episode_cross_entropy(logits, targets)
        # episode head: an example's label is its class's slot; batches are grouped by class
        # in slot order (EpisodeSampler with shuffle), so the slots are 0..N-1, each repeated
        per_class = targets.shape[-1] // self.ways
        slots = torch.arange(self.ways, device=logits.device).repeat_interleave(per_class)
        return cross_entropy(logits, slots)

    def inner_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        loss = self._cross_entropy(forward(module, x, y, buffers, batch.inputs), batch.targets)
        return loss + l2_penalty(y, self.inner_l2) if self.inner_l2 else loss

    def outer_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        return self._cross_entropy(forward(module, x, y, buffers, batch.inputs), batch.targets)

    def prototype_loss(
        self, module: nn.Module, x: Params, y: Params, buffers: Params, batch: Batch
    ) -> Tensor:
        """ProtoNet's episode loss (Snell et al. 2017, eq. 2): ``batch`` is an episode's
        support set followed by its query set (``ways * shots`` then ``ways * queries``
        examples, each grouped by class in slot order, as :class:`EpisodeSampler` draws them),
        embedded in one forward pass; the cross-entropy of the query examples' logits
        :func:`prototype_logits` against their slots. Only x shapes the features: y (the head)
        is evaluated but gets a zero gradient."""
        features = head_inputs(module, x, y, buffers, batch.inputs)
        split = self.ways * self.shots
        logits = prototype_logits(features[:split], features[split:], self.ways)
        slots = torch.arange(self.ways, device=logits.device).repeat_interleave(self.queries)
        return cross_entropy(logits, slots)

    def num_outputs(self, train: Any) -> int:
        return self.ways if self.head == "episode" else int(train.num_classes)

    def build(self, train: Any) -> FewShot:
        return self

    # -- data ------------------------------------------------------------------------------
    def split_data(self, train: Any, test: Any, disjoint: bool) -> tuple[Any, Any]:
        """(meta-train set, meta-test set) with labels renumbered from 0 (see the module
        docstring)."""
        if disjoint:  # the splits hold different classes (Omniglot): as they are
            if self.test_classes is not None:
                raise ValueError(
                    "test_classes is for data sets whose splits share their classes; "
                    f"{train.name} and {test.name} already have disjoint classes"
                )
            meta_train, meta_test = train, test
        else:
            classes = train.num_classes
            held = (
                list(range(classes // 2, classes))
                if self.test_classes is None
                else sorted(set(self.test_classes))
            )
            bad = [c for c in held if not 0 <= c < classes]
            if bad:
                raise ValueError(
                    f"test_classes {bad} are not classes of {train.name} (0..{classes - 1})"
                )
            features = torch.cat([train.features, test.features])
            labels = torch.cat([train.labels, test.labels])
            is_test = torch.isin(labels, torch.tensor(held))
            meta_train = Dataset(
                features[~is_test], labels[~is_test], classes, f"{train.name}/meta-train"
            )
            meta_test = Dataset(
                features[is_test], labels[is_test], classes, f"{train.name}/meta-test"
            )
        return _renumbered(meta_train), _renumbered(meta_test)

    def sampler(self, train: Any, clients: Sequence[ClientData]) -> EpisodeSampler:
        """Episodes of each client's own classes; every client must hold ``ways`` classes with
        ``shots + queries`` examples each."""
        sampler = EpisodeSampler(
            train.labels, self.ways, self.shots, self.queries, shuffle=self.head == "episode"
        )
        need = self.shots + self.queries
        for i, data in enumerate(clients):
            counts = [idx.numel() for idx in sampler.members(data).values()]
            usable = sum(n >= need for n in counts)
            if usable < self.ways:
                raise ValueError(
                    f"client {i} holds {usable} classes with at least shots + queries = {need} "
                    f"examples, a {self.ways}-way episode needs {self.ways}; use fewer clients, "
                    "fewer ways, shots or queries, or a partition that keeps more classes per "
                    "client"
                )
        return sampler

    def evaluator(
        self,
        model: nn.Module,
        test: Any,
        outer_names: Sequence[str],
        inner_names: Sequence[str],
        calibration: Tensor | None,
        seed: int,
    ) -> FewShotEvaluator:
        return FewShotEvaluator(self, model, test, outer_names, inner_names, calibration, seed)


def _renumbered(data: Any) -> Any:
    """``data`` with its classes renumbered 0..C-1 in increasing order."""
    classes, labels = torch.unique(data.labels, return_inverse=True)
    return Dataset(data.features, labels, int(classes.numel()), data.name)


class FewShotEvaluator:
    """Meta-test accuracy of a model state: fixed episodes of the meta-test classes, a fitted
    linear head per episode (see the module docstring). Returns ``accuracy`` (mean over
    episodes), ``accuracy_ci95`` (half-width of its 95 % interval), ``loss`` (mean query
    cross-entropy of the fitted heads) and ``episodes``; with the task's ``prototypes`` also
    ``prototype_accuracy`` and ``prototype_accuracy_ci95``, the nearest-prototype rule on the
    same features."""

    def __init__(
        self,
        task: FewShot,
        model: nn.Module,
        test: Any,
        outer_names: Sequence[str],
        inner_names: Sequence[str],
        calibration: Tensor | None,
        seed: int,
    ) -> None:
        self.task, self.model, self.test = task, model, test
        self.outer, self.inner = set(outer_names), set(inner_names)
        self.calibration = calibration
        members = _class_members(test.labels.cpu(), torch.arange(len(test)))
        gen = generator(seed, Stream.EVALUATION)
        episodes = [
            draw_episode(members, task.ways, task.shots, task.queries, gen)
            for _ in range(task.test_episodes)
        ]
        self.support = torch.stack([s for s, _ in episodes])  # [E, N*K]
        self.query = torch.stack([q for _, q in episodes])  # [E, N*Q]

    def features(self, x: Params, y: Params, buffers: Params, index: Tensor) -> Tensor:
        """The head's input for the test examples ``index`` (any shape), L2-normalised."""
        flat = index.reshape(-1)
        unique, inverse = torch.unique(flat, return_inverse=True)
        captured = [
            head_inputs(self.model, x, y, buffers, self.test.features[part])
            for part in unique.split(_EVAL_BATCH)
        ]
        feats = F.normalize(torch.cat(captured), dim=-1)
        return feats[inverse].reshape(*index.shape, -1)

    def __call__(self, state: Params) -> dict[str, float]:
        task, model = self.task, self.model
        was_training = model.training
        try:
            with torch.no_grad():
                x, y, b = split_state(state, self.outer, self.inner)
                if self.calibration is not None:
                    b = calibrate_batchnorm(model, x, y, b, self.calibration)
                model.eval()
                support = self.features(x, y, b, self.support)  # [E, N*K, d]
                query = self.features(x, y, b, self.query)  # [E, N*Q, d]
        finally:
            model.train(was_training)
        ways = task.ways
        slots = torch.arange(ways, device=support.device)
        s_targets = slots.repeat_interleave(task.shots).expand(len(support), -1)
        q_targets = slots.repeat_interleave(task.queries).expand(len(query), -1)
        weight, bias = fit_heads(
            support, s_targets, ways, task.head_l2, task.head_steps, task.head_lr
        )
        logits = query @ weight.transpose(1, 2) + bias.unsqueeze(1)
        hits = (logits.argmax(-1) == q_targets).double().mean(-1)  # [E]
        loss = F.cross_entropy(logits.flatten(0, 1), q_targets.flatten()).item()
        accuracy, ci = _mean_and_ci95(hits)
        out = {
            "accuracy": accuracy,
            "accuracy_ci95": ci,
            "loss": loss,
            "episodes": float(hits.numel()),
        }
        if task.prototypes:
            nearest = prototype_logits(support, query, ways).argmax(-1)
            accuracy, ci = _mean_and_ci95((nearest == q_targets).double().mean(-1))
            out |= {"prototype_accuracy": accuracy, "prototype_accuracy_ci95": ci}
        return out


def fit_heads(
    features: Tensor, targets: Tensor, ways: int, l2: float, steps: int, lr: float
) -> tuple[Tensor, Tensor]:
    """Multinomial logistic regression of every episode at once: ``weight [E, N, d]`` and
    ``bias [E, N]`` minimising the support cross-entropy plus ``l2 / 2 ||weight||^2`` by
    ``steps`` steps of full-batch gradient descent from zero (the gradient written out: it is
    the same convex problem for every episode, and batched matrix products fit all of them in
    one pass). With L2-normalised features the loss is (1/2 + l2)-smooth, so ``lr = 1``
    converges for ``l2 <= 0.5``."""
    episodes, n, d = features.shape
    onehot = F.one_hot(targets, ways).to(features.dtype)  # [E, n, N]
    weight = features.new_zeros(episodes, ways, d)
    bias = features.new_zeros(episodes, ways)
    for _ in range(steps):
        probs = torch.softmax(features @ weight.transpose(1, 2) + bias.unsqueeze(1), dim=-1)
        delta = (probs - onehot) / n  # [E, n, N]
        weight = weight - lr * (delta.transpose(1, 2) @ features + l2 * weight)
        bias = bias - lr * delta.sum(1)
    return weight, bias
