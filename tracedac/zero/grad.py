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
    the whole model rather than one per parameter (with tensor parallel, one more over TP
    for the gradients TP shards; replicated ones count once). Scales the gradients in place
    and returns the total norm. A collective: every rank must call it.
    """
    z = sharded(module)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    # By the mesh dimensions besides the sharded one that cut the parameter (tensor parallel):
    # the same buckets on every rank, from the parameters, whichever have a gradient.
    buckets: dict[tuple, list] = {}
    for p in module.parameters():
        nd = p.device_mesh.ndim > 1  # (a submodule sharded before without TP: 1-D)
        dims = tuple(d for d, pl in enumerate(p.placements) if nd and d != z.dp_dim and pl.is_shard())
        buckets.setdefault(dims, [])
        if p.grad is not None:
            buckets[dims].append(p.grad.to_local())
    keys = sorted(buckets)
    grads = [g for k in keys for g in buckets[k]]
    device = grads[0].device if grads else torch.device("cpu")
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    local = torch.zeros(len(keys), dtype=torch.float64, device=device)  # sums in fp64: many shards
    for i, k in enumerate(keys):
        for g in buckets[k]:
            if inf:
                local[i] = torch.maximum(local[i], g.abs().max().double()) if g.numel() else local[i]
            else:
                local[i] += g.double().abs().pow(norm_type).sum()
    dist.all_reduce(local, op=op, group=z.group)
    for i, k in enumerate(keys):
        for d in k:
            dist.all_reduce(local[i : i + 1], op=op, group=z.mesh.get_group(d))
    total = (local.max() if inf else local.sum().pow(1.0 / norm_type)).float()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total
