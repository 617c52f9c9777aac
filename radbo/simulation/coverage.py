"""The engine's coverage report: per variable block, how the round's index sets cover it.

:class:`CoverageBlocks` keeps one :class:`~radbo.masks.coverage_report.CoverageTracker` per
block the run reports (``Simulation.coverage``, e.g. ``{"x": outer names, "y": inner
names}``), folds in each round's index sets, and saves and restores the trackers for
checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from radbo.masks.coverage_report import CoverageTracker
from radbo.masks.index import coverage_counts
from radbo.schema import short
from radbo.typing import IndexSet

__all__ = ["CoverageBlocks", "check_coverage_history"]


@dataclass
class CoverageBlocks:
    """The coverage trackers of a run.

    Attributes:
        blocks: ``{block: tensor names}``, the variable blocks reported.
        shapes: full-model shape of every tensor.
        trackers: one tracker per block, made on the first round with clients.
    """

    blocks: Mapping[str, Sequence[str]]
    shapes: Mapping[str, torch.Size]
    trackers: dict[str, CoverageTracker] = field(default_factory=dict)

    def update(self, index_sets: Sequence[IndexSet], weights: Sequence[float]) -> dict[str, Any]:
        """Fold a round's index sets into the trackers; its metrics per block: ``coverage_{b}_
        min`` (C* over trained coordinates, RABO Definition 3), ``untrained_fraction_{b}``,
        ``never_trained_fraction_{b}`` (so far) and ``coverage_{b}_histogram``. Clients of
        weight 0 hold nothing (:func:`radbo.masks.index.coverage_counts`)."""
        out: dict[str, Any] = {}
        for block, names in self.blocks.items():
            counts = coverage_counts(index_sets, {n: self.shapes[n] for n in names}, weights)
            tracker = self.trackers.setdefault(block, CoverageTracker(names))
            cov = tracker.update(counts)
            out[f"coverage_{block}_min"] = float(cov.min_coverage)
            out[f"untrained_fraction_{block}"] = cov.untrained_fraction
            out[f"never_trained_fraction_{block}"] = cov.never_trained_fraction
            out[f"coverage_{block}_histogram"] = cov.histogram
        return out

    def state_dict(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The trackers: never-trained masks as ``coverage/{block}/{name}`` tensors, and their
        JSON data by block."""
        tensors: dict[str, Tensor] = {}
        data: dict[str, Any] = {}
        for block, tracker in self.trackers.items():
            masks, meta = tracker.state_dict()
            tensors.update({f"coverage/{block}/{n}": t for n, t in masks.items()})
            data[block] = meta
        return tensors, data

    def restored(self, tensors: Mapping[str, Tensor], data: Any) -> tuple[CoverageBlocks, set[str]]:
        """The trackers of :meth:`state_dict` output ``(tensors, data)`` (``data`` ``None``:
        none yet), checked against this run, and the names of the tensors they took;
        ``ValueError`` when they do not fit. This object is left as it is.

        The blocks and tensor names must be this run's, each never-trained mask a bool tensor
        of its model tensor's shape (present once a round had clients) whose count of
        never-trained entries is the one the coverage history ends with, and the history's
        sizes this run's.
        """
        data = data or {}
        if not isinstance(data, Mapping):
            raise ValueError(f"the engine's coverage state is {type(data).__name__}")
        trackers: dict[str, CoverageTracker] = {}
        known: set[str] = set()
        for block, meta in data.items():
            if block not in self.blocks:
                raise ValueError(
                    f"coverage of block {block!r} is tracked, which this run does not track"
                )
            prefix = f"coverage/{block}/"
            masks = {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}
            trackers[block] = self._tracker(block, masks, meta)
            known.update(f"{prefix}{n}" for n in masks)
        if trackers and set(trackers) != set(self.blocks):
            missing = sorted(set(self.blocks) - set(trackers))
            raise ValueError(f"the coverage of block(s) {missing} is not in the engine state")
        return CoverageBlocks(self.blocks, self.shapes, trackers), known

    def _tracker(
        self, block: str, masks: Mapping[str, Tensor], meta: Mapping[str, Any]
    ) -> CoverageTracker:
        """The tracker of ``block`` restored from its never-trained ``masks`` and JSON
        ``meta``, checked (see :meth:`restored`)."""
        names = list(self.blocks[block])
        prefix = f"coverage/{block}/"
        expected = names if meta.get("history") else []  # masks exist after a round
        if sorted(masks) != sorted(expected):
            raise ValueError(
                f"the never-trained masks of block {block!r} are of {sorted(masks)}, this "
                f"run tracks {sorted(names)}"
            )
        for name, t in masks.items():
            shape = tuple(self.shapes[name])
            if t.dtype != torch.bool or tuple(t.shape) != shape:
                raise ValueError(
                    f"tensor '{prefix}{name}' is {t.dtype} {tuple(t.shape)}, this run's "
                    f"mask of {name!r} is torch.bool {shape}"
                )
        history = meta.get("history") or []
        numel = sum(math.prod(self.shapes[n]) for n in names)
        if any(entry["numel"] != numel for entry in history):
            raise ValueError(
                f"the coverage history of block {block!r} counts other than this run's "
                f"{numel} entries"
            )
        if history:
            never = sum(int((~masks[n]).sum()) for n in names)
            if history[-1]["never_trained_fraction"] != (never / numel if numel else 0.0):
                raise ValueError(
                    f"the never-trained masks of block {block!r} hold {never} of {numel} "
                    "entries never trained, not the fraction its coverage history ends with"
                )
        tracker = CoverageTracker(names)
        tracker.load_state_dict(masks, meta)
        return tracker


