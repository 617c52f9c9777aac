"""Hypergradient estimators: ``∇_x f − ∇²_xy g · v`` with ``v ≈ [∇²_yy g]⁻¹ ∇_y f``.

Every estimator is a frozen, configured callable with the :class:`HypergradEstimator`
signature ``estimator(outer_loss, inner_loss, x, y) -> HypergradResult``.
"""

from radbo.hypergrad.base import (
    HypergradEstimator,
    HypergradResult,
    ImplicitSystem,
    TensorTuple,
    tuple_axpy,
    tuple_dot,
)
from radbo.hypergrad.cg import ImplicitCG, solve_cg
from radbo.hypergrad.neumann import Neumann

__all__ = [
    "HypergradEstimator",
    "HypergradResult",
    "ImplicitCG",
    "ImplicitSystem",
    "Neumann",
    "TensorTuple",
    "solve_cg",
    "tuple_axpy",
    "tuple_dot",
]
