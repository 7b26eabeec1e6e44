"""``tracedac::label``: ``tracedac.name(t, label)`` as an op, so the label survives tracing
(as JAX's ``name_p``).

Forward: a copy of ``t`` (a custom op cannot return an alias of its input). Backward: the
gradient, unchanged. The joint-graph pass (``passes/tag_regions.py``) reads the label onto
the node that produced ``t`` and removes the op before the partitioner runs, so a compiled
graph never copies; a graph the pass did not see stays correct.
"""

from __future__ import annotations

import torch

__all__ = ["name_op"]


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
