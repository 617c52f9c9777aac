"""Structural coupling of a model's channels, on Torch-Pruning's dependency graph.

A :class:`StructurePlan` is built once per model architecture. It traces the model with
Torch-Pruning's ``DependencyGraph`` and records, per prunable group (keyed by the name of the
group's root ``Conv2d``/``Linear`` layer), which state-dict tensors the group slices, along which
dimension and at which indices. From then on, turning "these root channels are kept" into
per-tensor kept index sets (:meth:`StructurePlan.index_sets`) is pure index arithmetic: no model is
built. :meth:`StructurePlan.submodel` builds the physically smaller ``nn.Module`` when one is
needed (training it, exporting it, counting its FLOPs).

The four concerns of structured masks stay apart (as in Torch-Pruning): coupling (this module),
importance (:meth:`StructurePlan.group_scores`), selection (``radbo.masks.policies``) and
application (:mod:`radbo.masks.index`).
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch_pruning as tp
from torch import Tensor, nn

from radbo.masks.index import extract
from radbo.typing import IndexSet, Params

__all__ = ["StructurePlan", "kept_count"]


class _Handler(Protocol):
    """A Torch-Pruning pruning function: a method bound to its pruner (``__self__``), which
    prunes ``idxs`` channels of ``layer`` in place and may return it."""

    __name__: str
    __self__: Any  # a torch_pruning pruner (torch_pruning has no type information)

    def __call__(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module | None: ...


#: Key of one layer operation: (layer name, Torch-Pruning handler, pruning dim of the handler).
_OpKey = tuple[str, _Handler, int]


def kept_count(channels: int, ratio: float) -> int:
    """Number of channels kept out of ``channels`` at capacity ratio ``ratio``.

    ``ceil(channels * ratio)``, at least 1 and at most ``channels`` (HeteroFL's width rule, rounded
    up so that a ratio never keeps less than asked).

    >>> kept_count(10, 0.25), kept_count(10, 1.0), kept_count(1, 0.01)
    (3, 10, 1)
    """
    if channels < 1:
        raise ValueError(f"channels must be a positive integer, got {channels}")
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 < ratio <= 1.0:
        raise ValueError(
            f"capacity ratio must be a number in (0, 1], got {ratio!r}; "
            "use 1 to keep the whole group"
        )
    # Guard against float noise such as 0.3 * 10 = 3.0000000000000004.
    k = math.ceil(round(channels * ratio, 9))
    return min(channels, max(1, k))


@dataclass(frozen=True)
class _Slice:
    """One dimension of one state-dict tensor that a layer operation slices."""

    key: str  # state-dict key
    dim: int  # dimension sliced
    size: int  # full size of that dimension


@dataclass(frozen=True)
class _Item:
    """One group item restricted to what index sets need."""

    op: _OpKey
    idxs: Tensor  # indices of the layer dimension, in the layer's own full coordinates
    root_idxs: Tensor  # root channel of each entry of ``idxs``


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _set_tensor(module: nn.Module, name: str, value: Tensor) -> None:
    """Replace parameter or buffer ``name`` (dotted, relative to ``module``) by ``value``."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def _output_modules(model: nn.Module, output_layers: Sequence[str]) -> list[nn.Module]:
    """The modules named ``output_layers``, whose output channels are never pruned;
    :class:`ValueError` for a name that is not a submodule of ``model``."""
    ignored: list[nn.Module] = []
    for name in output_layers:
        try:
            ignored.append(model.get_submodule(name))
        except AttributeError:
            raise ValueError(
                f"output layer {name!r} is not a submodule of {type(model).__name__}; "
                "pass names as in model.named_modules()"
            ) from None
    return ignored


def _dependency_graph(model: nn.Module, example_inputs: Tensor) -> tp.DependencyGraph:
    """Torch-Pruning's dependency graph of ``model``, traced once on ``example_inputs`` (with
    gradients on; every module's training mode is put back after)."""
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.enable_grad():
            # parameters only a loss reads (a hyperparameter x) are outside the forward
            # graph; declaring them keeps Torch-Pruning from warning about them. They
            # belong to no group, so no plan ever prunes them.
            loss_only = [
                (model.get_parameter(n), 0) for n in getattr(model, "loss_only_parameters", ())
            ]
            return tp.DependencyGraph().build_dependency(
                model, example_inputs=example_inputs, unwrapped_parameters=loss_only or None
            )
    finally:
        for m, mode in modes.items():
            m.training = mode


