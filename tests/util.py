"""Helpers shared by the tests: run a function with and without tracedac and compare."""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tracedac


class OpCounter(TorchDispatchMode):
    """Counts aten ops by packet (``torch.ops.aten.mm``) while active."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def grads(fn, args, kwargs=None, seed=0, wrt=None):
    """Output and gradients of ``fn(*args)`` (w.r.t. tensors requiring grad among args, or ``wrt``)."""
    torch.manual_seed(seed)
    out = fn(*args, **(kwargs or {}))
    loss = out if isinstance(out, torch.Tensor) else out[0]
    inputs = wrt if wrt is not None else [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return out, torch.autograd.grad(loss, inputs)


def assert_same_grads(fn, args, policy=None, seed=0, wrt=None):
    """Checkpointed ``fn`` gives bitwise the same output and gradients as ``fn``."""
    out0, g0 = grads(fn, args, seed=seed, wrt=wrt)
    out1, g1 = grads(tracedac.checkpoint(fn, policy=policy), args, seed=seed, wrt=wrt)
    assert torch.equal(out0, out1)
    for a, b in zip(g0, g1, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
