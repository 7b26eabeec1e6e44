"""Recording: one node per aten op, storages as groups, writes as states, RNG, provenance."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import checkpoint, policies
from tracedac.region import reporting

aten = torch.ops.aten


def record(fn, *args, policy=None):
    with reporting() as regions:
        out = checkpoint(fn, policy=policy)(*args)
    return regions[0].graph, out


def test_each_op_that_allocates_is_a_node_and_views_are_read_off_their_storage():
    """Views and reads need no replay: they are not recorded, their storage is."""

    def f(x):
        h = x.exp()  # new storage
        v = h.view(2, 8).t()  # two views: same storage, no node
        return (v * 2).sum()

    graph, _ = record(f, torch.randn(16, requires_grad=True))
    assert [n.op.overloadpacket for n in graph.nodes] == [aten.exp, aten.mul, aten.sum]
    exp, mul = graph.nodes[:2]
    assert exp.creates == (0,) and mul.args[0].group == exp.outputs[0].group
    assert mul.args[0].stride == (1, 8) and mul.args[0].size == (8, 2)
    assert graph.groups[0].creator is None and graph.groups[0].external is not None, "x: from outside"


def test_a_view_of_an_outside_tensor_registers_the_tensor_itself_not_the_view():
    """Views are not recorded, but the first view of an input registers its storage with the
    input as the group's outside tensor, as a recorded op would: an owner that can rebuild
    the input (tracedac.zero's gathers) recognizes the tensor, not a view of it."""
    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        return (x @ w.t()).sum()

    graph, _ = record(f, torch.randn(3, 4, requires_grad=True))
    externals = [g.external for g in graph.groups if g.creator is None]
    assert any(e is w for e in externals), "w's group was made from w, not from w.t()"
    mm = graph.nodes[0]
    assert mm.args[1].stride == (1, 4), "the view's geometry is still read off at its use"


def test_a_tensor_read_by_several_ops_is_one_meta_shared_by_their_nodes():
    """The graph keeps one TensorMeta per distinct tensor seen (its bookkeeping is memory the
    region holds until backward)."""
    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        a = x @ w.t()
        b = (x + 1) @ w.t()  # another op in between: the per-op cache has moved on
        return (a * b).sum()

    graph, _ = record(f, torch.randn(3, 4, requires_grad=True))
    first, second = [n for n in graph.nodes if n.op.overloadpacket is aten.mm]
    assert first.args[1] is second.args[1]


def test_writes_make_new_states_of_a_storage():
    def f(x):
        h = x + 1
        h[:2].mul_(3)  # write through a view
        h.add_(1)
        return h.sin().sum()

    graph, _ = record(f, torch.randn(4, requires_grad=True))
    h = graph.groups[graph.nodes[0].outputs[0].group]
    assert [m.op.overloadpacket for m in h.mutations] == [aten.mul_, aten.add_]
    sin = next(n for n in graph.nodes if n.op.overloadpacket is aten.sin)
    assert sin.args[0].state == 2, "sin read the storage after both writes"


def test_an_outside_tensor_written_in_the_region_is_copied_first_only_if_replay_needs_it():
    def f(x, buf):
        y = (x * buf).sin()  # reads buf before the write
        buf.add_(1)
        return y.sum()

    buf = torch.zeros(4)
    graph, _ = record(f, torch.randn(4, requires_grad=True), buf)
    g = next(g for g in graph.groups if g.mutations)
    assert g.snapshot is not None and torch.equal(torch.empty(0).set_(g.snapshot), torch.zeros(4))

    graph, _ = record(
        lambda x, buf: (buf.add_(1), x.sin().sum())[1], torch.randn(4, requires_grad=True), torch.zeros(4)
    )
    assert all(g.snapshot is None for g in graph.groups), (
        "nothing replays from it: dropped at the region's end"
    )


def test_random_ops_record_their_generator_state_and_others_do_not():
    def f(x):
        return F.dropout(x.sin(), 0.5).sum() + torch.randn(4).sum()

    graph, _ = record(f, torch.randn(4, requires_grad=True))
    rng = {n.op.overloadpacket: n.rng for n in graph.nodes}
    assert rng[aten.sin] is None and rng[aten.randn] is None, "randn feeds only a sum: state dropped"
    gen, state, _ = rng[aten.bernoulli_]  # CPU dropout draws its mask with bernoulli_
    assert gen is torch.default_generator and state.dtype == torch.uint8


def test_a_random_op_right_after_a_replayed_one_keeps_no_generator_state_of_its_own():
    """Replaying the first leaves the generator where the second began: one copy suffices."""

    def f(x):
        a = F.dropout(x, 0.5)
        b = F.dropout(x, 0.5)
        torch.rand(3)  # draws from the generator in between: the third needs its own copy
        c = F.dropout(x, 0.5)
        return (a * b * c).sum()

    graph, out = record(f, torch.randn(8, requires_grad=True))
    states = [n.rng[1] for n in graph.nodes if n.op.overloadpacket is aten.bernoulli_]
    assert states[0] is not None and states[1] is None and states[2] is not None
    x = torch.randn(8, requires_grad=True)
    from .util import assert_same_grads

    assert_same_grads(f, (x,))


def test_module_paths_come_from_the_names_wrap_saw():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 2))
    tracedac.wrap(model, lambda name, m: name == "0")
    with reporting() as regions:
        model(torch.randn(3, 4, requires_grad=True))
    paths = {n.op.overloadpacket: n.module_path for n in regions[0].graph.nodes}
    assert paths[aten.addmm] == "0.0" and paths[aten.gelu] == "0.1"
    assert regions[0].graph.name == "0"


