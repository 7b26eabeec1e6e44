"""Issue 15: save on N ranks, resume on M, training goes on exactly; mismatches raise.

The cells run in one spawned group of 4 ranks (``resume`` below: subgroups of 1 to 4 ranks,
each checking the cells it loaded; tests/support/ranks.py); the mismatch checks in this process
on one rank. A model sharded over a subgroup is a model on that many ranks (its DTensors, its
collectives and DCP's coordination all use that group); ranks outside a subgroup wait at the
next barrier.
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import tracedac.zero as zero

from ..support.ranks import check, run_parts
from ..support.zero_model import model, param_groups, rank_batch

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

OPTIMIZERS = ("adamw", "sgd", "groups")
SAVE_WORLDS = (1, 2, 4)
LOAD_WORLDS = (1, 2, 3, 4)


def optimizer(kind, m):
    if kind == "adamw":
        return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(param_groups(m), lr=1e-2)  # two groups, two learning rates


def steps(m, opt, rank, world, group, first, n=2):
    """Steps ``first`` .. ``first + n - 1``; the losses of the combined batch."""
    losses = []
    for step in range(first, first + n):
        x, y = rank_batch(step, rank, world)
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
    """Every cell of {save world 1, 2, 4} x {load world 1, 2, 3, 4} x optimizers (check
    "<save> -> <load>": the losses of the uninterrupted run), the FSDP2 round trip (saved by
    FSDP2 on 2 ranks, loaded by zero on 3, and the reverse: check "interop"), and a full model +
    optimizer state dict loaded into a plain model on one process (check "plain <save>")."""
    groups = {n: dist.new_group(list(range(n))) for n in sorted(set(SAVE_WORLDS) | set(LOAD_WORLDS) | {2, 3})}
    uninterrupted, plain, resumed, interop = {}, {}, {}, {}
    for n in SAVE_WORLDS:
        for kind in OPTIMIZERS:
            if rank < n:
                m = zero.shard(model(), group=groups[n])
                opt = optimizer(kind, m)
                steps(m, opt, rank, n, groups[n], 0)
                zero.save_checkpoint(os.path.join(tmp, f"{n}-{kind}"), m, opt)
                # copied: on one rank the "full" tensors are the shards themselves, trained on below
                full_model, full_optim = copy.deepcopy(
                    get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
                )
                uninterrupted[(n, kind)] = steps(m, opt, rank, n, groups[n], 2)
                if rank == 0:  # zero's full state dict, optimizer included, into a plain model
                    p = model(seed=5)
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
                    m = zero.shard(model(seed=7), group=groups[mw])
                    opt = optimizer(kind, m)
                    zero.load_checkpoint(os.path.join(tmp, f"{n}-{kind}"), m, opt)
                    resumed[(n, mw, kind)] = steps(m, opt, rank, mw, groups[mw], 2)
            dist.barrier()
    # FSDP2 on 2 ranks -> zero on 3, and zero on 2 -> FSDP2 on 3 (AdamW, the standard calls)
    if rank < 2:
        m = fsdp2(model(tie=False), groups[2])
        opt = optimizer("adamw", m)
        steps(m, opt, rank, 2, groups[2], 0)
        _save_fsdp2(os.path.join(tmp, "fsdp2"), m, opt, groups[2])
        interop["fsdp2"] = steps(m, opt, rank, 2, groups[2], 2)
        m = zero.shard(model(tie=False), group=groups[2])
        opt = optimizer("adamw", m)
        steps(m, opt, rank, 2, groups[2], 0)
        zero.save_checkpoint(os.path.join(tmp, "zero"), m, opt)
        interop["zero"] = steps(m, opt, rank, 2, groups[2], 2)
    dist.barrier()
    if rank < 3:
        m = zero.shard(model(seed=7, tie=False), group=groups[3])
        opt = optimizer("adamw", m)
        zero.load_checkpoint(os.path.join(tmp, "fsdp2"), m, opt)
        interop["fsdp2->zero"] = steps(m, opt, rank, 3, groups[3], 2)
        m = fsdp2(model(seed=7, tie=False), groups[3])
        opt = optimizer("adamw", m)
        _load_fsdp2(os.path.join(tmp, "zero"), m, opt, groups[3])
        interop["zero->fsdp2"] = steps(m, opt, rank, 3, groups[3], 2)
    dist.barrier()
    for n in SAVE_WORLDS:
        with check(f"plain {n}"):
            for kind in OPTIMIZERS:
                if rank == 0:
                    _close(plain[(n, kind)], uninterrupted[(n, kind)], 1e-5)
    for n in SAVE_WORLDS:
        for mw in LOAD_WORLDS:
            with check(f"{n} -> {mw}"):
                for kind in OPTIMIZERS:
                    if rank < mw:
                        _close(resumed[(n, mw, kind)], uninterrupted[(n, kind)])
    dist.broadcast_object_list(box := [interop.get("fsdp2"), interop.get("zero")], src=0)
    with check("interop"):
        if rank < 3:
            _close(interop["fsdp2->zero"], box[0], 1e-5)
            _close(interop["zero->fsdp2"], box[1], 1e-5)


def _close(a, b, tol=1e-6):
    assert a is not None and b is not None and len(a) == len(b), (a, b)
    assert all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_parts(4, [(resume, str(tmp_path_factory.mktemp("resume")))], timeout=400)


@pytest.mark.parametrize("save, load", list(itertools.product(SAVE_WORLDS, LOAD_WORLDS)))
def test_saved_on_n_ranks_resumed_on_m_trains_on_exactly(four, save, load):
    """AdamW (step, exp_avg, exp_avg_sq), SGD with momentum, two groups with two learning rates."""
    four.passed(f"{save} -> {load}")


@pytest.mark.parametrize("save", SAVE_WORLDS)
def test_a_full_state_dict_with_the_optimizer_loads_into_a_plain_model(four, save):
    four.passed(f"plain {save}")


def test_fsdp2_checkpoints_load_into_zero_and_zero_checkpoints_into_fsdp2(four):
    four.passed("interop")


def _saved(path, **kw):
    m = zero.shard(model(**kw))
    opt = torch.optim.AdamW(m.parameters())
    zero.save_checkpoint(path, m, opt)
    return m


def test_a_checkpoint_missing_an_entry_raises_naming_it(world1, tmp_path):
    _saved(tmp_path / "c", n=2)
    m = zero.shard(model(n=3))
    with pytest.raises(zero.ZeroError, match=r"no entry 'model\.blocks\.2\.odd'"):
        zero.load_checkpoint(tmp_path / "c", m, torch.optim.AdamW(m.parameters()))
    m = zero.shard(model(n=1, tie=False))  # the reverse: entries the model does not have
    with pytest.raises(zero.ZeroError, match=r"entries the model does not.*blocks\.1\."):
        zero.load_checkpoint(tmp_path / "c", m)


def test_a_checkpoint_of_another_shape_raises_naming_the_key_with_dcp_too(world1, tmp_path):
    _saved(tmp_path / "c", d=20)
    m = zero.shard(model())
    with pytest.raises(zero.ZeroError, match=r"'model\.embed\.weight' is \(20, 20\)"):
        zero.load_checkpoint(tmp_path / "c", m)
    with pytest.raises(dcp.api.CheckpointException) as info:  # torch's own call refuses it as well
        dcp.load({"model": m.state_dict()}, checkpoint_id=tmp_path / "c")
    assert "model.embed.weight" in str(info.value.failures[0])


def test_a_checkpoint_of_another_dtype_raises_naming_the_key(world1, tmp_path):
    """dcp.load alone would cast the bf16 entry into the fp32 parameter silently."""
    from torch.distributed.tensor import distribute_tensor

    m = zero.shard(model())
    sd = {k: v.to(torch.bfloat16) if k == "head.weight" else v for k, v in m.state_dict().items()}
    sd["head.weight"] = distribute_tensor(
        m.head.weight.full_tensor().detach().bfloat16(), m.head.weight.device_mesh, m.head.weight.placements
    )
    dcp.save({"model": sd}, checkpoint_id=tmp_path / "c")
    with pytest.raises(zero.ZeroError, match=r"'model\.head\.weight' is \(1, 16\) torch\.bfloat16"):
        zero.load_checkpoint(tmp_path / "c", m)