class StructurePlan:
    """Prunable channel groups of a model and the tensors each one slices.

    Args:
        model: the (full, server) model. The plan keeps a reference: :meth:`load_state` writes
            into it and :meth:`group_scores` reads it.
        example_inputs: an input batch used once to trace the model (a batch of 1 is enough).
        output_layers: names of layers whose output channels must never be pruned (the
            classifier, e.g. ``BilevelModel.output_layers``).

    Attributes:
        groups: group name (root layer name) -> number of root channels, in model order.

    Grouped (non-depthwise) convolutions, bare ``nn.Parameter`` s, attention and recurrent layers
    are refused with ``NotImplementedError``: their Torch-Pruning handlers are not plain index
    selections. Extraction uses Torch-Pruning's shared handler objects and is not thread-safe.
    """

    def __init__(
        self, model: nn.Module, example_inputs: Tensor, output_layers: Sequence[str] = ()
    ) -> None:
        self.model = model
        self.output_layers = tuple(output_layers)
        module_names = {m: n for n, m in model.named_modules()}
        ignored = _output_modules(model, self.output_layers)
        self._graph = _dependency_graph(model, example_inputs)

        state = model.state_dict()
        self._shapes: dict[str, torch.Size] = {k: v.shape for k, v in state.items()}
        self._template: dict[str, tuple[None, ...]] = {
            k: (None,) * v.ndim for k, v in state.items()
        }

        found: dict[str, tuple[int, object, list[_Item]]] = {}
        self._slices: dict[_OpKey, list[_Slice]] = {}
        for group in self._graph.get_all_groups(
            ignored_layers=ignored, root_module_types=[nn.Conv2d, nn.Linear]
        ):
            gname = module_names[group[0].dep.target.module]
            found[gname] = (
                len(group[0].idxs),
                group,
                self._group_items(group, gname, module_names),
            )

        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        names = sorted(found, key=order.__getitem__)
        self.groups: dict[str, int] = {n: found[n][0] for n in names}
        self._tp_groups = {n: found[n][1] for n in names}
        self._items: dict[str, list[_Item]] = {n: found[n][2] for n in names}
        self._group_tensors = {
            n: {s.key for it in self._items[n] for s in self._slices[it.op]} for n in names
        }
        # Which (tensor, dim) pairs any group may slice; used to validate foreign index sets.
        self._prunable = {(s.key, s.dim) for sl in self._slices.values() for s in sl}

        skeleton = copy.deepcopy(model).to("meta")
        self._skeleton = skeleton

    # ------------------------------------------------------------------ construction helpers
    def _group_items(
        self, group: Any, gname: str, module_names: Mapping[nn.Module, str]
    ) -> list[_Item]:
        """The items of Torch-Pruning group ``gname`` that slice state (operation placeholders
        such as add, ReLU or flatten have none), learning each new operation's slices
        (:meth:`_learn_slices`); a bare ``nn.Parameter`` is refused."""
        items: list[_Item] = []
        for item in group.items:
            target = item.dep.target.module
            if isinstance(target, nn.Parameter):
                raise NotImplementedError(
                    f"group {gname!r} prunes a bare nn.Parameter, which radbo's structured "
                    "masks do not support; wrap it in an nn.Module"
                )
            lname = module_names.get(target)
            if lname is None:  # an operation placeholder (add, ReLU, flatten): no state
                continue
            op: _OpKey = (lname, item.dep.handler, int(item.dep.target.pruning_dim))
            if op not in self._slices:
                self._slices[op] = self._learn_slices(op)
            items.append(
                _Item(
                    op=op,
                    idxs=torch.as_tensor(list(item.idxs), dtype=torch.long),
                    root_idxs=torch.as_tensor(list(item.root_idxs), dtype=torch.long),
                )
            )
        return items

    def _learn_slices(self, op: _OpKey) -> list[_Slice]:
        """Apply ``op`` to a tagged copy of its layer and read off which dims it index-selects.

        Every tensor of the layer is replaced by a float64 ``arange`` (exact up to 2**53
        elements); the handler removes the even channels; each tensor must come out as an
        ``index_select`` of its tag along exactly one dimension, or be untouched.
        """
        lname, handler, pruning_dim = op
        layer = copy.deepcopy(self.model.get_submodule(lname))
        pruner = handler.__self__
        pruner.pruning_dim = pruning_dim
        if self._graph.is_out_channel_pruning_fn(handler):
            channels = pruner.get_out_channels(layer)
        else:
            channels = pruner.get_in_channels(layer)
        if channels is None:
            raise NotImplementedError(
                f"cannot tell how many channels {handler.__name__} prunes on layer {lname!r} "
                f"({type(layer).__name__})"
            )
        tags: dict[str, Tensor] = {}
        for name, tensor in layer.state_dict().items():
            tag = torch.arange(tensor.numel(), dtype=torch.float64).reshape(tensor.shape)
            _set_tensor(layer, name, tag)
            tags[name] = tag
        removed = list(range(0, channels, 2))
        kept = torch.tensor([i for i in range(channels) if i % 2 == 1], dtype=torch.long)
        layer = handler(layer, removed) or layer
        after = layer.state_dict()

        slices: list[_Slice] = []
        for name, tag in tags.items():
            new = after.get(name)
            if new is not None and new.ndim == tag.ndim:  # else not a plain index selection
                changed = [d for d in range(tag.ndim) if new.shape[d] != tag.shape[d]]
                if not changed and torch.equal(new, tag):
                    continue
                if len(changed) == 1:
                    dim = changed[0]
                    if tag.shape[dim] == channels and torch.equal(new, tag.index_select(dim, kept)):
                        slices.append(_Slice(_join(lname, name), dim, channels))
                        continue
            raise NotImplementedError(
                f"{handler.__name__} on layer {lname!r} ({type(layer).__name__}) does not slice "
                f"{name!r} as a plain index selection along one dimension (grouped convolutions, "
                "attention and recurrent layers are not supported)"
            )
        return slices

    # ------------------------------------------------------------------ public API
    @property
    def shapes(self) -> dict[str, torch.Size]:
        """Full shape of every tensor of the model's ``state_dict``."""
        return dict(self._shapes)

    def channels(self, group: str) -> int:
        """Number of root channels of ``group``; ``ValueError`` for an unknown group name."""
        try:
            return self.groups[group]
        except KeyError:
            raise ValueError(
                f"unknown group {group!r}; the prunable groups of this model are "
                f"{sorted(self.groups)}"
            ) from None

    def group_tensors(self, group: str) -> set[str]:
        """State-dict keys (parameters and buffers) that ``group`` slices."""
        self.channels(group)
        return set(self._group_tensors[group])

    def full_index_set(self) -> IndexSet:
        """The index set that keeps everything (every entry ``None``)."""
        return dict(self._template)

    def _kept_tensor(self, group: str, kept: Tensor | Sequence[int]) -> Tensor:
        channels = self.channels(group)
        idx = torch.as_tensor(kept)
        if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
            raise ValueError(
                f"kept channels of group {group!r} must be integer indices, got dtype {idx.dtype}"
            )
        if idx.ndim != 1:
            raise ValueError(
                f"kept channels of group {group!r} must be a 1-D index tensor, "
                f"got shape {tuple(idx.shape)}"
            )
        if idx.numel() == 0:
            raise ValueError(
                f"group {group!r} must keep at least one channel, got an empty kept set"
            )
        idx = idx.to(device="cpu", dtype=torch.long)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= channels:
            raise ValueError(
                f"kept channels of group {group!r} must lie in [0, {channels}), "
                f"got values from {lo} to {hi}"
            )
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError(f"kept channels of group {group!r} contain duplicate indices")
        return idx

    def index_sets(self, kept: Mapping[str, Tensor | Sequence[int]]) -> IndexSet:
        """Per-tensor kept index sets, in full-model coordinates, for kept root channels.

        Args:
            kept: per group name, the kept root-channel indices (any order). A group that is
                absent keeps all its channels.

        Returns:
            An :data:`~radbo.typing.IndexSet` with an entry for every tensor of
            ``model.state_dict()``: per dimension a sorted ``LongTensor`` of kept indices, or
            ``None`` where the dimension is whole. Flatten, concat and residual couplings are
            resolved by Torch-Pruning's index mapping (removed indices of a layer are
            ``item.idxs[drop[item.root_idxs]]``, merged over all groups touching that layer).

        Raises:
            ValueError: unknown group names, non-integer, out-of-range or duplicate indices,
                or an empty kept set.
        """
        removed: dict[tuple[str, int], list[Tensor]] = {}
        for group, channels_kept in kept.items():
            idx = self._kept_tensor(group, channels_kept)
            channels = self.groups[group]
            if idx.numel() == channels:
                continue
            drop = torch.ones(channels, dtype=torch.bool)
            drop[idx] = False
            for item in self._items[group]:
                rem = item.idxs[drop[item.root_idxs]]
                if rem.numel() == 0:
                    continue
                for s in self._slices[item.op]:
                    removed.setdefault((s.key, s.dim), []).append(rem)

        out: IndexSet = dict(self._template)
        for (key, dim), parts in removed.items():
            size = self._shapes[key][dim]
            mask = torch.ones(size, dtype=torch.bool)
            for rem in parts:
                mask[rem] = False
            entry = list(out[key])
            entry[dim] = mask.nonzero().squeeze(1)
            out[key] = tuple(entry)
        return out

    def submodel(self, index_set: IndexSet, state: Params | None = None) -> nn.Module:
        """A physically smaller ``nn.Module`` holding exactly ``extract(state, index_set)``.

        The model's meta-device skeleton is copied, Torch-Pruning's layer handlers shrink it,
        ``to_empty`` allocates it and ``load_state_dict`` fills it. ``state`` defaults to the
        plan's model ``state_dict``. The submodel is in the same training/eval mode as the model.

        Raises:
            ValueError: if ``index_set`` is not one this plan can realise (it prunes a dimension
                no group slices, or the tensors of one layer disagree).
        """
        if state is None:
            state = self.model.state_dict()
        missing = [k for k in self._shapes if k not in index_set]
        if missing:
            raise ValueError(f"index set has no entry for tensors {missing}")
        for key in self._shapes:
            for dim, entry in enumerate(index_set[key]):
                if entry is not None and (key, dim) not in self._prunable:
                    raise ValueError(
                        f"index set prunes dimension {dim} of {key!r}, which no prunable group "
                        "slices (output layers are never pruned)"
                    )
        sub = copy.deepcopy(self._skeleton)
        for op, slices in self._slices.items():
            if not slices:
                continue
            first = slices[0]
            entry = index_set[first.key][first.dim]
            if entry is None:
                kept_idx = None
            else:
                kept_idx = torch.as_tensor(entry, dtype=torch.long).cpu()
            for s in slices[1:]:
                other = index_set[s.key][s.dim]
                same = (other is None and kept_idx is None) or (
                    other is not None
                    and kept_idx is not None
                    and torch.equal(torch.as_tensor(other, dtype=torch.long).cpu(), kept_idx)
                )
                if not same:
                    raise ValueError(
                        f"index set is not structurally consistent: {first.key!r} dim "
                        f"{first.dim} and {s.key!r} dim {s.dim} must keep the same indices"
                    )
            if kept_idx is None:
                continue
            mask = torch.ones(first.size, dtype=torch.bool)
            mask[kept_idx] = False
            rem = mask.nonzero().squeeze(1).tolist()
            lname, handler, pruning_dim = op
            handler.__self__.pruning_dim = pruning_dim
            handler(sub.get_submodule(lname), rem)
        device = next(iter(state.values())).device if state else torch.device("cpu")
        sub = sub.to_empty(device=device)
        sub.load_state_dict(extract(state, index_set))
        sub.train(self.model.training)
        return sub

    def load_state(self, state: Params) -> None:
        """Copy ``state`` (a full-model state dict) into the plan's model, in place."""
        with torch.no_grad():
            self.model.load_state_dict(state)

    def group_scores(self, importance: str = "l2") -> dict[str, Tensor]:
        """One importance score per root channel of every group, from the model's current weights.

        ``importance`` is ``"l2"`` (default) or ``"l1"``: Torch-Pruning's
        ``GroupMagnitudeImportance(p)`` — the p-norm of each channel's slice of every coupled
        conv/linear/BN weight, each layer's scores divided by their mean, averaged over layers.
        A layer whose weights are all zero (a zero-initialised head) contributes zeros instead of
        Torch-Pruning's NaNs.
        """
        norms = {"l1": 1, "l2": 2}
        if importance not in norms:
            raise ValueError(f"importance must be one of {sorted(norms)}, got {importance!r}")
        scorer = tp.importance.GroupMagnitudeImportance(
            p=norms[importance], normalizer=_safe_mean_normalizer
        )
        scores: dict[str, Tensor] = {}
        for name, group in self._tp_groups.items():
            score = scorer(group)
            scores[name] = score.detach().to(device="cpu", dtype=torch.float32)
        return scores

    def connection_keys(self) -> list[str]:
        """State-dict keys of every ``Conv2d`` / ``Linear`` weight and bias, in model order:
        the model's connections (BatchNorm's affine parameters scale activations instead)."""
        return [
            _join(name, leaf)
            for name, module in self.model.named_modules()
            if isinstance(module, nn.Conv2d | nn.Linear)
            for leaf, _ in module.named_parameters(recurse=False)
        ]

    def connections_kept(self, kept: Mapping[str, Tensor | Sequence[int]]) -> int:
        """Number of connection entries (:meth:`connection_keys`) that keeping the root channels
        ``kept`` keeps (a group that is absent keeps all its channels)."""
        index_set = self.index_sets(kept)
        return sum(
            math.prod(
                size if axis is None else int(axis.numel())
                for size, axis in zip(self._shapes[key], index_set[key], strict=True)
            )
            for key in self.connection_keys()
        )

    def channel_magnitudes(self) -> dict[str, Tensor]:
        """Mean absolute weight per root channel of every group, from the model's current weights.

        A channel's magnitude is the mean of ``|w|`` over every connection entry
        (:meth:`connection_keys`) that removing the channel removes: its own output slice, the
        next layers' input slices, a residual partner's slices. It is per-parameter magnitude (as
        in FIARSE, whose importance of a parameter is ``|w|``) averaged over a structured
        channel, so it is comparable *across* groups: unlike :meth:`group_scores`, no layer is
        normalised by its own mean. float64, on the CPU.
        """
        state = self.model.state_dict()
        connections = set(self.connection_keys())
        magnitudes: dict[str, Tensor] = {}
        for group, channels in self.groups.items():
            total = torch.zeros(channels, dtype=torch.float64)
            count = torch.zeros(channels, dtype=torch.float64)
            for item in self._items[group]:
                for s in self._slices[item.op]:
                    if s.key not in connections:
                        continue
                    tensor = state[s.key].detach().to(device="cpu", dtype=torch.float64).abs()
                    rows = tensor.movedim(s.dim, 0).reshape(s.size, -1)
                    total.index_add_(0, item.root_idxs, rows.sum(1)[item.idxs])
                    per_entry = torch.full((item.idxs.numel(),), float(rows.shape[1]))
                    count.index_add_(0, item.root_idxs, per_entry.to(torch.float64))
            magnitudes[group] = total / count
        return magnitudes


def _safe_mean_normalizer(scores: Tensor) -> Tensor:
    """Torch-Pruning's ``"mean"`` normalizer, leaving an all-zero layer at zero (not NaN)."""
    mean = scores.mean()
    return scores / mean if bool(mean > 0) else scores
