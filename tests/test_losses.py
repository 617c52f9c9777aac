"""radbo.problem.cross_entropy and nll_loss: F.cross_entropy and F.nll_loss, bit for bit, inside
torch.vmap (a stacked cohort's loss, where they run PyTorch's decomposition's operations
directly) and outside it (where they are the functions themselves)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import radbo._torch_private as _torch_private
from radbo.problem import PAD_TARGET, cross_entropy, nll_loss
from tests.helpers import OpLog


def _cohort(dtype: torch.dtype, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 7, 10, generator=gen, dtype=dtype) * 3
    targets = torch.randint(0, 10, (5, 7), generator=gen)
    if padded:  # a ragged cohort: the last examples of some clients are padding
        targets[1, 5:] = PAD_TARGET
        targets[3, 6] = PAD_TARGET
    return logits, targets


def _derivatives(loss_fn, logits: torch.Tensor, targets: torch.Tensor):
    """The stacked losses, their gradient and a Hessian-vector product (double backward), as
    a cohort's local step and CG product take them."""
    z = logits.clone().requires_grad_(True)
    losses = torch.vmap(loss_fn)(z, targets)
    (g,) = torch.autograd.grad(losses.sum(), z, create_graph=True)
    v = torch.linspace(-1, 1, z.numel(), dtype=z.dtype).view_as(z)
    (hv,) = torch.autograd.grad((g * v).sum(), z)
    return losses.detach(), g.detach(), hv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padded", [False, True])
def test_a_stacked_cross_entropy_is_pytorchs_bit_for_bit(dtype: torch.dtype, padded: bool):
    logits, targets = _cohort(dtype, padded)
    ours = _derivatives(cross_entropy, logits, targets)
    theirs = _derivatives(F.cross_entropy, logits, targets)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    if padded:  # a padded example counts for nothing: the mean over the real ones
        real = F.cross_entropy(logits[1, :5], targets[1, :5])
        torch.testing.assert_close(ours[0][1], real, rtol=0, atol=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("padded", [False, True])
def test_a_stacked_nll_loss_is_pytorchs_bit_for_bit(padded: bool):
    """With weighted rows, as radbo.tasks.vs_loss scales them (through log_softmax, so that the
    second derivative is not zero)."""
    logits, targets = _cohort(torch.float32, padded)
    weights = torch.linspace(0.5, 2.0, 10)

    def ours(z, t):
        return nll_loss(torch.log_softmax(z, -1) * weights, t)

    def theirs(z, t):
        return F.nll_loss(torch.log_softmax(z, -1) * weights, t)

    mine, pytorchs = _derivatives(ours, logits, targets), _derivatives(theirs, logits, targets)
    for a, b in zip(mine, pytorchs, strict=True):
        assert torch.equal(a, b)


def test_the_direct_path_runs_fewer_operations_than_the_decomposition():
    logits, targets = _cohort(torch.float32, padded=False)
    with OpLog() as ours:
        torch.vmap(cross_entropy)(logits, targets)
    with OpLog() as theirs:
        torch.vmap(F.cross_entropy)(logits, targets)
    assert len(ours.names) < len(theirs.names), (ours.names, theirs.names)


def test_outside_vmap_and_for_other_shapes_they_are_pytorchs_functions(monkeypatch):
    logits, targets = _cohort(torch.float32, padded=True)
    assert torch.equal(cross_entropy(logits[0], targets[0]), F.cross_entropy(logits[0], targets[0]))
    lp = torch.log_softmax(logits[1], -1)
    assert torch.equal(nll_loss(lp, targets[1]), F.nll_loss(lp, targets[1]))
    # one example per client (1-D logits, a 0-d target): PyTorch's own path under vmap
    stacked = torch.vmap(cross_entropy)(logits[:, 0], targets[:, 0].clamp(min=0))
    assert torch.equal(
        stacked, torch.vmap(F.cross_entropy)(logits[:, 0], targets[:, 0].clamp(min=0))
    )
    # a PyTorch without the private name: F.cross_entropy everywhere, the same numbers
    monkeypatch.setattr(_torch_private, "is_batchedtensor", None)
    calls = []
    monkeypatch.setattr(F, "cross_entropy", lambda *a, **k: calls.append(1) or torch.zeros(()))
    torch.vmap(cross_entropy)(logits, targets)
    assert calls
