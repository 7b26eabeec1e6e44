"""Tensor subclasses inside a region (docs/design.md, "Tensor subclasses"): the recorder
declines an op on a subclass, records the plain ops its dispatch calls, and saves it as its
inner tensors. Checked in one process with torch's test-only ``TwoTensor`` (a wrapper whose
every op runs on two plain tensors); DTensor on real process groups is
tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing._internal.two_tensor import TwoTensor

import tracedac
from tracedac import CheckpointError, policies

from .util import OpCounter

POLICIES = {
    "recompute_all": policies.recompute_all,
    "save_matmuls": policies.save_matmuls,
    "memory_budget(0.3)": lambda: policies.memory_budget(0.3),
    "min_cut": policies.min_cut,
}


def block(x, w):
    h = F.dropout((x @ w).sin(), 0.3)  # a random op on a subclass: both halves draw numbers
    return (h * h).exp().sum(-1)


def _inputs():
    torch.manual_seed(0)
    x = TwoTensor(torch.randn(4, 8), torch.randn(4, 8)).requires_grad_()
    return x, torch.randn(8, 8, requires_grad=True)


def _grads(fn, x, w):
    torch.manual_seed(1)
    out = fn(x, w)
    return (out, *torch.autograd.grad(out.sum(), (x, w)))


@pytest.mark.parametrize("name", POLICIES)
def test_a_region_of_subclass_tensors_gives_the_gradients_of_no_checkpointing(name):
    x, w = _inputs()
    want = _grads(block, x, w)
    got = _grads(tracedac.checkpoint(block, policy=POLICIES[name]()), x, w)
    assert type(got[0]) is TwoTensor and type(got[1]) is TwoTensor
    for a, b in zip(got, want):
        if isinstance(a, TwoTensor):
            assert torch.equal(a.a, b.a) and torch.equal(a.b, b.b)
        else:
            assert torch.equal(a, b)


def test_recompute_all_keeps_no_inner_tensor_and_backward_replays_the_ops_the_subclass_ran():
    x, w = _inputs()
    report = tracedac.saved_report(block, x, w, policy=policies.recompute_all())
    assert [r for r in report.rows if r.kind == "activation"] == []
    assert report.replay_ops > 0
    out = tracedac.checkpoint(block)(x, w)
    with OpCounter() as counted:
        out.sum().backward()
    # each half of the TwoTensor: its matmul and sine replayed (each op once per half)
    assert counted.counts[torch.ops.aten.mm] >= 2 and counted.counts[torch.ops.aten.sin] == 2


def test_save_matmuls_keeps_the_matmuls_a_subclass_dispatches_to():
    x, w = _inputs()
    report = tracedac.saved_report(block, x, w, policy=policies.save_matmuls())
    kept = [r.op for r in report.rows if r.kind == "activation"]
    assert kept == ["aten.mm.default"] * 2  # one per inner tensor


class Opaque(torch.Tensor):
    """A wrapper with a dispatch of its own and no ``__tensor_flatten__``: it cannot be taken
    apart and put back together."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, dtype=elem.dtype, requires_grad=elem.requires_grad
        )

    def __init__(self, elem):
        self.elem = elem.detach()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Opaque) else t  # noqa: E731
        wrap = lambda t: Opaque(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        out = func(
            *torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {})
        )
        return torch.utils._pytree.tree_map(wrap, out)


def _opaque_grad(fn, write=False):
    x = Opaque(torch.randn(3, requires_grad=True))
    y = x * 2.0
    out = fn(y)
    if write:
        with torch.no_grad():
            y.add_(1.0)
    (g,) = torch.autograd.grad(out.sum(), x)
    return g.elem


def test_a_subclass_that_cannot_be_taken_apart_is_held_as_eager_holds_it():
    f = lambda t: t.sin() * t  # noqa: E731
    torch.manual_seed(0)
    want = _opaque_grad(f)
    torch.manual_seed(0)
    assert torch.equal(_opaque_grad(tracedac.checkpoint(f)), want)
    torch.manual_seed(0)
    with pytest.raises(
        CheckpointError, match=r"a Opaque of shape \[3\] saved for backward .* modified by an inplace"
    ):
        _opaque_grad(tracedac.checkpoint(f), write=True)


def test_a_subclass_input_written_after_the_forward_is_refused_as_eager_refuses_it():
    for fn in (block, tracedac.checkpoint(block)):
        x, w = _inputs()
        y = x * 1.0  # a non-leaf, so that it can be written in place
        out = fn(y, w)
        with torch.no_grad():
            y.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


@pytest.mark.parametrize("name", ["recompute_all", "min_cut"])
def test_a_gradient_penalty_through_a_subclass_region_equals_eager(name):
    def penalty(fn):
        torch.manual_seed(0)
        x = TwoTensor(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
        x.requires_grad_()
        w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
        f = lambda x, w: ((x @ w).tanh() * (x @ w).sigmoid()).sum()  # noqa: E731
        (gx,) = torch.autograd.grad(fn(f)(x, w), x, create_graph=True)
        (gw,) = torch.autograd.grad((gx * gx).sum(), w)
        return gw

    want = penalty(lambda f: f)
    got = penalty(lambda f: tracedac.checkpoint(f, policy=POLICIES[name]()))
    assert torch.allclose(got.a, want.a, rtol=0, atol=1e-10) and torch.allclose(
        got.b, want.b, rtol=0, atol=1e-10
    )
