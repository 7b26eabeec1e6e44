"""State dicts of a sharded model: full (the unsharded model's keys) and sharded (for DCP).

The sharded form holds one DTensor per flat group, sharded on dim 0 over the group, of the
group's unpadded length. Padding never reaches the checkpoint, and the per-rank pieces
follow DTensor's even chunking (``ceil(numel / world)`` each, the last ones shorter or
empty), which is exactly the shard layout, so ``torch.distributed.checkpoint`` can load a
checkpoint into a model sharded over another number of ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import ZeroError
from .shard import FLAT_PREFIX, sharded

__all__ = ["full_state_dict", "load_full_state_dict", "load_sharded_state_dict", "sharded_state_dict"]


def _buffers(module) -> dict:
    """The model's own state_dict entries other than the flat shards: buffers, extra state."""
    return {k: v for k, v in module.state_dict().items() if FLAT_PREFIX not in k.rpartition(".")[2]}


def _gather_fp32(flat) -> torch.Tensor:
    out = torch.empty(flat.world * flat.shard_numel, dtype=torch.float32, device=flat.shard.device)
    from .ops import _all_gather

    flat.wait(_all_gather(out, flat.shard.detach(), group=flat.group, async_op=True), "all-gather (state dict)")
    return out


@torch.no_grad()
def full_state_dict(module, *, rank0_only: bool = False) -> dict:
    """Full fp32 parameters and the buffers, under the unsharded model's keys and order.

    A snapshot: every tensor is a copy (buffers too, unlike ``nn.Module.state_dict``), so
    training on does not change it. A collective: every rank must call it. With
    ``rank0_only`` other ranks get ``{}``.
    """
    z = sharded(module)
    values = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in _buffers(module).items()}
    for flat in z.flats:
        full = _gather_fp32(flat)
        for fqns, offset, shape in flat.params:
            n = torch.Size(shape).numel()
            value = full[offset:offset + n].view(shape).clone()
            for fqn in fqns:
                values[fqn] = value  # shared parameters: one tensor under each key, as torch does
    if rank0_only and dist.get_rank(z.group) != 0:
        return {}
    return {k: values[k] for k in z.keys}


def _check_keys(z, state_dict, expected) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"expected a state dict (a dict of tensors), got {type(state_dict).__name__}")
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise ZeroError(
            f"state dict does not match the sharded model: missing keys {missing[:5]}, unexpected "
            f"keys {unexpected[:5]}{' (and more)' if len(missing) > 5 or len(unexpected) > 5 else ''}. "
            "A full state dict uses the unsharded model's keys (full_state_dict); a sharded one "
            "comes from sharded_state_dict."
        )


@torch.no_grad()
def load_full_state_dict(module, state_dict: dict) -> None:
    """Load a full state dict (the unsharded model's keys): each rank keeps its shard of it."""
    z = sharded(module)
    _check_keys(z, state_dict, z.keys)
    for flat in z.flats:
        lo = flat.rank * flat.shard_numel
        full = torch.zeros(flat.world * flat.shard_numel, dtype=torch.float32, device=flat.shard.device)
        for fqns, offset, shape in flat.params:
            value = state_dict[fqns[0]]
            if tuple(value.shape) != shape:
                raise ZeroError(
                    f"state dict entry {fqns[0]!r} has shape {tuple(value.shape)} but the parameter "
                    f"is {shape}; load a state dict saved from this model."
                )
            full[offset:offset + value.numel()].copy_(value.reshape(-1))
        flat.shard.copy_(full[lo:lo + flat.shard_numel])  # in place: bumps the version, drops stale prefetches
    buffers = {k: state_dict[k] for k in _buffers(module)}
    module.load_state_dict(buffers, strict=False)


def _mesh(z):
    if z.mesh is None:
        from torch.distributed.device_mesh import DeviceMesh

        device = z.flats[0].shard.device.type if z.flats else "cpu"
        z.mesh = DeviceMesh.from_group(z.group, device)
    return z.mesh


def _valid(flat) -> int:
    """How many of this rank's shard elements are parameters rather than padding."""
    return max(0, min(flat.shard_numel, flat.numel - flat.rank * flat.shard_numel))


def sharded_state_dict(module) -> dict:
    """``{flat group key: DTensor of its unpadded flat, Shard(0)}`` plus buffers, for DCP.

    The DTensors view the shards: ``torch.distributed.checkpoint.load`` into this dict
    writes the model's parameters; call :func:`load_sharded_state_dict` after it anyway,
    which copies whatever did not land in place.
    """
    from torch.distributed.tensor import DTensor, Shard

    z = sharded(module)
    mesh = _mesh(z)
    values = {}
    for flat in z.flats:
        local = flat.shard.detach()[:_valid(flat)]
        values[flat.fqn] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                              shape=torch.Size([flat.numel]), stride=(1,))
    values.update(_buffers(module))
    return values


@torch.no_grad()
def load_sharded_state_dict(module, state_dict: dict) -> None:
    """Load what :func:`sharded_state_dict` made (after ``dcp.load`` filled it)."""
    from torch.distributed.tensor import DTensor

    z = sharded(module)
    buffers = _buffers(module)
    _check_keys(z, state_dict, [f.fqn for f in z.flats] + list(buffers))
    for flat in z.flats:
        value = state_dict[flat.fqn]
        local = value.to_local() if isinstance(value, DTensor) else value
        n = _valid(flat)
        if tuple(local.shape) != (n,):
            raise ZeroError(
                f"sharded state dict entry {flat.fqn!r} holds {tuple(local.shape)} elements on rank "
                f"{flat.rank}, the shard needs ({n},); make it with sharded_state_dict(model) on "
                "this model and fill it with torch.distributed.checkpoint.load."
            )
        flat.shard[:n].copy_(local)
    module.load_state_dict({k: state_dict[k] for k in buffers}, strict=False)
