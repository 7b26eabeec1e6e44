"""Gradient clipping over the shards of every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .module import sharded

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a sharded model: the norm of the full gradient.

    The same as torch's on the DTensor gradients (which also works), in one all-reduce for
    the whole model rather than one per parameter. Scales the gradients in place and
    returns the total norm. A collective: every rank must call it.
    """
    z = sharded(module)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    grads = [p.grad.to_local() for p in module.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == float("inf"):
        local = max(
            (g.abs().max() for g in grads if g.numel()), default=torch.zeros((), device=device)
        ).float()
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=z.group)
        total = local
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)  # sums in fp64: many shards, one norm
        for g in grads:
            local += g.double().abs().pow(norm_type).sum()
        dist.all_reduce(local, group=z.group)
        total = local.pow(1.0 / norm_type).float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total
