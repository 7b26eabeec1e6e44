"""Compiled regions on the benchmark's own model (``benchmarks.model.GPT`` at ``--quick`` size,
fixed-capacity routing as ``--compile`` runs it): what the partitioner keeps of its attention
and MoE blocks. These tests live here, beside the benchmarks they are about, because they read
the benchmark's model; the tests of the library's compile path are tests/test_compile.py.
"""

from __future__ import annotations

import pytest
import torch

import tracedac
from benchmarks.compiled import QUICK
from benchmarks.model import GPT, make_batch
from benchmarks.variants import _torch_checkpoint
from tracedac import policies
from tracedac.inspect.compiled import partition


def test_split_results_are_views_of_the_projection_a_full_budget_keeps():
    """``split`` returns views of its input: in a compiled region's graph they share the QKV
    projection's storage, so memory_budget(1.0) keeps the projection and backward does not
    replay it. (Taken for new storages, the split results were kept instead, which the
    partitioner cannot save as views: it replayed the projection.) The bench's attention block."""
    m = GPT.seeded(QUICK)
    for blk in m.blocks:
        tracedac.checkpoint(blk, policy=policies.memory_budget(1.0))
    (part,) = partition(m, *make_batch(QUICK))

    def feeds_split(n, depth=3):
        return depth > 0 and any(
            u.target is torch.ops.aten.split.Tensor or feeds_split(u, depth - 1) for u in n.users
        )

    qkv = {n.name for n in part.fw.graph.nodes if n.target is torch.ops.aten.addmm.default and feeds_split(n)}
    assert len(qkv) == QUICK.layers
    assert not qkv & {n.name for n in part.replayed}


@pytest.mark.slow
def test_recompute_all_saves_what_torchs_checkpoint_saves_when_blocks_make_the_same_buffers():
    """Each MoE block makes the same zero buffers (``full``) and scatters into them; the
    partitioner's common-subexpression pass merges them into the first block's node. Tagged
    with the first block's ``ac_graph_id``, it was saved as a value a later block reads:
    1.03 MiB more than torch's checkpoint at the bench's default size, 4.5 KiB here."""
    batch = make_batch(QUICK)
    ours = GPT.seeded(QUICK)
    for blk in ours.blocks:
        tracedac.checkpoint(blk, policy=policies.recompute_all())
    (torchs,) = partition(_torch_checkpoint(GPT.seeded(QUICK)), *batch)
    (got,) = partition(ours, *batch)
    fulls = [n for n in got.saved if n.target is torch.ops.aten.full.default]
    assert fulls == [] and got.saved_bytes <= torchs.saved_bytes
