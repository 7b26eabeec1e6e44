"""Each joint-graph pass of ``tracedac/compile/passes/`` on a small graph, its nodes counted before
and after (as torchtitan tests its graph passes): the graphs are built by hand
(``torch.fx.Graph``, each node's ``meta["val"]`` a tensor of the value's shape and dtype) or
traced with ``make_fx`` from a tiny joint function (a forward and ``torch.autograd.grad`` of it,
whose tangent placeholder marks the backward as AOTAutograd's does). Each pass's docstring says
which nodes it adds and removes; these tests hold it to that, node by node, without compiling
anything. (The passes inside torch.compile: tests/test_compile.py, tests/zero/test_compile.py.)
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

import tracedac.ops.zero  # noqa: F401 (registers the tracedac:: ZeRO ops the graphs name)
from tracedac import policies
from tracedac.compile.passes.gather_cast import fuse_gather_casts
from tracedac.compile.passes.gather_prefetch import prefetch_gathers
from tracedac.compile.passes.tag_regions import tag_regions
from tracedac.compile.passes.zero_tags import tag_gathers
from tracedac.compile.registry import key_for
from tracedac.compile.vocab import ANNOTATION, DECISION, LABELS, MARK

aten, prims = torch.ops.aten, torch.ops.prims
GATHER = torch.ops.tracedac.all_gather.default
START = torch.ops.tracedac.all_gather_start.default
WAIT = torch.ops.tracedac.all_gather_wait.default
RELEASE = torch.ops.tracedac.release.default


class Builder:
    """A ``torch.fx.Graph`` written node by node, each with the ``meta["val"]`` the passes read."""

    def __init__(self):
        self.graph = torch.fx.Graph()

    def input(self, name: str, *shape: int, dtype=torch.float32) -> torch.fx.Node:
        n = self.graph.placeholder(name)
        n.meta["val"] = torch.empty(shape, dtype=dtype)
        return n

    def op(self, target, *args, val=None, **kwargs) -> torch.fx.Node:
        n = self.graph.call_function(target, args, kwargs)
        if val is not None:
            n.meta["val"] = val
        return n

    def gather(self, shard: torch.fx.Node, key: str, world: int = 2) -> torch.fx.Node:
        """``all_gather(shard, key)``: ``world`` shards of fp32, gathered whole."""
        return self.op(GATHER, shard, key, val=torch.empty(world * shard.meta["val"].numel()))

    def module(self, *outputs) -> torch.fx.GraphModule:
        self.graph.output(outputs[0] if len(outputs) == 1 else outputs)
        self.graph.lint()
        return torch.fx.GraphModule(torch.nn.Module(), self.graph)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _count(gm, target) -> int:
    return len(gm.graph.find_nodes(op="call_function", target=target))


# --- gather_cast: autocast's downcast moved into the gather -----------------------------------


def _cast_graph(second_reader=None):
    """A unit of one 4x4 weight gathered from two ranks, viewed, cast to bf16 for a matmul (what
    autocast traces), and released. ``second_reader``: another use of the fp32 view."""
    b = Builder()
    shard, x = b.input("shard", 8), b.input("x", 2, 4)
    full = b.gather(shard, "unit")
    weight = b.op(aten.view.default, full, [4, 4], val=torch.empty(4, 4))  # [D, D]
    b.op(RELEASE, full, "unit")
    cast = b.op(prims.convert_element_type.default, weight, torch.bfloat16, val=torch.empty(4, 4).bfloat16())
    xb = b.op(prims.convert_element_type.default, x, torch.bfloat16, val=torch.empty(2, 4).bfloat16())
    y = b.op(aten.mm.default, xb, cast, val=torch.empty(2, 4).bfloat16())  # [B, D]
    outputs = [y]
    if second_reader is not None:
        outputs.append(b.op(second_reader, weight, val=torch.empty(4, 4)))
    return b.module(*outputs), full, weight


def test_gather_cast_removes_the_cast_of_a_gathered_weight_and_gathers_in_its_dtype():
    """One node fewer (the weight's cast); the gather asks for bf16, its view says bf16, and the
    matmul reads the view. The input's cast (not of a gathered value) stays."""
    gm, full, weight = _cast_graph()
    before = len(gm.graph.nodes)
    gm = fuse_gather_casts(gm)
    assert len(gm.graph.nodes) == before - 1
    assert _count(gm, prims.convert_element_type.default) == 1  # x's
    assert full.kwargs == {"dtype": torch.bfloat16} and full.meta["val"].dtype == torch.bfloat16
    assert weight.meta["val"].dtype == torch.bfloat16
    (mm,) = gm.graph.find_nodes(op="call_function", target=aten.mm.default)
    assert mm.args[1] is weight
    assert _count(gm, RELEASE) == 1  # the release still reads the gather


@pytest.mark.parametrize("reader", [aten.sin.default, aten.t.default], ids=["fp32 op", "fp32 view"])
def test_gather_cast_leaves_a_gather_also_read_in_fp32(reader):
    """A gathered weight read in fp32 too (a LayerNorm's, a parameter used both ways) travels
    fp32: nothing added, removed or retyped."""
    gm, full, weight = _cast_graph(second_reader=reader)
    before = _targets(gm)
    gm = fuse_gather_casts(gm)
    assert _targets(gm) == before
    assert full.kwargs == {} and full.meta["val"].dtype == torch.float32


def test_gather_cast_leaves_a_gather_cast_to_two_dtypes_and_a_graph_without_gathers():
    b = Builder()
    shard = b.input("shard", 8)
    full = b.gather(shard, "unit")
    bf16 = b.op(prims.convert_element_type.default, full, torch.bfloat16, val=torch.empty(16).bfloat16())
    fp16 = b.op(prims.convert_element_type.default, full, torch.float16, val=torch.empty(16).half())
    gm = b.module(bf16, fp16)
    before = _targets(gm)
    assert _targets(fuse_gather_casts(gm)) == before and full.kwargs == {}
    plain = make_fx(lambda x: x.sin().to(torch.bfloat16))(torch.randn(4))
    before = _targets(plain)
    assert fuse_gather_casts(plain) is plain and _targets(plain) == before


# --- gather_prefetch: the next unit's all-gather started while this one computes ---------------


def _two_units(world=2):
    """Two units, one gather each, the second's compute reading the first's."""
    b = Builder()
    s0, s1, x = b.input("s0", 8 // world), b.input("s1", 8 // world), b.input("x", 2, 4)
    g0 = b.gather(s0, "unit0", world)
    w0 = b.op(aten.view.default, g0, [2, 4], val=torch.empty(2, 4))
    h = b.op(aten.mm.default, x, b.op(aten.t.default, w0, val=torch.empty(4, 2)), val=torch.empty(2, 2))
    g1 = b.gather(s1, "unit1", world)
    g1.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE  # a region's tag: both halves copy it
    w1 = b.op(aten.view.default, g1, [2, 4], val=torch.empty(2, 4))
    y = b.op(aten.mm.default, h, w1, val=torch.empty(2, 4))
    return b.module(y)


def test_gather_prefetch_splits_each_gather_and_starts_the_next_unit_after_this_units_wait():
    """Two nodes for each gather (a start and a wait: one node more per gather); unit 1's start
    moves to just after unit 0's wait, before unit 0's compute; the views read the waits, and
    each half keeps the gather's tags."""
    gm = _two_units()
    before = len(gm.graph.nodes)
    gm = prefetch_gathers(gm)
    assert len(gm.graph.nodes) == before + 2
    assert _count(gm, GATHER) == 0 and _count(gm, START) == 2 and _count(gm, WAIT) == 2
    order = [(n.target, n.args[1]) for n in gm.graph.nodes if n.target in (START, WAIT)]
    assert order == [(START, "unit0"), (WAIT, "unit0"), (START, "unit1"), (WAIT, "unit1")]
    nodes = list(gm.graph.nodes)
    wait0, start1 = (
        next(n for n in nodes if n.target is t and n.args[1] == k)
        for t, k in ((WAIT, "unit0"), (START, "unit1"))
    )
    assert nodes.index(start1) == nodes.index(wait0) + 1  # in flight while unit 0 computes
    first_mm = next(n for n in nodes if n.target is aten.mm.default)
    assert nodes.index(start1) < nodes.index(first_mm)
    for wait in gm.graph.find_nodes(op="call_function", target=WAIT):
        (view,) = wait.users
        assert view.target is aten.view.default
    start_1 = next(n for n in nodes if n.target is START and n.args[1] == "unit1")
    assert start_1.meta["recompute"] is CheckpointPolicy.PREFER_RECOMPUTE


def test_gather_prefetch_leaves_one_unit_and_one_rank_as_they_are():
    """A block compiled on its own (one unit: the runtime prefetch links graphs), and a world
    of one rank (a gather is a cast on the compute stream: nothing to overlap)."""
    one_rank = _two_units(world=1)
    before = _targets(one_rank)
    assert _targets(prefetch_gathers(one_rank)) == before
    b = Builder()
    full = b.gather(b.input("s", 4), "unit")
    one_unit = b.module(b.op(aten.sin.default, full, val=torch.empty(8)))
    before = _targets(one_unit)
    assert _targets(prefetch_gathers(one_unit)) == before


# --- zero_tags: gathered parameters recomputed in backward ---------------------------------------


def test_zero_tags_marks_the_gather_and_what_is_computed_from_it_alone_and_adds_no_node():
    """MUST_RECOMPUTE on the gather, its view and the view's transpose (a full parameter each);
    not on the matmul that reads an activation too, not on a node a region tagged, not on the
    backward (the nodes that read the tangent)."""
    b = Builder()
    shard, x, tangent = b.input("shard", 8), b.input("x", 2, 4), b.input("tangents_1", 2, 4)
    full = b.gather(shard, "unit")
    weight = b.op(aten.view.default, full, [4, 4], val=torch.empty(4, 4))
    kept = b.op(aten.neg.default, weight, val=torch.empty(4, 4))
    kept.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # a region's decision: left alone
    wt = b.op(aten.t.default, weight, val=torch.empty(4, 4))
    y = b.op(aten.mm.default, x, wt, val=torch.empty(2, 4))
    grad = b.op(aten.mm.default, tangent, weight, val=torch.empty(2, 4))
    gm = b.module(y, kept, grad)
    before = len(gm.graph.nodes)
    gm = tag_gathers(gm)
    assert len(gm.graph.nodes) == before
    tags = {n.name: n.meta.get("recompute") for n in gm.graph.nodes if n.op == "call_function"}
    must = CheckpointPolicy.MUST_RECOMPUTE
    assert tags == {
        full.name: must,
        weight.name: must,
        wt.name: must,
        kept.name: CheckpointPolicy.MUST_SAVE,
        y.name: None,
        grad.name: None,
    }, tags


def test_zero_tags_tags_a_split_gathers_start_and_leaves_a_graph_without_gathers():
    gm = prefetch_gathers(_two_units())
    gm = tag_gathers(gm)
    for n in gm.graph.nodes:
        if n.target in (START, WAIT):
            assert n.meta["recompute"] in (
                CheckpointPolicy.MUST_RECOMPUTE,
                CheckpointPolicy.PREFER_RECOMPUTE,
            ), n
    starts = [n for n in gm.graph.nodes if n.target is START]
    assert starts[0].meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE  # untagged before
    assert starts[1].meta["recompute"] is CheckpointPolicy.PREFER_RECOMPUTE  # a region's: kept
    plain = make_fx(lambda x: x.sin())(torch.randn(4))
    assert tag_gathers(plain) is plain
    assert all("recompute" not in n.meta for n in plain.graph.nodes)


# --- tag_regions: each region's decisions as the partitioner's tags ------------------------------


def _joint(policy, calls=1, name="block"):
    """A joint graph as AOTAutograd hands the passes one: ``calls`` calls of a region (each
    entered by its ``tracedac::region`` mark, its forward nodes annotated with its key) whose
    forward is a matmul, a ``topk`` (an op of two results), a ``sin`` named "out" with
    ``tracedac.name``; then ``torch.autograd.grad`` of it (the backward reads the tangent)."""
    key = key_for(id(policy), name)

    def joint(x, w, tangent):
        h = x
        for _ in range(calls):
            MARK(key)
            with fx_traceback.annotate({ANNOTATION: key}):
                values, _ = torch.topk(torch.mm(h, w), 4)  # [4, 4]
                h = torch.ops.tracedac.label(values.sin(), "out")
        return (h, *torch.autograd.grad(h, (x, w), tangent))

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    with fx_traceback.preserve_node_meta():
        return make_fx(joint)(x, w, torch.randn(4, 4))


def _by_target(gm) -> dict:
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.setdefault(n.target, []).append(n)
    return out


def test_tag_regions_removes_the_marks_and_names_and_tags_every_forward_node():
    """Two region calls: two marks and two names fewer, nothing added; each name's label on the
    node that made the value; every annotated node tagged with its call's ``ac_graph_id`` (1,
    then 2) and its decision beside ``recompute``; the backward untouched."""
    gm = _joint(policies.save_matmuls(), calls=2)
    before = len(gm.graph.nodes)
    assert _count(gm, MARK) == 2 and _count(gm, torch.ops.tracedac.label.default) == 2
    gm = tag_regions(gm)
    assert len(gm.graph.nodes) == before - 4
    assert _count(gm, MARK) == 0 and _count(gm, torch.ops.tracedac.label.default) == 0
    nodes = _by_target(gm)
    sins = nodes[aten.sin.default]
    assert [n.meta.get(LABELS) for n in sins] == [frozenset({"out"})] * 2
    mms = nodes[aten.mm.default]
    forward = [n for n in gm.graph.nodes if "custom" in n.meta]
    assert {n.meta["ac_graph_id"] for n in forward[: len(forward) // 2]} == {1}
    assert {n.meta["ac_graph_id"] for n in forward[len(forward) // 2 :]} == {2}
    assert [n.meta["recompute"] for n in mms[:2]] == [CheckpointPolicy.MUST_SAVE] * 2  # save_matmuls
    for n in forward:
        if n.target is not operator.getitem:  # (a getitem takes its op's tag: the test below)
            assert n.meta[DECISION] is n.meta["recompute"], n
    backward = [n for n in gm.graph.nodes if n.op == "call_function" and "custom" not in n.meta]
    assert backward and all("recompute" not in n.meta for n in backward)


@pytest.mark.parametrize(
    "policy, decision",
    [
        (policies.save_ops(aten.topk), CheckpointPolicy.MUST_SAVE),
        (policies.recompute_all(), CheckpointPolicy.PREFER_RECOMPUTE),
    ],
    ids=["kept", "replayed"],
)
def test_tag_regions_tags_every_result_of_a_multi_output_op_as_the_op(policy, decision):
    """``topk`` returns two tensors, each a ``getitem`` of the op's node: the partitioner saves or
    replays the results, not the tuple, so each must carry the op's decision. (A getitem left
    PREFER_RECOMPUTE while its op is MUST_SAVE had no partition under inductor, which replays
    no topk.)"""
    gm = tag_regions(_joint(policy))
    (topk,) = _by_target(gm)[aten.topk.default]
    assert topk.meta["recompute"] is decision
    results = [u for u in topk.users if u.target is operator.getitem]
    assert sorted(u.args[1] for u in results) == [0, 1]  # values and indices
    for u in results:
        assert u.meta["recompute"] is decision, (u.args[1], u.meta["recompute"])
        assert u.meta["ac_graph_id"] == topk.meta["ac_graph_id"]


def test_tag_regions_leaves_a_graph_without_regions_as_it_is():
    plain = make_fx(lambda x: x.sin().cos())(torch.randn(4))
    before = _targets(plain)
    assert tag_regions(plain) is plain and _targets(plain) == before
    assert all("recompute" not in n.meta for n in plain.graph.nodes)
