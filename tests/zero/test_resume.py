"""Issue 15: save on N ranks, resume on M, training goes on exactly; mismatches raise.

The cells run in one spawned group of 4 ranks (``resume_workers``: subgroups of 1 to 4
ranks); the mismatch checks in this process on one rank.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tracedac.zero as zero

from . import resume_workers as rw
from . import workers as w
from .spawn import run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_ranks(rw.resume, 4, str(tmp_path_factory.mktemp("resume")), timeout=400)


def _close(a, b, tol=1e-6):
    assert a is not None and b is not None and len(a) == len(b), (a, b)
    assert all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("save, load", list(itertools.product(rw.SAVE_WORLDS, rw.LOAD_WORLDS)))
def test_saved_on_n_ranks_resumed_on_m_trains_on_exactly(four, save, load):
    """AdamW (step, exp_avg, exp_avg_sq), SGD with momentum, two groups with two learning rates."""
    base = four[0]["uninterrupted"]
    for rank in range(load):
        for kind in rw.OPTIMIZERS:
            _close(four[rank]["resumed"][(save, load, kind)], base[(save, kind)])


@pytest.mark.parametrize("save", rw.SAVE_WORLDS)
def test_a_full_state_dict_with_the_optimizer_loads_into_a_plain_model(four, save):
    for kind in rw.OPTIMIZERS:
        _close(four[0]["plain"][(save, kind)], four[0]["uninterrupted"][(save, kind)], 1e-5)


def test_fsdp2_checkpoints_load_into_zero_and_zero_checkpoints_into_fsdp2(four):
    for rank in range(3):
        r = four[rank]["interop"]
        _close(r["fsdp2->zero"], four[0]["interop"]["fsdp2"], 1e-5)
        _close(r["zero->fsdp2"], four[0]["interop"]["zero"], 1e-5)


def _saved(path, **kw):
    m = zero.shard(w.model(**kw))
    opt = torch.optim.AdamW(m.parameters())
    zero.save_checkpoint(path, m, opt)
    return m


def test_a_checkpoint_missing_an_entry_raises_naming_it(world1, tmp_path):
    _saved(tmp_path / "c", n=2)
    m = zero.shard(w.model(n=3))
    with pytest.raises(zero.ZeroError, match=r"no entry 'model\.blocks\.2\.odd'"):
        zero.load_checkpoint(tmp_path / "c", m, torch.optim.AdamW(m.parameters()))
    m = zero.shard(w.model(n=1, tie=False))  # the reverse: entries the model does not have
    with pytest.raises(zero.ZeroError, match=r"entries the model does not.*blocks\.1\."):
        zero.load_checkpoint(tmp_path / "c", m)


def test_a_checkpoint_of_another_shape_raises_naming_the_key_with_dcp_too(world1, tmp_path):
    _saved(tmp_path / "c", d=20)
    m = zero.shard(w.model())
    with pytest.raises(zero.ZeroError, match=r"'model\.embed\.weight' is \(20, 20\)"):
        zero.load_checkpoint(tmp_path / "c", m)
    with pytest.raises(dcp.api.CheckpointException) as info:  # torch's own call refuses it as well
        dcp.load({"model": m.state_dict()}, checkpoint_id=tmp_path / "c")
    assert "model.embed.weight" in str(info.value.failures[0])


def test_a_checkpoint_of_another_dtype_raises_naming_the_key(world1, tmp_path):
    """dcp.load alone would cast the bf16 entry into the fp32 parameter silently."""
    from torch.distributed.tensor import distribute_tensor

    m = zero.shard(w.model())
    sd = {k: v.to(torch.bfloat16) if k == "head.weight" else v for k, v in m.state_dict().items()}
    sd["head.weight"] = distribute_tensor(
        m.head.weight.full_tensor().detach().bfloat16(), m.head.weight.device_mesh, m.head.weight.placements
    )
    dcp.save({"model": sd}, checkpoint_id=tmp_path / "c")
    with pytest.raises(zero.ZeroError, match=r"'model\.head\.weight' is \(1, 16\) torch\.bfloat16"):
        zero.load_checkpoint(tmp_path / "c", m)