def check_coverage_history(coverage: Mapping[str, Any], rows: list[dict[str, Any]]) -> None:
    """A checkpoint's coverage trackers (their JSON state) against its round records: those
    of the blocks the rounds report (when a round had clients), each with one history entry
    per round that had clients, equal to what the rounds report; raises ``ValueError`` saying
    what does not fit."""
    busy = [row for row in rows if row["clients"]]
    reported = {
        k[len("coverage_") : -len("_min")]
        for row in busy
        for k in row
        if isinstance(k, str) and k.startswith("coverage_") and k.endswith("_min")
    }
    if busy and set(coverage) != reported:
        raise ValueError(
            f"the engine tracks coverage of {sorted(coverage)}, the rounds report "
            f"{sorted(reported)}"
        )
    for block, tracker in coverage.items():
        rounds = [entry["round"] for entry in tracker["history"]]
        if rounds != list(range(len(busy))):
            raise ValueError(
                f"the coverage history of {block!r} has {len(rounds)} rounds numbered "
                f"{short(rounds)}, but {len(busy)} rounds had clients"
            )
        _check_block_history(block, tracker["history"], busy)


def _check_block_history(
    block: str, history: list[dict[str, Any]], busy: list[dict[str, Any]]
) -> None:
    """Each entry of a block's coverage history against the round record that reports it (its
    C*, fractions and histogram), and each running C* against the entries before it."""
    lowest = 0  # the smallest running C* so far that is not 0
    for entry, row in zip(history, busy, strict=True):
        reported = {
            f"coverage_{block}_min": float(entry["min_coverage"]),
            f"untrained_fraction_{block}": entry["untrained_fraction"],
            f"never_trained_fraction_{block}": entry["never_trained_fraction"],
            f"coverage_{block}_histogram": entry["histogram"],
        }
        wrong = [k for k, v in reported.items() if row.get(k) != v or type(row[k]) is not type(v)]
        if wrong:
            raise ValueError(
                f"round {row['round']} reports {wrong[0]} = {short(row.get(wrong[0]))}, "
                f"its coverage history {short(reported[wrong[0]])}"
            )
        now = entry["min_coverage"]
        trained = [c for c in (lowest, now) if c > 0]
        expected = min(trained) if trained else 0
        if entry["min_coverage_so_far"] != expected:
            raise ValueError(
                f"the coverage history of {block!r} has C* so far "
                f"{entry['min_coverage_so_far']} in its round {entry['round']}, not {expected}"
            )
        lowest = expected
