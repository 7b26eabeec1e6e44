"""What each rank runs for the resume tests (issue 15), in one spawned group of 4 ranks.

Saving on N ranks and loading on M ranks needs groups of N and M ranks: subgroups of the
4-rank world (``dist.new_group``), so one spawn does every cell. A model sharded over a
subgroup is a model on that many ranks (its DTensors, its collectives and DCP's
coordination all use that group); ranks outside a subgroup wait at the next barrier.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import tracedac.zero as zero

from . import fsdp_workers as fw
from . import workers as w

OPTIMIZERS = ("adamw", "sgd", "groups")
SAVE_WORLDS = (1, 2, 4)
LOAD_WORLDS = (1, 2, 3, 4)


def optimizer(kind, m):
    if kind == "adamw":
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(fw.param_groups(m), lr=1e-2)  # two groups, two learning rates


def steps(m, opt, rank, world, group, first, n=2):
    """Steps ``first`` .. ``first + n - 1``; the losses of the combined batch."""
    losses = []
    for step in range(first, first + n):
        x, y = w.rank_batch(step, rank, world)
        loss = F.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / world)
    return losses


def fsdp2(m, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def _save_fsdp2(path, m, opt, group):
    model_sd, optim_sd = get_state_dict(m, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)


def _load_fsdp2(path, m, opt, group):
    model_sd, optim_sd = get_state_dict(m, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def resume(rank, world, tmp):
    """Every cell of {save world 1, 2, 4} x {load world 1, 2, 3, 4} x optimizers, the FSDP2
    round trip (saved by FSDP2 on 2 ranks, loaded by zero on 3, and the reverse), and a full
    model + optimizer state dict loaded into a plain model on one process."""
    groups = {n: dist.new_group(list(range(n))) for n in sorted(set(SAVE_WORLDS) | set(LOAD_WORLDS) | {2, 3})}
    uninterrupted, plain, resumed, interop = {}, {}, {}, {}
    for n in SAVE_WORLDS:
        for kind in OPTIMIZERS:
            if rank < n:
                m = zero.shard(w.model(), group=groups[n])
                opt = optimizer(kind, m)
                steps(m, opt, rank, n, groups[n], 0)
                zero.save_checkpoint(os.path.join(tmp, f"{n}-{kind}"), m, opt)
                # copied: on one rank the "full" tensors are the shards themselves, trained on below
                full_model, full_optim = copy.deepcopy(
                    get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
                )
                uninterrupted[(n, kind)] = steps(m, opt, rank, n, groups[n], 2)
                if rank == 0:  # zero's full state dict, optimizer included, into a plain model
                    p = w.model(seed=5)
                    popt = optimizer(kind, p)
                    set_state_dict(p, popt, model_state_dict=full_model, optim_state_dict=full_optim)
                    plain[(n, kind)] = steps(p, popt, 0, 1, None, 2)
            dist.barrier()
    for n in SAVE_WORLDS:
        dist.broadcast_object_list(box := [uninterrupted.get((n, k)) for k in OPTIMIZERS], src=0)
        uninterrupted.update({(n, k): v for k, v in zip(OPTIMIZERS, box)})
    for mw in LOAD_WORLDS:
        for n in SAVE_WORLDS:
            for kind in OPTIMIZERS:
                if rank < mw:
                    m = zero.shard(w.model(seed=7), group=groups[mw])
                    opt = optimizer(kind, m)
                    zero.load_checkpoint(os.path.join(tmp, f"{n}-{kind}"), m, opt)
                    resumed[(n, mw, kind)] = steps(m, opt, rank, mw, groups[mw], 2)
            dist.barrier()
    # FSDP2 on 2 ranks -> zero on 3, and zero on 2 -> FSDP2 on 3 (AdamW, the standard calls)
    if rank < 2:
        m = fsdp2(w.model(tie=False), groups[2])
        opt = optimizer("adamw", m)
        steps(m, opt, rank, 2, groups[2], 0)
        _save_fsdp2(os.path.join(tmp, "fsdp2"), m, opt, groups[2])
        interop["fsdp2"] = steps(m, opt, rank, 2, groups[2], 2)
        m = zero.shard(w.model(tie=False), group=groups[2])
        opt = optimizer("adamw", m)
        steps(m, opt, rank, 2, groups[2], 0)
        zero.save_checkpoint(os.path.join(tmp, "zero"), m, opt)
        interop["zero"] = steps(m, opt, rank, 2, groups[2], 2)
    dist.barrier()
    if rank < 3:
        m = zero.shard(w.model(seed=7, tie=False), group=groups[3])
        opt = optimizer("adamw", m)
        zero.load_checkpoint(os.path.join(tmp, "fsdp2"), m, opt)
        interop["fsdp2->zero"] = steps(m, opt, rank, 3, groups[3], 2)
        m = fsdp2(w.model(seed=7, tie=False), groups[3])
        opt = optimizer("adamw", m)
        _load_fsdp2(os.path.join(tmp, "zero"), m, opt, groups[3])
        interop["zero->fsdp2"] = steps(m, opt, rank, 3, groups[3], 2)
    dist.barrier()
    return dict(uninterrupted=uninterrupted, plain=plain, resumed=resumed, interop=interop)
