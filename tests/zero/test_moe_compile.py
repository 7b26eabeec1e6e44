"""The Llama 4 / DeepSeek case, fullgraph, on 2 ranks: an MoE with auxiliary-loss-free load
balancing (tests/support/moe_model.py), checkpointed by tracedac, sharded by zero.shard, each
block compiled with fullgraph=True (torchtitan's order), equals the unsharded, uncheckpointed
eager model step by step (losses to 1e-5, token counts and the expert bias exactly).
torchtitan turned fullgraph off for this model: FSDP2's hooks around MoE layers and
checkpointing's re-run of the bias update."""

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters

import tracedac
import tracedac.zero as zero

from ..support import moe_model as mm
from ..support.ranks import run_ranks

# slow: the quick loop (pytest -m "not slow") leaves this file out
pytestmark = pytest.mark.slow


def llama4_case(rank, world, backend="aot_eager_decomp_partition"):
    """The eager oracle and the sharded, checkpointed, compiled model, step by step: one graph
    per block and no graph break, tracedac's ops in the blocks' graphs, the same losses, counts
    and bias (each token counted once, on one rank), and a bias that moved."""
    torch.manual_seed(0)
    oracle = mm.Model()
    model = mm.Model()
    model.load_state_dict(oracle.state_dict())
    want = mm.train(oracle, oracle, 0, 1, lambda t: t)

    for b in model.blocks:
        tracedac.checkpoint(b)
    zero.shard(model)
    torch._dynamo.reset()
    counters.clear()
    ops: set = set()

    def keep_ops(gm, example_inputs):  # the graphs dynamo hands the backend: their tracedac ops
        ops.update(
            str(n.target).removesuffix(".default")
            for n in gm.graph.nodes
            if str(n.target).startswith("tracedac.")
        )
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    for b in model.blocks:
        b.compile(fullgraph=True, backend=keep_ops)

    def reduce(t):
        dist.all_reduce(t)
        return t

    got = mm.train(model, model, rank, world, reduce)
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    assert breaks == 0 and graphs == 2, (breaks, graphs)  # one graph per block
    assert {"tracedac.all_gather", "tracedac.release", "tracedac.region"} <= ops, ops
    for step, ((wl, wc, wb), (gl, gc, gb)) in enumerate(zip(want, got, strict=True)):
        assert abs(wl - gl) < 1e-5, (step, wl, gl)
        for a, b in zip(wc, gc, strict=True):
            assert torch.equal(a, b), (step, a, b)  # each token counted once, on one rank
        for a, b in zip(wb, gb, strict=True):
            assert torch.equal(a, b), (step, a, b)
    assert any(not torch.equal(b, torch.zeros_like(b)) for b in got[-1][2]), got[-1][2]  # the bias moved


def test_sharded_checkpointed_compiled_moe_with_a_load_balancing_bias_equals_eager():
    run_ranks(llama4_case, 2, timeout=300)
