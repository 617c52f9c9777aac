"""Float tolerances derived from the dtype and the operation count, never from one CPU's
printout (issue 25).

Two results computed in floating point differ between CPUs: PyTorch picks its kernels by the
CPU's instruction set (``ATEN_CPU_CAPABILITY`` = ``default``, ``avx2``, ``avx512``), and each
sums, fuses and vectorises in its own order. A bound may therefore be one of two kinds:

* **exact arithmetic**: both sides are computed the same way (``torch.equal``), or in float64
  where the claim is exact up to float64 rounding, and the bound is orders of magnitude above
  that rounding (say ``1e-10`` for an error that is ``1e-14``), or
* **derived**: ``k`` roundings of relative size at most ``u = eps / 2`` (the unit roundoff)
  on the longest path from input to output, amplified by the computation's own factors (a
  division by a step, a condition number, a sum of absolute values over the value itself).
  The classic bound for ``k`` roundings is ``γ_k · scale`` (:func:`gamma`); where two paths
  round independently their difference is at most twice that.

Each such bound carries its derivation in a comment beside it. The tests it guards carry the
``float_sensitive`` marker, which ``.ci/run`` runs under every kernel the CI machine offers.
"""

from __future__ import annotations

import torch

__all__ = ["gamma", "unit_roundoff"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of one rounding to nearest in ``dtype``.

    >>> unit_roundoff(torch.float32), unit_roundoff(torch.float64)
    (5.960464477539063e-08, 1.1102230246251565e-16)
    """
    return torch.finfo(dtype).eps / 2


def gamma(k: int, dtype: torch.dtype) -> float:
    """``γ_k = k·u / (1 − k·u)``: the relative error bound of ``k`` successive roundings in
    ``dtype`` (for a sum of ``k + 1`` terms, of the sum of their absolute values), valid while
    ``k·u < 1``.

    >>> round(gamma(10, torch.float32) / unit_roundoff(torch.float32), 6)
    10.000006
    """
    ku = k * unit_roundoff(dtype)
    if not 0 <= ku < 1:
        raise ValueError(f"gamma: k = {k} roundings exceed 1 / u in {dtype}")
    return ku / (1 - ku)
