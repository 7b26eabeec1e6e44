"""Issue 44: a resume gives back the saved state or an error, never other data.

- One value per key: ranks holding different data under one checkpoint key (expert
  parallel's experts under the same name on every rank) are refused at ``shard``, at
  ``save_checkpoint`` and at ``load_checkpoint``; DCP would keep one rank's and load it on all.
- Faults: a job killed during ``save_checkpoint`` (at every step of a save, on either rank)
  leaves the newest complete checkpoint loadable and exact; a job killed mid-step resumes from
  its last checkpoint to the losses of an uninterrupted run, bit for bit.
- A truncated, corrupted or foreign directory is an error naming what is wrong, and the model
  is left as it was.

The rank functions assert where they compute; the jobs are real processes (gloo, 2 ranks),
killed with SIGKILL at the chosen point.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tracedac
import tracedac.zero as zero

from ..support import zero_model as zm
from ..support.ranks import message_of, run_ranks, start_ranks

STEPS = 6


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _job(rank, world):
    """The model every job of this file trains: zero-sharded, each block a tracedac region."""
    model = zero.shard(zm.model(n=2))
    tracedac.wrap(model, zm.Block)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, step, rank, world, *, die_in_backward=False) -> float:
    x, y = zm.rank_batch(step, rank, world)
    loss = F.mse_loss(model(x), y)
    if die_in_backward:
        loss.register_hook(lambda g: _die())
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()


def _full(model) -> dict:
    return zero.full_state_dict(model)


def uninterrupted(rank, world, out):
    """The oracle: ``STEPS`` steps, every loss, and the full state after steps 2 and 4."""
    model, opt = _job(rank, world)
    losses = []
    for step in range(STEPS):
        losses.append(_step(model, opt, step, rank, world))
        if step + 1 in (2, 4):
            state = _full(model)  # a collective
            if rank == 0:
                torch.save(state, f"{out}/state{step + 1}.pt")
    return losses


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    out = tmp_path_factory.mktemp("oracle")
    losses = run_ranks(uninterrupted, 2, str(out), timeout=120)
    assert losses[0] == losses[1]
    return {"losses": losses[0], 2: torch.load(out / "state2.pt"), 4: torch.load(out / "state4.pt")}


# --- killed during a save ----------------------------------------------------------------------


def _arm(kill: str, rank: int) -> None:
    """Make this process die at ``kill``, a point of the second save (``"rank:where"``)."""
    who, where = kill.split(":")
    if int(who) != rank:
        return
    import torch.distributed.checkpoint.filesystem as fs

    if where == "after its data":
        write = fs.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()
            _die()

        fs.FileSystemWriter.write_data = write_then_die
    elif where == "before the metadata":
        fs.FileSystemWriter.finish = lambda self, metadata, results: _die()
    elif where == "before the rename":
        import tracedac.zero.checkpoint as ckpt

        ckpt._commit = lambda checkpoint_id: _die()
    elif where == "between the renames":
        replace = os.replace

        def replace_then_die(src, dst):
            replace(src, dst)
            if str(dst).endswith(".old"):
                _die()

        os.replace = replace_then_die
    else:
        raise ValueError(where)


def killed_in_a_save(rank, world, path, kill):
    """Steps 1-2, a clean save; steps 3-4, a save killed at ``kill``."""
    model, opt = _job(rank, world)
    for step in range(4):
        _step(model, opt, step, rank, world)
        if step == 1:
            zero.save_checkpoint(path, model, opt)
    _arm(kill, rank)
    zero.save_checkpoint(path, model, opt)
    return "finished"  # only a rank not killed, whose partner died first, could get here


def resumed(rank, world, path, expect_step, oracle_state, losses):
    """A new job: load what the killed one left, check it is the state after ``expect_step``
    exactly, take the next step (the uninterrupted run's loss, to the bit: the optimizer's
    state came back too), then save and load again over what the fault left."""
    model, opt = _job(rank, world)
    zero.load_checkpoint(path, model, opt)
    state = _full(model)
    assert state.keys() == oracle_state.keys()
    for key, value in oracle_state.items():
        assert torch.equal(state[key], value), key
    loss = _step(model, opt, expect_step, rank, world)
    assert loss == losses[expect_step], (loss, losses[expect_step])
    zero.save_checkpoint(path, model, opt)
    again, again_opt = _job(rank, world)
    zero.load_checkpoint(path, again, again_opt)
    assert all(torch.equal(a, b) for a, b in zip(_full(again).values(), _full(model).values()))
    left = sorted(p for p in os.listdir(os.path.dirname(path)) if p.startswith(os.path.basename(path)))
    assert left == [os.path.basename(path)], left  # no staging or stepped-aside directory left
    return loss


KILLS = {  # where the save is killed -> the newest complete checkpoint: after step 2 or 4
    "1:after its data": 2,
    "0:before the metadata": 2,
    "0:before the rename": 4,  # the manifest is written: the save is complete
    "0:between the renames": 4,
}


@pytest.mark.slow
@pytest.mark.parametrize("kill", list(KILLS))
def test_a_job_killed_during_a_save_leaves_the_newest_complete_checkpoint_exact(oracle, tmp_path, kill):
    """Before this, a save wrote in place: killed after one rank's data and before the
    metadata, it left the directory a mixture of two steps, which loaded without a word."""
    path = str(tmp_path / "ckpt")
    codes = start_ranks(killed_in_a_save, 2, path, kill, timeout=120).until_one_dies()
    assert codes[int(kill[0])] == -signal.SIGKILL, codes
    step = KILLS[kill]
    run_ranks(resumed, 2, path, step, oracle[step], oracle["losses"], timeout=120)


def killed_mid_step(rank, world, path):
    """Saves after every second step; rank 1 is killed in the backward of step 5."""
    model, opt = _job(rank, world)
    for step in range(STEPS):
        _step(model, opt, step, rank, world, die_in_backward=(step == 4 and rank == 1))
        if step % 2 == 1:
            zero.save_checkpoint(path, model, opt)


def restarted(rank, world, path, losses):
    model, opt = _job(rank, world)
    zero.load_checkpoint(path, model, opt)
    got = [_step(model, opt, step, rank, world) for step in range(4, STEPS)]
    assert got == losses[4:], (got, losses)


@pytest.mark.slow
def test_a_job_killed_mid_step_restarts_from_its_last_checkpoint_to_the_same_losses(oracle, tmp_path):
    path = str(tmp_path / "ckpt")
    codes = start_ranks(killed_mid_step, 2, path, timeout=120).until_one_dies()
    assert codes[1] == -signal.SIGKILL, codes
    run_ranks(restarted, 2, path, oracle["losses"], timeout=120)


# --- directories that are not what was saved ---------------------------------------------------


def _saved(path):
    model, opt = _job(0, 1)
    _step(model, opt, 0, 0, 1)
    zero.save_checkpoint(path, model, opt)
    return model, opt


def _untouched_by(load, path):
    """``load`` raises ZeroError and the fresh model keeps its values (nothing half loaded)."""
    model, opt = _job(0, 1)
    before = {k: v.clone() for k, v in _full(model).items()}
    with pytest.raises(zero.ZeroError) as info:
        load(path, model, opt)
    assert all(torch.equal(before[k], v) for k, v in _full(model).items())
    assert "Nothing was loaded" in str(info.value) or "does not exist" in str(info.value)
    return str(info.value)


def _data_file(path):
    return next(p for p in sorted(os.listdir(path)) if p.endswith(".distcp"))


def test_a_truncated_checkpoint_is_refused_naming_the_file(world1, tmp_path):
    path = tmp_path / "ckpt"
    _saved(path)
    name = _data_file(path)
    with open(path / name, "r+b") as f:
        f.truncate(os.path.getsize(path / name) // 2)
    message = _untouched_by(zero.load_checkpoint, path)
    assert name in message and "truncated" in message


def test_a_corrupted_byte_is_found_by_its_crc_and_verify_false_skips_only_that(world1, tmp_path):
    path = tmp_path / "ckpt"
    _saved(path)
    name = _data_file(path)
    with open(path / name, "r+b") as f:
        f.seek(os.path.getsize(path / name) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "CRC-32" in _untouched_by(zero.load_checkpoint, path)
    model, opt = _job(0, 1)
    zero.load_checkpoint(path, model, opt, verify=False)  # sizes still checked, not contents


def test_a_foreign_or_missing_directory_is_refused(world1, tmp_path):
    (tmp_path / "empty").mkdir()
    assert "no .metadata" in _untouched_by(zero.load_checkpoint, tmp_path / "empty")
    assert "does not exist" in _untouched_by(zero.load_checkpoint, tmp_path / "nowhere")
    path = tmp_path / "ckpt"
    _saved(path)
    (path / "tracedac.json").write_text("{not json")
    assert "manifest" in _untouched_by(zero.load_checkpoint, path)


def test_a_plain_dcp_checkpoint_is_checked_against_its_metadata(world1, tmp_path):
    """One tracedac did not write (no manifest: FSDP2's, torch's dcp.save): its files must
    cover what its metadata lists."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _saved(tmp_path / "ours")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "plain")
    fresh, fresh_opt = _job(0, 1)
    zero.load_checkpoint(tmp_path / "plain", fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(_full(fresh).values(), _full(model).values()))
    name = _data_file(tmp_path / "plain")
    os.truncate(tmp_path / "plain" / name, 10)
    assert "truncated" in _untouched_by(zero.load_checkpoint, tmp_path / "plain")


