"""Issue 17: what FSDP2 users do, on a sharded model, on 1 (in process), 2 and 3 ranks.

One spawned group per world size runs every check (``fsdp_workers``); each test reads its
part. Losses are compared with the unsharded model trained on the combined batch.
"""

from __future__ import annotations

import pytest

from . import fsdp_workers as fw
from .spawn import part, run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

ALL = ("nesting", "outside", "torch_checkpoint", "no_sync", "meta_init", "dtype_change", "llama")
WORLDS = {1: ALL, 2: ALL, 3: ("nesting", "outside", "meta_init")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{world: [per-rank results]}: world 1 in this process, 2 and 3 spawned."""
    import torch.distributed as dist

    tmp = tmp_path_factory.mktemp("world1")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
    try:
        out = {1: [fw.parity(0, 1, WORLDS[1])]}
    finally:
        dist.destroy_process_group()
    for world in (2, 3):
        out[world] = run_ranks(fw.parity, world, WORLDS[world], timeout=300)
    return out


def _part(ranks, world, name):
    if name not in WORLDS[world]:
        pytest.skip(f"{name} runs on {sorted(k for k, v in WORLDS.items() if name in v)} ranks")
    return part(ranks[world], name, world)


def _close(a, b, tol=1e-5):
    assert len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_blocks_sharded_then_the_model_train_as_unsharded_and_every_parameter_moves(ranks, world):
    """Parameter groups chosen by name (decay on matrices), torch's clip_grad_norm_ on DTensors."""
    for r in _part(ranks, world, "nesting"):
        _close(r["losses"], r["ref"])
        assert r["diff"] < 1e-5 and r["unchanged"] == [] and r["trainable"] == 25, r
        assert "already sharded" in r["twice"], r["twice"]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parameters_outside_forward_are_dtensor_shards_and_full_parameters_is_writable(ranks, world):
    for r in _part(ranks, world, "outside"):
        assert r["is_dtensor"] and r["device"] == "cpu", r
        assert r["inside"] == ("Parameter", (32, 16)), r
        assert r["written"] and r["same_object"] and r["moved"], r
        assert "full_parameters" in r["forward_inside"], r


@pytest.mark.parametrize("world", [1, 2])
def test_torch_checkpoint_inside_and_around_units_gives_the_gradients_and_backward_gathers_again(
    ranks, world
):
    for r in _part(ranks, world, "torch_checkpoint"):
        for where in ("none", "inside", "around", "wrapper-before", "wrapper-after"):
            assert r[where]["grad_diff"] < 1e-5, (where, r)
        # around whole units (in forward, or checkpoint_wrapper before or after shard): the
        # blocks' activations are not held, gathers run again in backward
        for where in ("around", "wrapper-before", "wrapper-after"):
            assert r[where]["held"] < 0.5 * r["none"]["held"], (where, r)
            assert r[where]["backward"] >= r[where]["forward"] - 3, (where, r)  # all but the 3 frozen groups
        # inside a unit: re-running the Linear in backward gathers its unit again
        assert r["inside"]["backward"] > r["none"]["backward"], r


@pytest.mark.parametrize("world", [1, 2])
def test_gradient_accumulation_without_sync_reduces_only_the_last_micro_batch(ranks, world):
    for r in _part(ranks, world, "no_sync"):
        _close(r["losses"], r["ref"])
        assert r["diff"] < 1e-5, r
        assert r["reduce_scatters"] * 2 == r["reduce_scatters_always"], r


@pytest.mark.parametrize("world", [1, 2, 3])
def test_built_on_meta_then_loaded_or_broadcast_from_rank0_trains_as_unsharded(ranks, world):
    for r in _part(ranks, world, "meta_init"):
        for how in ("full", "broadcast"):
            assert r[how]["on_meta"] == "meta"
            _close(r[how]["losses"], r[how]["ref"])
        assert r["reset"]["finite"] and r["reset"]["weight_std"] > 0.01, r


@pytest.mark.parametrize("world", [1, 2])
def test_changing_the_dtype_after_sharding_raises_at_the_call_and_changes_nothing(ranks, world):
    for r in _part(ranks, world, "dtype_change"):
        assert all(e is not None and "MixedPrecision" in e for e in r["errors"]), r["errors"]
        assert r["unchanged"] == 0.0
        assert len(r["losses"]) == 1


@pytest.mark.parametrize("world", [1, 2])
def test_a_transformers_llama_built_on_meta_sharded_per_layer_trains_as_unsharded(ranks, world):
    for r in _part(ranks, world, "llama"):
        assert r["names"]
        _close(r["losses"], r["ref"])
