"""Where ranks make their small agreements (ZeRO's order checks and "auto" decision, the replay
plans of regions that replay collectives) without waiting for the device.

On NCCL an agreement's rows are CUDA tensors: copying them in and reading the verdict back
waits for every kernel queued before it, so a check before each collective stopped the host
from running ahead of the GPU at every collective (a world of one rank skips the checks, which
is why the one-GPU runs never showed it). ``host_group(group)`` is ``group`` itself where it
moves CPU tensors (gloo, or a group with a CPU backend beside its device one, such as
``"cpu:gloo,cuda:nccl"``); for NCCL, a gloo group of the same ranks, made the first time each
of them asks (``new_group(..., use_local_synchronization=True)``: only the group's ranks take
part) and kept while the group lives. Other backends keep their group and the caller's device.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

__all__ = ["host_group"]

_CPU = torch.device("cpu")
_COMPANIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # NCCL group -> its gloo twin


def _backend(group) -> str:
    return str(dist.get_backend(group))


def host_group(group, device: torch.device) -> tuple:
    """``(process group, device)`` for a small agreement among ``group``'s ranks: its rows
    live on that device and go through that group. ``device``: the caller's buffers', used
    where the backend is neither gloo nor NCCL."""
    backend = _backend(group)
    if "gloo" in backend:
        return group, _CPU
    if "nccl" not in backend:
        return group, device
    twin = _COMPANIONS.get(group)
    if twin is None:
        ranks = dist.get_process_group_ranks(group)
        twin = _COMPANIONS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return twin, _CPU
