"""The Llama 4 / DeepSeek case, fullgraph, on 2 ranks: an MoE with auxiliary-loss-free load
balancing, checkpointed by tracedac, sharded by zero.shard, each block compiled with
fullgraph=True, equals the unsharded, uncheckpointed eager model step by step (losses to
1e-5, token counts and the expert bias exactly). torchtitan turned fullgraph off for this
model: FSDP2's hooks around MoE layers and checkpointing's re-run of the bias update."""

import pytest
import torch

from . import moe_workers as mw
from .spawn import run_ranks

# slow: the quick loop (pytest -m "not slow") leaves this file out
pytestmark = pytest.mark.slow


def test_sharded_checkpointed_compiled_moe_with_a_load_balancing_bias_equals_eager():
    results = run_ranks(mw.llama4_case, 2, timeout=300)
    for want, got, breaks, graphs, ops in results:
        assert breaks == 0 and graphs == 2  # one graph per block
        assert {"tracedac.all_gather", "tracedac.release", "tracedac.region"} <= ops, ops
        for step, ((wl, wc, wb), (gl, gc, gb)) in enumerate(zip(want, got, strict=True)):
            assert abs(wl - gl) < 1e-5, (step, wl, gl)
            for a, b in zip(wc, gc, strict=True):
                assert torch.equal(a, b), (step, a, b)  # each token counted once, on one rank
            for a, b in zip(wb, gb, strict=True):
                assert torch.equal(a, b), (step, a, b)
        assert any(not torch.equal(b, torch.zeros_like(b)) for b in got[-1][2])  # the bias moved
