"""Hypergradient estimators: ``∇_x f − ∇²_xy g · v`` with ``v ≈ [∇²_yy g]⁻¹ ∇_y f``.

Every estimator is a frozen, configured callable with the :class:`HypergradEstimator`
signature ``estimator(outer_loss, inner_loss, x, y, *, generator=None, state=None) ->
HypergradResult``:

* :class:`ImplicitCG`, :class:`Neumann` -- implicit hypergradient, second-order products by
  autograd double backward (RABO eq. (7));
* :class:`FiniteDifference` -- second-order free, coordinate-wise finite differences on a
  sampled coordinate set (RAFBO, Alg. 2, with the printed formula's error corrected);
* :class:`FirstOrder` -- the fully first-order penalty estimator of FedSVRBGD-FO, stateful
  (warm-started ``y_λ`` and ``z``; see :func:`init_state`).

:class:`SecondOrderProducts` (:class:`AutogradProducts`, :class:`FiniteDifferenceProducts`)
give the ``∇²_yy g · v`` and ``∇²_xy g · v`` products that simultaneous methods need.
"""

from radbo.hypergrad.base import (
    HypergradEstimator,
    HypergradResult,
    ImplicitSystem,
    InnerSystem,
    TensorTuple,
    init_state,
    tuple_axpy,
    tuple_dot,
)
from radbo.hypergrad.cg import ImplicitCG, solve_cg
from radbo.hypergrad.finite_difference import FiniteDifference
from radbo.hypergrad.first_order import FirstOrder
from radbo.hypergrad.neumann import Neumann
from radbo.hypergrad.products import (
    AutogradProducts,
    FiniteDifferenceProducts,
    ProductResult,
    SecondOrderProducts,
)

__all__ = [
    "AutogradProducts",
    "FiniteDifference",
    "FiniteDifferenceProducts",
    "FirstOrder",
    "HypergradEstimator",
    "HypergradResult",
    "ImplicitCG",
    "ImplicitSystem",
    "InnerSystem",
    "Neumann",
    "ProductResult",
    "SecondOrderProducts",
    "TensorTuple",
    "init_state",
    "solve_cg",
    "tuple_axpy",
    "tuple_dot",
]