# --- one value per key --------------------------------------------------------------------------


class Stacked(nn.Module):
    """This rank's experts stacked under one name on every rank (benchmarks/ep.py's old layout)."""

    def __init__(self, rank):
        super().__init__()
        g = torch.Generator().manual_seed(rank)
        self.w1 = nn.Parameter(torch.randn(2, 4, 4, generator=g))


class ByIndex(nn.ModuleDict):
    """This rank's experts keyed by global index."""

    def __init__(self, rank):
        super().__init__({str(2 * rank + i): nn.Linear(4, 4) for i in range(2)})


class MoEModel(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.router = nn.Linear(4, 4)
        self.experts = experts


def _own_group(rank, world):
    return [dist.new_group([r]) for r in range(world)][rank]


def same_names_on_two_groups(rank, world):
    own = _own_group(rank, world)
    torch.manual_seed(0)
    model = MoEModel(Stacked(rank))
    zero.shard(model.experts, group=own)
    message = message_of(zero.ZeroError, zero.shard, model)
    assert "'experts.w1' on the groups of ranks [(0,), (1,)]" in message, message
    assert "global index" in message, message


def test_shard_refuses_experts_of_different_ranks_under_one_name():
    """Each rank's experts under the same name, sharded over the rank alone: a checkpoint would
    store one rank's and load it on both (the resume restored rank 0's experts on rank 1)."""
    run_ranks(same_names_on_two_groups, 2, timeout=60)


def experts_by_global_index(rank, world, path):
    own = _own_group(rank, world)
    torch.manual_seed(0)
    model = MoEModel(ByIndex(rank))
    zero.shard(model.experts, group=own)
    zero.shard(model)
    expect = {k: v.full_tensor().clone() for k, v in model.named_parameters()}
    zero.save_checkpoint(path, model)
    torch.manual_seed(1)
    fresh = MoEModel(ByIndex(rank))
    zero.shard(fresh.experts, group=own)
    zero.shard(fresh)
    zero.load_checkpoint(path, fresh)
    for k, v in fresh.named_parameters():
        assert torch.equal(v.full_tensor(), expect[k]), k
    held = sorted(k for k in expect if k.startswith("experts."))
    assert held == [f"experts.{2 * rank + i}.{p}" for i in range(2) for p in ("bias", "weight")], held


def test_experts_named_by_global_index_save_and_resume_each_rank_its_own(tmp_path):
    """Rank 0 holds experts 0 and 1, rank 1 experts 2 and 3; each resumes its own exactly."""
    run_ranks(experts_by_global_index, 2, str(tmp_path / "c"), timeout=60)


class Counted(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.full((2,), float(rank)))  # differs by rank


def a_buffer_that_differs_by_rank(rank, world, path):
    torch.manual_seed(0)
    model = zero.shard(Counted(rank))
    message = message_of(zero.ZeroError, zero.save_checkpoint, path, model)
    assert "'model.seen'" in message and "ranks 0: tensor" in message and "ranks 1: tensor" in message, (
        message
    )
    assert not os.path.exists(path) and not os.path.exists(path + ".saving")


def test_save_refuses_a_buffer_whose_value_differs_by_rank(tmp_path):
    """DCP would write rank 0's value and give it to rank 1 at load."""
    run_ranks(a_buffer_that_differs_by_rank, 2, str(tmp_path / "c"), timeout=60)


def dtensors_on_different_meshes(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from tracedac.zero.checkpoint import check_one_value_per_key

    own = DeviceMesh.from_group(_own_group(rank, world), "cpu")
    state = {"model": {"w": DTensor.from_local(torch.full((2,), float(rank)), own, [Shard(0)])}}
    for with_values, when in ((True, "save_checkpoint refused"), (False, "load_checkpoint refused")):
        with pytest.raises(zero.ZeroError, match=rf"(?s){when}.*'model\.w': ranks 0: DTensor on ranks \[0\]"):
            check_one_value_per_key(state, dist.group.WORLD, with_values=with_values, when=when)
    same = {"model": {"w": torch.ones(2)}}
    check_one_value_per_key(same, dist.group.WORLD, with_values=True, when="-")


def test_save_and_load_refuse_one_key_held_on_two_meshes():
    """What ``shard`` refuses, checked again where the state is written and read."""
    run_ranks(dtensors_on_different_meshes, 2, timeout=60)
