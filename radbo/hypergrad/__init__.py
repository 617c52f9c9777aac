"""Hypergradient estimators: the ``[estimator]`` section of a run config.

Every estimator is a frozen, validated config section and a callable (:class:`Estimator`):

* :class:`ImplicitCG`, :class:`Neumann` -- implicit hypergradient ``∇_x f − ∇²_xy g · v`` with
  ``v ≈ [∇²_yy g]⁻¹ ∇_y f``, second-order products by autograd double backward (RABO eq. (7));
* :class:`FiniteDifference` -- second-order free, coordinate-wise finite differences on a
  sampled coordinate set (RAFBO, Alg. 2, with the printed formula's error corrected); also
  finite-difference products;
* :class:`FirstOrder` -- the fully first-order penalty estimator of FedSVRBGD-FO, stateful
  (warm-started ``y_λ`` and ``z``; see :func:`init_state`);
* :class:`Autograd` -- exact second-order products only, for algorithms that track ``v``
  themselves.

The arithmetic lives in :mod:`radbo.autodiff`.
"""

from radbo.hypergrad.autograd import Autograd
from radbo.hypergrad.base import (
    ESTIMATORS,
    Estimator,
    HypergradResult,
    MemoryFootprint,
    init_state,
)
from radbo.hypergrad.cg import ImplicitCG
from radbo.hypergrad.finite_difference import FiniteDifference
from radbo.hypergrad.first_order import FirstOrder
from radbo.hypergrad.neumann import Neumann

#: The estimator interface (kept under its former name).
HypergradEstimator = Estimator

__all__ = [
    "ESTIMATORS",
    "Autograd",
    "Estimator",
    "FiniteDifference",
    "FirstOrder",
    "HypergradEstimator",
    "HypergradResult",
    "ImplicitCG",
    "MemoryFootprint",
    "Neumann",
    "init_state",
]
