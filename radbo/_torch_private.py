"""Every private PyTorch name radbo relies on, in one module, with the assumption made of each.

PyTorch exports these only from private modules (``torch.utils._python_dispatch``,
``torch.utils._pytree``, ``torch._ops``), so a release may change them without notice. Keeping
them here, each with the one assumption radbo makes of it, means an upgrade that breaks one
fails ``tests/test_torch_private.py`` under the assumption's name instead of surfacing as a
wrong FLOP count or memory peak; ``tests/test_architecture.py`` checks that no other radbo
module imports a private torch name. Where a public API does the same, radbo uses it instead
(the ``CompositeImplicitAutograd`` test of :mod:`radbo.flops` is
``OpOverload.has_kernel_for_dispatch_key`` with ``torch.DispatchKey``, no longer
``torch._C._dispatch_has_kernel_for_dispatch_key``).

The assumptions, one test each:

1. :class:`TorchDispatchMode` -- a subclass's ``__torch_dispatch__`` receives every aten
   operator run inside ``with mode:``, those of autograd's backward included (the FLOP counter
   of :mod:`radbo.flops` counts backward and double backward this way; the memory tracker of
   :func:`radbo.devices.measure_peak_memory` sees every allocation). PyTorch documents the mode
   ("Extending PyTorch", ``__torch_dispatch__``) but exports the class from a private module.
2. :func:`current_dispatch_mode` -- the innermost dispatch mode entered and not yet exited
   (``None`` when there is none): :func:`radbo.flops.repeated` pops the counter only when it is
   the innermost mode.
3. :func:`pop_mode_temporarily` -- a context manager that takes the innermost dispatch mode off
   the stack for its duration, so that operators inside it run at full speed without reaching
   the mode, and puts it back afterwards, also when the block raises (the repeated blocks of
   :mod:`radbo.flops` whose count is known).
4. :data:`HigherOrderOperator` -- the type of the higher-order operators (``torch.cond``, ...)
   that reach a dispatch mode; aten operators are not of it. The lean counter leaves them to
   ``FlopCounterMode``, which has rules for them.
5. :func:`tree_flatten` -- the leaves of nested tuples, lists and dicts (an operator's
   arguments and keyword arguments, its outputs), in order, as its first return value.
6. :func:`is_batchedtensor` -- inside ``torch.vmap``, ``True`` for a tensor that carries the
   mapped dimension (an input mapped over, or a result computed from one) and ``False`` for one
   that does not; ``False`` outside vmap. radbo asks it through :func:`carries_vmap_dim`:
   :func:`radbo.problem.cross_entropy` takes its direct path only for such tensors (a stacked
   cohort's loss), where PyTorch runs its Python decomposition of ``nll_loss_forward``, whose
   operations that path runs bitwise alike, and a stacked cohort's large linear layers take
   ``radbo.models.functional._StackedLinear``. ``None`` where this PyTorch lacks the name:
   radbo then calls ``F.cross_entropy`` and ``F.linear`` everywhere.
"""

from __future__ import annotations

from torch import Tensor
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as current_dispatch_mode
from torch.utils._python_dispatch import _pop_mode_temporarily as pop_mode_temporarily
from torch.utils._pytree import tree_flatten

try:
    from torch._C._functorch import is_batchedtensor
except ImportError:  # pragma: no cover - every PyTorch radbo supports has it
    is_batchedtensor = None  # type: ignore[assignment]

__all__ = [
    "HigherOrderOperator",
    "TorchDispatchMode",
    "carries_vmap_dim",
    "current_dispatch_mode",
    "is_batchedtensor",
    "pop_mode_temporarily",
    "tree_flatten",
]


def carries_vmap_dim(*tensors: Tensor) -> bool:
    """Whether one of ``tensors`` carries a ``torch.vmap`` dimension (:func:`is_batchedtensor`);
    ``False`` where this PyTorch lacks the name."""
    return is_batchedtensor is not None and any(is_batchedtensor(t) for t in tensors)
