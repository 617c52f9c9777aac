"""The assumptions radbo makes of private PyTorch names (radbo/_torch_private.py), one test each,
and of the public API that replaced one, so that a PyTorch upgrade breaking one fails here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radbo._torch_private import (
    HigherOrderOperator,
    TorchDispatchMode,
    current_dispatch_mode,
    is_batchedtensor,
    pop_mode_temporarily,
    tree_flatten,
)


class Recorder(TorchDispatchMode):
    """Records the aten operators that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_1_a_dispatch_mode_sees_forward_and_backward_operators() -> None:
    a = torch.ones(3, 4, requires_grad=True)
    b = torch.ones(4, 2)
    with Recorder() as recorder:
        (a @ b).sum().backward()
    mms = [op for op in recorder.ops if op is torch.ops.aten.mm.default]
    assert len(mms) == 2  # a @ b forward, and grad_a = grad_out @ b.T in backward
    assert a.grad is not None and torch.equal(a.grad, torch.full((3, 4), 2.0))


def test_2_the_current_dispatch_mode_is_the_innermost_one_entered() -> None:
    assert current_dispatch_mode() is None
    with Recorder() as outer:
        assert current_dispatch_mode() is outer
        with Recorder() as inner:
            assert current_dispatch_mode() is inner
        assert current_dispatch_mode() is outer
    assert current_dispatch_mode() is None


def test_3_popping_the_mode_hides_operators_from_it_until_the_block_ends() -> None:
    a = torch.ones(2, 2)
    with Recorder() as recorder:
        with pop_mode_temporarily():
            assert current_dispatch_mode() is None
            a @ a
        assert recorder.ops == [] and current_dispatch_mode() is recorder
        with pytest.raises(RuntimeError, match="boom"), pop_mode_temporarily():
            raise RuntimeError("boom")
        assert current_dispatch_mode() is recorder  # put back after an exception too
        a @ a
    assert recorder.ops == [torch.ops.aten.mm.default]


def test_4_higher_order_operators_have_their_type_and_aten_operators_do_not() -> None:
    assert isinstance(torch.ops.higher_order.cond, HigherOrderOperator)
    assert not isinstance(torch.ops.aten.mm.default, HigherOrderOperator)


def test_5_tree_flatten_gives_the_leaves_of_an_operator_s_arguments_in_order() -> None:
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    leaves, _ = tree_flatten(((a, [b, 1.5]), {"out": c, "dim": 0}))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    assert len(tensors) == 3 and all(t is u for t, u in zip(tensors, (a, b, c), strict=True))
    assert [x for x in leaves if not isinstance(x, torch.Tensor)] == [1.5, 0]


def test_6_is_batchedtensor_marks_the_tensors_that_carry_a_vmap_dimension() -> None:
    assert is_batchedtensor is not None
    seen: list[tuple[bool, bool, bool]] = []

    def probe(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        made = torch.arange(3.0)  # from no mapped input
        seen.append((is_batchedtensor(a), is_batchedtensor(a * 2 + made), is_batchedtensor(made)))
        return a + b

    torch.vmap(probe, in_dims=(0, None))(torch.ones(4, 3), torch.ones(3))
    assert seen == [(True, True, False)]
    assert not is_batchedtensor(torch.ones(2))


def test_the_public_kernel_query_finds_composite_implicit_kernels() -> None:
    """radbo.flops decomposes an operator without a FLOP formula when it has a
    CompositeImplicitAutograd kernel: ``linear`` has one (it is ``addmm``/``matmul``), ``mm``
    and ``add`` do not; the public query answers what the private
    ``torch._C._dispatch_has_kernel_for_dispatch_key`` answered."""
    key = torch.DispatchKey.CompositeImplicitAutograd
    assert torch.ops.aten.linear.default.has_kernel_for_dispatch_key(key)
    assert not torch.ops.aten.mm.default.has_kernel_for_dispatch_key(key)
    assert not torch.ops.aten.add.Tensor.has_kernel_for_dispatch_key(key)
    for op in (torch.ops.aten.linear.default, torch.ops.aten.mm.default):
        private = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)
        assert op.has_kernel_for_dispatch_key(key) == private
