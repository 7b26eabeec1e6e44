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
from tracedac.compile.report import partition
from tracedac.integrations import hf

from ..support.hf_models import batch, build, loss
from ..test_compile import fresh_dynamo  # noqa: F401  (autouse: dynamo reset around each test)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.slow,
]  # slow: not in the quick loop

BACKEND = "aot_eager_decomp_partition"


def inputs():
    return {
        **batch(2, 16),
        "use_cache": False,
    }  # a KV cache asked for in training is transformers' warning: a graph break


def compiled_grads(model):
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()
    c = torch.compile(model, backend=BACKEND, fullgraph=True)
    out = loss(c, inputs())
    grads = torch.autograd.grad(out, [p for p in model.parameters() if p.requires_grad])
    assert sum(counters["graph_break"].values()) == 0
    return out.detach(), grads


def saved(model) -> tuple[int, set]:
    """Bytes the compiled forward saves that it computed, and the ``ac_graph_id``s it holds."""
    (part,) = partition(lambda **kw: model(**kw).loss, **inputs())
    ids = {n.meta["ac_graph_id"] for n in part.fw.graph.nodes if "ac_graph_id" in n.meta}
    return part.saved_bytes, ids


_REFERENCE: dict = {}


def reference(kind):
    """Loss and gradients of the model compiled without checkpointing (once per architecture)."""
    if kind not in _REFERENCE:
        _REFERENCE[kind] = compiled_grads(build(kind))
    return _REFERENCE[kind]


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
    ref_loss, ref = reference(kind)
    model = hf.enable(build(kind), policy)
    got_loss, got = compiled_grads(model)
    torch.testing.assert_close(got_loss, ref_loss)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])  # Mixtral's experts make an iota per layer (design.md)
def test_each_policy_saves_what_it_says_against_torchs_checkpoint_compiled(kind):
    """recompute_all saves no more than torch's checkpoint compiled (one ``ac_graph_id`` per
    layer, as torch's); save_matmuls more, and no more than no checkpointing;
    memory_budget(0.5) at most half of what the layers save compiled without checkpointing."""
    none, none_ids = saved(build(kind))
    reference = build(kind)
    reference.activation_checkpointing_enable()
    torch_bytes, torch_ids = saved(reference)
    got = {
        repr(p): saved(hf.enable(build(kind), p))
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
