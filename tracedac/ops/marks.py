"""The compile path's marks: ``tracedac::region`` and ``tracedac::label``.

- ``tracedac::region(key)``: does nothing; a compiled region's key written into the traced
  graph's code (why: ``compile/entry.py``). Kept by dead-code elimination
  (``has_side_effect``) until ``compile/passes/tag_regions.py`` removes it.
- ``tracedac::label(x, label)``: ``tracedac.name(t, label)`` as an op, so the label survives
  tracing (as JAX's ``name_p``). Forward: a copy of ``x`` (a custom op cannot return an alias
  of its input). Backward: the gradient, unchanged. The joint-graph pass reads the label onto
  the node that produced ``x`` and removes the op before the partitioner runs, so a compiled
  graph never copies; a graph the pass did not see stays correct.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

__all__ = ["MARK", "name_op", "region_mark"]


@torch.library.custom_op("tracedac::region", mutates_args=())
def region_mark(key: str) -> None:
    """Does nothing: the region's key, written into the traced graph."""


@region_mark.register_fake
def _(key):
    return None


MARK = torch.ops.tracedac.region.default
has_side_effect(MARK)


@torch.library.custom_op("tracedac::label", mutates_args=())
def name_op(x: torch.Tensor, label: str) -> torch.Tensor:
    """Forward: ``x`` (copied); ``label`` is for tracedac's policies."""
    return x.clone()


@name_op.register_fake
def _(x, label):
    return torch.empty_like(x)


def _backward(ctx, grad):
    """Backward: the gradient of ``x`` is the gradient of the result."""
    return grad, None


name_op.register_autograd(_backward)
