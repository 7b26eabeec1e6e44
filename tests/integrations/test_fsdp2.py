"""tracedac regions inside FSDP2 (``torch.distributed.fsdp.fully_shard``), on real gloo groups:
2 ranks, and 4 for a (dp, tp) mesh. What FSDP2's users do: each block checkpointed and
``fully_shard``-ed, then the model; eager and compiled (``aot_eager_decomp_partition``, per
block or the whole model), ``reshard_after_forward`` on and off, FSDP2's bf16
``MixedPrecisionPolicy``, tensor parallel on a 2-D mesh.

The ranks assert (``fsdp2_workers``): gradients bit for bit those of no checkpointing under
the same set-up, each block's side effects once a step, the allocator's bytes held after the
forward no more than torch's checkpoint (recompute_all), torch's selective checkpointing of
the matmuls (save_matmuls) or half of what no checkpointing adds (memory_budget(0.5)), and no
region holding a block's unsharded parameters. A test here reads its part of one spawn.
"""

from __future__ import annotations

import pytest

from ..zero.spawn import part, run_ranks
from . import fsdp2_workers as fw
from .fsdp2_workers import Setup

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out

EAGER = [
    Setup(order=order, reshard=reshard, mp=mp)
    for order in ("before", "after")
    for reshard in (True, False)
    for mp in (False, True)
]
EAGER_MEMORY = [Setup(), Setup(order="after"), Setup(reshard=False), Setup(mp=True)]
# Each compile costs seconds on 2 cores: every policy compiled per block, the others with one.
COMPILED = {
    Setup(compiled="block"): tuple(fw.POLICIES),
    Setup(compiled="model"): ("recompute_all",),
    Setup(compiled="block", mp=True): ("recompute_all",),
    Setup(compiled="block", reshard=False, order="after"): ("save_matmuls",),
}
COMPILED_MEMORY = {Setup(compiled="block"): tuple(fw.POLICIES), Setup(compiled="model"): ("recompute_all",)}
TP = {Setup(tp=True): tuple(fw.POLICIES), Setup(tp=True, compiled="block"): ("recompute_all",)}


def _label(worker: str, setup: Setup) -> str:
    return f"{worker}: {setup}"


@pytest.fixture(scope="module")
def eager():
    parts = [(_label("gradients", s), "gradients", (s,)) for s in EAGER]
    parts += [(_label("memory", s), "memory", (s,)) for s in EAGER_MEMORY]
    return run_ranks(fw.several, 2, parts, timeout=600)


@pytest.fixture(scope="module")
def compiled():
    parts = [(_label("gradients", s), "gradients", (s, names)) for s, names in COMPILED.items()]
    parts += [(_label("memory", s), "memory", (s, names)) for s, names in COMPILED_MEMORY.items()]
    return run_ranks(fw.several, 2, parts, timeout=600)


@pytest.fixture(scope="module")
def tensor_parallel():
    parts = [(_label(w, s), w, (s, names)) for s, names in TP.items() for w in ("gradients", "memory")]
    return run_ranks(fw.several, 4, parts, timeout=600)


@pytest.mark.parametrize("setup", EAGER, ids=str)
def test_regions_in_fully_shard_blocks_give_the_gradients_of_no_checkpointing_and_run_side_effects_once(
    eager, setup
):
    """Checkpoint before or after fully_shard, resharded after forward or not, fp32 or bf16
    parameters: FSDP2 gathers before the region and frees after it, so the region computes
    what the block computes; torch's checkpoint runs the block's Python twice a step."""
    for rank in part(eager, _label("gradients", setup)):
        for name in fw.POLICIES:
            assert rank[name] == ([2.0, 2.0], [2, 2]), rank
        assert rank["torch"] == ([4.0, 4.0], [4, 4]), rank


@pytest.mark.parametrize("setup", EAGER_MEMORY, ids=str)
def test_regions_hold_no_more_than_torchs_checkpoint_and_never_a_blocks_unsharded_parameters(eager, setup):
    """The region's inputs are FSDP2's gathered parameters, which FSDP2 frees after the block
    (their storage, whoever refers to them): a region keeps its activations only. Checkpointed
    after fully_shard, a region whose hooks wrapped FSDP2's recorded the all-gather and held
    the gathered buffer of every block through the first step (34 MB against 0.4 here)."""
    for rank in part(eager, _label("memory", setup)):
        held = {k: later for k, (first, later) in rank["held"].items()}
        assert held["recompute_all"] <= held["torch"] + fw.SLACK, rank
        assert held["save_matmuls"] <= held["torch_sac"] + fw.SLACK, rank


@pytest.mark.parametrize("setup", list(COMPILED), ids=str)
def test_compiled_regions_in_fully_shard_blocks_give_the_gradients_of_the_same_compiled_model(
    compiled, setup
):
    """torch.compile per block or of the whole model: dynamo runs FSDP2's hooks outside the
    graphs, the regions are traced into them (no region recorded eagerly, no graph break);
    the buffer update runs once a step (torch's checkpoint, compiled, applies it twice)."""
    for rank in part(compiled, _label("gradients", setup)):
        for name in COMPILED[setup]:
            assert rank[name] == ([2.0, 2.0], None), rank
        assert rank["torch"][0] == [4.0, 4.0], rank


@pytest.mark.parametrize("setup", list(COMPILED_MEMORY), ids=str)
def test_compiled_regions_hold_no_more_than_torchs_checkpoint_compiled(compiled, setup):
    for rank in part(compiled, _label("memory", setup)):
        held = {k: later for k, (first, later) in rank["held"].items()}
        assert held["recompute_all"] <= held["torch"] + fw.SLACK, rank


@pytest.mark.parametrize("setup", list(TP), ids=str)
def test_regions_in_blocks_tensor_parallel_then_fully_sharded_on_a_2d_mesh_match_no_checkpointing(
    tensor_parallel, setup
):
    """parallelize_module over tp, then fully_shard over dp, 4 ranks: the region sees DTensor
    parameters of the tp mesh and records the local ops and the tp all-reduce once."""
    for rank in part(tensor_parallel, _label("gradients", setup)):
        for name in TP[setup]:
            assert rank[name][0] == [2.0, 2.0], rank
    for rank in part(tensor_parallel, _label("memory", setup)):
        held = {k: later for k, (first, later) in rank["held"].items()}
        assert held["recompute_all"] <= held["torch"] + fw.SLACK, rank