def test_source_lines_are_recorded_for_reports_only():
    def f(x):
        return x.exp().sum()  # the line a report points at

    graph, _ = record(f, torch.randn(3, requires_grad=True))
    assert graph.nodes[0].source.endswith(f"test_trace.py:{f.__code__.co_firstlineno + 1}")
    sources = []

    def policy(node):  # sees the nodes of a region that is no report
        sources.append(node.source)
        return CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(3, requires_grad=True)
    checkpoint(f, policy=policy)(x).backward()
    assert sources == [None, None]  # exp and sum; no report: nothing walked the stack
    assert torch.equal(x.grad, x.exp())


def test_the_policy_is_asked_about_nodes_that_allocate_or_write_and_its_answer_is_tagged():
    asked = []

    def policy(node):
        asked.append(node.op.overloadpacket)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def f(x):
        h = x.exp().view(2, 2).t()
        h.mul_(2)
        return h.sum()

    graph, _ = record(f, torch.randn(4, requires_grad=True), policy=policy)
    assert asked == [aten.exp, aten.mul_, aten.sum], "views are never asked: they cost nothing to rebuild"
    assert all(
        n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE
        for n in graph.nodes
        if n.creates or n.writes
    )


def test_name_labels_the_op_that_produced_the_value_and_can_flip_its_decision():
    def f(x):
        h = tracedac.name(x.exp(), "h")
        return h.sum()

    graph, _ = record(f, torch.randn(3, requires_grad=True), policy=policies.save_names("h"))
    exp = graph.nodes[0]
    assert exp.labels == frozenset({"h"}) and exp.meta["recompute"] == CheckpointPolicy.MUST_SAVE


def test_module_paths_are_tracked_only_when_a_policy_or_report_reads_them():
    """Tracking costs two global hooks per module call; recompute_all never looks."""
    seen = []
    lin = nn.Linear(2, 2)

    def f(x):
        seen.append(len(torch.nn.modules.module._global_forward_pre_hooks))
        return lin(x).sum()

    x = torch.randn(3, 2, requires_grad=True)
    checkpoint(f)(x).backward()
    checkpoint(f, policy=lambda node: CheckpointPolicy.PREFER_RECOMPUTE)(x).backward()
    assert seen == [0, 1]
    assert not torch.nn.modules.module._global_forward_pre_hooks
