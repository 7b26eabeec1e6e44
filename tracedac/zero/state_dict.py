"""State dicts of a sharded model, under the model's own keys.

Sharded (for resuming, on any world size): the parameters *are* ``Shard(0)`` DTensors, so
``model.state_dict()``, torch's ``get_state_dict`` / ``set_state_dict`` and
``torch.distributed.checkpoint`` work unchanged, optimizer state included, and DCP
reshards a checkpoint to another number of ranks. ``save_checkpoint`` /
``load_checkpoint`` are those standard calls in a row, plus one check DCP does not make:
a checkpoint entry of another dtype than the model's would be cast silently by
``dcp.load``; here it raises, as a missing entry or another shape does, naming the key.

Full (the unsharded model's tensors, for a plain model or a single file):
``full_state_dict`` / ``load_full_state_dict``, one all-gather per group.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .errors import ZeroError
from .module import sharded
from .tp import checkpoint_group, global_value, local_value

__all__ = ["full_state_dict", "load_checkpoint", "load_full_state_dict", "save_checkpoint"]


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


def _state(model, optimizer):
    """``get_state_dict`` of the sharded model itself (``sharded(m).module``: not a compiled
    wrapper, whose keys would carry ``_orig_mod.``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = () if optimizer is None else optimizer
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optim": optim_sd} if optimizer is not None else {"model": model_sd}


def save_checkpoint(checkpoint_id: str | os.PathLike, model, optimizer=None) -> None:
    """``dcp.save`` of ``get_state_dict(model, optimizer)`` under ``"model"`` and ``"optim"``:
    the model's own keys, each rank writing its shards. A collective (over the whole 2-D
    mesh with tensor parallel: every rank holds a piece)."""
    import torch.distributed.checkpoint as dcp

    z = sharded(model)
    dcp.save(_state(z.module, optimizer), checkpoint_id=checkpoint_id, process_group=checkpoint_group(z))


def load_checkpoint(checkpoint_id: str | os.PathLike, model, optimizer=None) -> None:
    """Resume ``model`` (and ``optimizer``) from ``save_checkpoint``'s directory, saved on any
    number of ranks: checks every entry against the checkpoint's metadata (present, same
    shape, same dtype: raises ``ZeroError`` naming the first key that is not), then
    ``dcp.load`` and ``set_state_dict``. A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    z = sharded(model)
    state = _state(z.module, optimizer)
    group = checkpoint_group(z)
    _check_against(dcp.FileSystemReader(checkpoint_id).read_metadata(), state, checkpoint_id, group)
    dcp.load(state, checkpoint_id=checkpoint_id, process_group=group)
    set_state_dict(
        z.module,
        () if optimizer is None else optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )


def _mismatch(saved: dict, flat: dict, where) -> str | None:
    """What makes this rank's model and the checkpoint disagree, or None."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        md = saved.get(key)
        if md is None:
            return (
                f"checkpoint {str(where)!r} has no entry {key!r}, which the model (or its "
                "optimizer) needs; it was saved from another model."
            )
        if not isinstance(md, TensorStorageMetadata):
            return f"checkpoint entry {key!r} is not a tensor, the model's is; saved from another model."
        if tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
            return (
                f"checkpoint entry {key!r} is {tuple(md.size)} {md.properties.dtype} but the model's is "
                f"{tuple(value.shape)} {value.dtype}; it was saved from another model (dcp.load would "
                f"{'cast it silently' if tuple(md.size) == tuple(value.shape) else 'refuse it'})."
            )
    return None


def _check_against(metadata, state: dict, where, group) -> None:
    """Refuse, on every rank of ``group`` alike, a checkpoint some rank's model disagrees with:
    each rank's keys and first mismatch are gathered before anyone raises (an expert-parallel
    model's ranks hold different experts, so one rank may find what the others do not; a rank
    raising alone would leave the others waiting in the gather)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    found = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, (list(flat), _mismatch(saved, flat, where)), group=group)
    problems = [(r, p) for r, (_, p) in enumerate(found) if p is not None]
    if problems:
        rank, problem = problems[0]
        raise ZeroError(f"{problem} (found by rank {rank} of the checkpoint's group)")
    # Entries no rank of the group has (the checkpoint holds every rank's experts)
    known = set().union(*(keys for keys, _ in found))
    prefixes = tuple(f"{k}." for k in state)
    extra = [k for k in saved if k.startswith(prefixes) and k not in known]
    if extra:
        raise ZeroError(
            f"checkpoint {str(where)!r} has entries the model does not: {extra[:5]}; it was "
            "saved from another model."
        )
