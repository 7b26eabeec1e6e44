"""Hugging Face transformers models under torch.compile with tracedac's regions: programs
nobody here wrote, compiled fullgraph, checked against the same model compiled without
checkpointing (losses, gradients) and against torch's checkpoint as transformers runs it
compiled (what the compiled forward saves, read off torch's own partition).

GPT-2, BERT and T5 are left out: transformers' own code breaks dynamo's graph in them with
or without checkpointing (a logger call in the loss, ``requires_grad`` set on a tensor in
T5), so fullgraph fails before any region is reached.
"""

import pytest
import torch

from tracedac import policies
from tracedac.inspect.compiled import partitioned
from tracedac.integrations import hf

from ..support.hf_models import batch, build, needs_switch
from ..test_compile import fresh_dynamo  # noqa: F401  (autouse: dynamo reset around each test)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.slow,  # not in the quick loop
    needs_switch,
]

# Compiled as aot_eager_decomp_partition compiles (inductor's decompositions and partition, no
# code generated), with the partition kept: ``compile.report.partitioned``.


def inputs():
    return {
        **batch(2, 16),
        "use_cache": False,
    }  # a KV cache asked for in training is transformers' warning: a graph break


_RUNS: dict = {}


def run(kind: str, policy=None, torch_checkpoint: bool = False):
    """One compiled training step of ``kind`` (under ``policy``, or torch's checkpoint as
    transformers runs it, or neither): (loss, gradients, bytes the compiled forward saves that
    it computed, the ``ac_graph_id``s it holds). Compiled once per case for both tests below:
    the partition read is the one the gradients came from."""
    key = (kind, repr(policy), torch_checkpoint)
    if key not in _RUNS:
        from torch._dynamo.utils import counters

        model = build(kind)
        if torch_checkpoint:
            model.activation_checkpointing_enable()
        elif policy is not None:
            model = hf.enable(model, policy)
        counters["graph_break"].clear()
        compiled, parts = partitioned(lambda **kw: model(**kw).loss)
        torch.manual_seed(2)  # dropout's numbers, as the support's lm_loss draws them
        # transformers 5.25's layers set a context variable in their forward, a side effect that
        # dynamo refuses inside torch's checkpoint HOP unless told not to replay it in backward
        # (its own hint); tracedac's regions need no such setting (no HOP, nothing re-run)
        skip = "skip_fwd_side_effects_in_bwd_under_checkpoint"
        patch = {skip: torch_checkpoint} if hasattr(torch._dynamo.config, skip) else {}
        with torch._dynamo.config.patch(**patch):
            out = compiled(**inputs())
        grads = torch.autograd.grad(out, [p for p in model.parameters() if p.requires_grad])
        assert sum(counters["graph_break"].values()) == 0
        (part,) = parts
        ids = {n.meta["ac_graph_id"] for n in part.fw.graph.nodes if "ac_graph_id" in n.meta}
        _RUNS[key] = out.detach(), grads, part.saved_bytes, ids
    return _RUNS[key]


# Every policy kind on the dense model; the planner's path (the most the pass does) on the MoEs.
CASES = [
    ("llama", policies.recompute_all()),
    ("llama", policies.save_matmuls()),
    ("llama", policies.memory_budget(0.5)),
    ("mixtral", policies.memory_budget(0.5)),
    ("qwen2_moe", policies.memory_budget(0.5)),
]


@pytest.mark.parametrize(("kind", "policy"), CASES, ids=[f"{k}-{p!r}" for k, p in CASES])
def test_each_architecture_compiles_fullgraph_with_the_gradients_of_no_checkpointing(kind, policy):
    ref_loss, ref, _, _ = run(kind)
    got_loss, got, _, _ = run(kind, policy)
    torch.testing.assert_close(got_loss, ref_loss)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])  # Mixtral's experts make an iota per layer (design.md)
def test_each_policy_saves_what_it_says_against_torchs_checkpoint_compiled(kind):
    """recompute_all saves no more than torch's checkpoint compiled (one ``ac_graph_id`` per
    layer, as torch's); save_matmuls more, and no more than no checkpointing;
    memory_budget(0.5) at most half of what the layers save compiled without checkpointing."""
    *_, none, none_ids = run(kind)
    *_, torch_bytes, torch_ids = run(kind, torch_checkpoint=True)
    got = {
        repr(p): run(kind, p)[2:]
        for p in (policies.recompute_all(), policies.save_matmuls(), policies.memory_budget(0.5))
    }
    assert none_ids == set() and len(torch_ids) == 2  # two decoder layers
    assert got["recompute_all()"][0] <= torch_bytes
    assert all(
        len(ids) == 2 for _, ids in got.values()
    )  # one per layer call (the numbers count on across compiles)
    assert got["recompute_all()"][0] < got["save_matmuls()"][0] <= none
    # The layers' own share: what no checkpointing saves beyond what recompute_all leaves
    # (the embedding, final norm and head, and each layer's input, saved by either).
    outside = got["recompute_all()"][0]
    assert got["memory_budget(0.5)"][0] - outside <= 0.5 * (none - outside)
