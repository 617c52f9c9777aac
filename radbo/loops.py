"""The loops of client work, owned by the framework: local steps over a cohort, and the marks
of repeated work that the FLOP meter reads.

An algorithm writes *one* local step, ``step(t, carry) -> (carry, Work)``, and hands it to
:func:`local_steps` (or :meth:`radbo.client.Cohort.local_steps`, which passes the cohort's
step counts). The loop

* runs the step for every client of a cohort at once -- in a stacked cohort clients finish
  after different numbers of steps, and a client past its last step keeps its carry: every
  tensor of the carry is frozen per client (:func:`radbo.autodiff.tuple_where`), so nothing a
  finished client computes leaks, NaN included;
* marks each step as a repeated block for the FLOP meter (:func:`radbo.flops.repeated`):
  inside a count, the first step of a kind is counted operation by operation and the others
  run at full speed and add its count (``uniform = False`` for steps whose products differ);
* counts the work: the gradients and second-order products each client did, summed over the
  steps it ran (what it would have done alone).

Solvers stay pure and get their marks from here too: :func:`repeating` makes the marks of one
repeated computation; :func:`cg_product` wraps the product an estimator hands to
:func:`radbo.autodiff.solve_cg` so that each call is one marked block, and
:func:`cg_iteration_flops` reads the FLOPs of one CG iteration back from a count. No
algorithm or estimator imports :mod:`radbo.flops`.

>>> import torch
>>> def step(t, carry):
...     (w,) = carry
...     return (w + 1.0,), Work(n_grad=1)
>>> out = local_steps(step, (torch.zeros(3, 2),), [1, 3, 2], name="doc.step")
>>> out.carry[0][:, 0].tolist(), out.n_grad
([1.0, 3.0, 2.0], [1, 3, 2])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch import Tensor

from radbo.autodiff import TensorTuple, tuple_where
from radbo.flops import new_scope, repeated

__all__ = [
    "CG",
    "LocalSteps",
    "Mark",
    "Work",
    "cg_iteration_flops",
    "cg_product",
    "local_steps",
    "repeating",
]

C = TypeVar("C")

#: Marks one block of a repeated computation: ``with mark(*part): ...``.
Mark = Callable[..., AbstractContextManager[Any]]

#: The name of the blocks of :func:`radbo.autodiff.solve_cg`'s products (:func:`cg_product`).
CG = "solve_cg"

_NO_BLOCK = nullcontext()


class Work(NamedTuple):
    """The work of one local step: first-order gradient evaluations and second-order
    (Hessian- or Jacobian-vector) products, a number for every client alike or one per client
    of the cohort."""

    n_grad: int | Sequence[int] = 0
    n_hvp: int | Sequence[int] = 0


@dataclass(frozen=True)
class LocalSteps(Generic[C]):
    """What :func:`local_steps` returns: the final carry and, per client, the gradients and
    products of the steps it ran (for :meth:`radbo.client.Cohort.replies`)."""

    carry: C
    n_grad: list[int]
    n_hvp: list[int]


def repeating(name: str) -> Mark:
    """The marks of one repeated computation named ``name`` (one CG solve, one client's local
    loop): ``mark(*part)`` is a :func:`radbo.flops.repeated` block keyed ``(name, scope,
    *part)`` with a scope of its own, so that blocks of two calls never share a count. Blocks
    with equal parts must run the same matrix products on tensors of the same shapes."""
    scope = new_scope()

    def mark(*part: Any) -> AbstractContextManager[Any]:
        return repeated(name, scope, *part)

    return mark


def cg_product(
    matvec: Callable[[TensorTuple], TensorTuple],
) -> Callable[[TensorTuple], TensorTuple]:
    """``matvec`` for one :func:`radbo.autodiff.solve_cg` whose products are all the same
    (radbo's Hessian-vector products), every call marked as one repeated block: a FLOP count
    counts one product and reuses it, and :func:`cg_iteration_flops` reads its FLOPs back.

    Only the product is marked: the rest of a CG iteration (step sizes, vector updates, inner
    products) is elementwise work and reductions, which the FLOP counter does not count
    (``tests/flops/test_flop_meter.py`` checks that a solve with a free product counts 0), so one
    product is all one more iteration adds."""
    mark = repeating(CG)

    def product(u: TensorTuple) -> TensorTuple:
        with mark("product"):
            return matvec(u)

    return product


def cg_iteration_flops(blocks: Mapping[tuple[Any, ...], int]) -> int | None:
    """The FLOPs one more iteration adds to a count of work with one
    :func:`radbo.autodiff.solve_cg` whose product is marked by :func:`cg_product`
    (``blocks``: :func:`radbo.flops.count_flops`'s block counts), or ``None`` when the count
    does not show it: repeated blocks of other kinds, or several solves. Every iteration runs
    the same product and otherwise costs no counted FLOPs, so work that differs only in its
    number of CG iterations differs by this many FLOPs per iteration."""
    if not blocks or {key[0] for key in blocks} != {CG}:
        return None
    scopes = {key[1] for key in blocks}
    if len(scopes) != 1:
        return None
    (scope,) = scopes
    return blocks.get((CG, scope, "product"))


# ------------------------------------------------------------------------------- local steps
def _copy(tree: Any) -> Any:
    """``tree`` with every tensor cloned (dicts, tuples, named tuples and lists walked)."""
    if isinstance(tree, Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_copy(v) for v in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(_copy(v) for v in tree)
    return tree


def _where(active: Tensor, new: Any, old: Any) -> Any:
    """Per client, ``new`` where ``active`` holds and ``old`` elsewhere, for every tensor of the
    carry that is a tensor in both; anything else (counts, values first set now) is ``new``."""
    if isinstance(new, Tensor):
        if isinstance(old, Tensor):
            return tuple_where(active, (new,), (old,))[0]
        return new
    if isinstance(new, dict) and isinstance(old, dict):
        return {k: _where(active, v, old[k]) if k in old else v for k, v in new.items()}
    if isinstance(new, tuple) and isinstance(old, tuple) and len(new) == len(old):
        parts = (_where(active, n, o) for n, o in zip(new, old, strict=True))
        return type(new)(*parts) if hasattr(new, "_fields") else tuple(parts)
    if isinstance(new, list) and isinstance(old, list) and len(new) == len(old):
        return [_where(active, n, o) for n, o in zip(new, old, strict=True)]
    return new


def _per_client(value: int | Sequence[int], size: int) -> list[int]:
    if isinstance(value, int):
        return [value] * size
    out = [int(v) for v in value]
    if len(out) != size:
        raise ValueError(f"local_steps: a step's work names {len(out)} clients, not {size}")
    return out


def local_steps(
    step: Callable[[int, C], tuple[C, Work]],
    carry: C,
    steps: int | Sequence[int],
    *,
    name: str,
    uniform: bool = True,
    reverse: bool = False,
    counts: Tensor | None = None,
) -> LocalSteps[C]:
    """Run ``carry, work = step(t, carry)`` for ``t = 0, 1, ...`` (``reverse``: down to 0)
    up to the largest step count, for every client of a cohort at once.

    Args:
        step: one local step; ``carry`` holds the client state it moves (tensors, or dicts,
            tuples and lists of them; other values, such as counts, are passed through). It
            returns the new carry and its :class:`Work`. It may update tensors of the carry in
            place (BatchNorm running statistics): while some clients have finished, it gets a
            copy.
        carry: the state before the first step; tensors of a stacked cohort have the clients
            on their first dimension.
        steps: each client's number of steps (:attr:`radbo.client.Cohort.num_steps`), or one
            number for every client alike (then there is nothing to mask). A client past its
            last step keeps its carry (every tensor, per client); values that are no tensors
            take what the step returned.
        name: the name of the step's repeated block for the FLOP meter.
        uniform: every step runs the same matrix products on tensors of the same shapes (the
            default): each step is a :func:`radbo.flops.repeated` block, keyed by ``name``,
            one scope per call, and whether every client is still stepping. ``False``: no
            block (steps whose products differ, e.g. a random number of them).
        reverse: run the steps from the last one down to step 0 (a backward sweep: a client
            takes part in step ``t`` when ``t`` is below its count).
        counts: each client's number of steps as an integer tensor on the carry's device, for
            a run that may not read them on the host (a phase captured as a CUDA graph, where
            they change from one replay to the next): ``steps`` is then the number of steps
            run, the largest count, and every step is masked by ``t < counts``, computed on
            the device. A step every client runs gives the values it gives unmasked. The
            work returned counts every step run for every client (the caller knows the
            counts).

    Returns:
        The final carry, and per client (one entry for a single ``steps`` number) the
        gradients and products of the steps it ran.
    """
    if counts is not None and not isinstance(steps, int):
        raise TypeError("local_steps: with counts, steps is the number of steps run (an int)")
    host = [int(steps)] if isinstance(steps, int) else [int(n) for n in steps]
    size = len(host) if counts is None else int(counts.shape[0])
    total = max(host, default=0)
    n_grad = [0] * size
    n_hvp = [0] * size
    mark = repeating(name) if uniform else None
    order = reversed(range(total)) if reverse else range(total)
    for t in order:
        if counts is None:
            flags = [t < n for n in host]
            active = None if all(flags) else torch.tensor(flags)
        else:  # read on the device only: every step masked, its work counted for everyone
            flags = [True] * size
            active = counts > t
        with mark(active is None) if mark is not None else _NO_BLOCK:
            if active is None:
                carry, work = step(t, carry)
            else:  # clients past their last step keep what they had
                new, work = step(t, _copy(carry))
                carry = _where(active, new, carry)
        for c, (g, h) in enumerate(
            zip(_per_client(work.n_grad, size), _per_client(work.n_hvp, size), strict=True)
        ):
            if flags[c]:
                n_grad[c] += g
                n_hvp[c] += h
    return LocalSteps(carry, n_grad, n_hvp)
