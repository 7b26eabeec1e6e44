"""State dicts of a sharded model, under the model's own keys.

Sharded (for resuming, on any world size): the parameters *are* ``Shard(0)`` DTensors, so
``model.state_dict()``, torch's ``get_state_dict`` / ``set_state_dict`` and
``torch.distributed.checkpoint`` work unchanged, optimizer state included, and DCP
reshards a checkpoint to another number of ranks (``checkpoint.py``: ``save_checkpoint``,
``load_checkpoint``).

Full (the unsharded model's tensors, for a plain model or a single file):
``full_state_dict`` / ``load_full_state_dict``, one all-gather per group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import ZeroError
from .module import sharded
from .tp import global_value, local_value

__all__ = ["full_state_dict", "load_full_state_dict"]


def _full_parameters(module) -> dict:
    """id(DTensor parameter) -> its full fp32 value (views of one gathered buffer per group)."""
    values = {}
    for g in sharded(module).all_groups:
        padded = g.gather_fp32()
        for s in g.slices:
            values[id(s.param)] = global_value(s, s.full(padded, g.world))  # TP: the full tensor
    return values


@torch.no_grad()
def full_state_dict(module, *, rank0_only: bool = False) -> dict:
    """Full fp32 parameters and the buffers, under the unsharded model's keys and order.

    A snapshot: every tensor is a copy (buffers too, unlike ``nn.Module.state_dict``), so
    training on does not change it; a parameter shared under two keys is one tensor, as
    torch's state dicts have it. A collective: every rank must call it. With ``rank0_only``
    other ranks get ``{}``.
    """
    z = sharded(module)
    module = z.module  # the model itself: its keys, not a compiled wrapper's
    full = _full_parameters(module)
    params = dict(module.named_parameters(remove_duplicate=False))
    copies: dict = {}
    out = {}
    for key, value in module.state_dict().items():
        p = params.get(key)
        if p is not None and id(p) in full:
            if id(p) not in copies:
                copies[id(p)] = full[id(p)].clone()
            out[key] = copies[id(p)]
        else:
            out[key] = value.clone() if isinstance(value, torch.Tensor) else value
    if rank0_only and dist.get_rank(z.group) != 0:
        return {}
    return out


def _check_keys(state_dict, expected) -> None:
    if not isinstance(state_dict, dict):
        raise TypeError(f"expected a state dict (a dict of tensors), got {type(state_dict).__name__}")
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing or unexpected:
        raise ZeroError(
            f"state dict does not match the sharded model: missing keys {missing[:5]}, unexpected "
            f"keys {unexpected[:5]}{' (and more)' if len(missing) > 5 or len(unexpected) > 5 else ''}. "
            "A full state dict uses the unsharded model's keys, as full_state_dict makes it."
        )


@torch.no_grad()
def load_full_state_dict(module, state_dict: dict) -> None:
    """Load a full state dict (the unsharded model's keys): each rank keeps its rows of each
    parameter. Every rank passes the same full values (for rank 0's only, use torch's
    ``set_model_state_dict(..., options=StateDictOptions(full_state_dict=True,
    broadcast_from_rank0=True))``)."""
    module = sharded(module).module
    _check_keys(state_dict, list(module.state_dict()))
    params = dict(module.named_parameters(remove_duplicate=False))
    for key, p in params.items():
        g = getattr(p, "_tracedac_group", None)
        if g is None:
            continue
        value = state_dict[key]
        if (
            not isinstance(value, torch.Tensor)
            or tuple(value.shape) != tuple(p.shape)
            or value.dtype != p.dtype
        ):
            got = (
                f"{tuple(value.shape)} {value.dtype}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise ZeroError(
                f"state dict entry {key!r} is {got} but the parameter is {tuple(p.shape)} {p.dtype}; "
                "load a state dict saved from this model."
            )
        s = p._tracedac_slice
        s.local(g.local).copy_(s.rows_of(local_value(s, value), g.rank, g.world))
    module.load_state_dict({k: v for k, v in state_dict.items() if k not in params}, strict=False)
