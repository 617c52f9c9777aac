"""Structured masks: channel groups, mask policies, submodel extraction and scatter back.

Four concerns stay apart (as in Torch-Pruning): structural coupling
(:class:`StructurePlan`), importance (:meth:`StructurePlan.group_scores`), selection
(:mod:`radbo.masks.policies`) and application (:mod:`radbo.masks.index`: index sets ->
submodel tensors and back).
"""

from radbo.masks.coverage_report import CoverageTracker, RoundCoverage
from radbo.masks.index import alias, dense_mask, extract, index_set_numel, restrict, scatter
from radbo.masks.policies import (
    CoveragePolicy,
    FiarsePolicy,
    ImportancePolicy,
    LeadingPolicy,
    MaskPolicy,
    OAPPolicy,
    RandomPolicy,
    RollingPolicy,
    RoundPreparedPolicy,
)
from radbo.masks.structure import StructurePlan, kept_count

__all__ = [
    "CoveragePolicy",
    "CoverageTracker",
    "FiarsePolicy",
    "ImportancePolicy",
    "LeadingPolicy",
    "MaskPolicy",
    "OAPPolicy",
    "RandomPolicy",
    "RollingPolicy",
    "RoundCoverage",
    "RoundPreparedPolicy",
    "alias",
    "StructurePlan",
    "dense_mask",
    "extract",
    "index_set_numel",
    "kept_count",
    "restrict",
    "scatter",
]
