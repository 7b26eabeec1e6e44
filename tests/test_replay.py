"""Replay: only ancestors run, kept tensors are reused, mutation and aliasing are exact."""

import pytest
import torch
import torch.nn.functional as F

from tracedac import CheckpointError, checkpoint, policies
from tracedac.region import reporting

from .util import OpCounter, assert_same_grads

aten = torch.ops.aten


def replayed(fn, *args, policy=None):
    """Forward ``fn`` in a region, run backward, and count the ops replayed."""
    with reporting() as regions:
        out = checkpoint(fn, policy=policy)(*args)
    inputs = [a for a in args if a.requires_grad]
    with OpCounter() as ops:
        torch.autograd.grad(out, inputs)
    return ops.counts, regions[0].graph


def test_backward_replays_only_the_ancestors_of_what_it_needs():
    def f(x):
        a = x.exp()  # saved by mul: replayed
        b = x.detach().cos().cos()  # no gradient flows through it: never replayed
        return (a * x).sum() + b.sum()

    x = torch.randn(16, requires_grad=True)
    counts, graph = replayed(f, x)
    assert counts[aten.exp] == 1
    assert counts[aten.cos] == 0
    assert graph.passes == 1 and graph.replayed_ops == 1


LAYOUT_ONLY = {
    "empty_like": lambda a: torch.empty_like(a).fill_(2.0),
    "zeros_like": torch.zeros_like,
    "ones_like": torch.ones_like,
    "full_like": lambda a: torch.full_like(a, 3.0),
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
    "randint_like": lambda a: torch.randint_like(a, 5),
    "new_empty": lambda a: a.new_empty(a.shape).fill_(2.0),
    "new_empty_strided": lambda a: a.new_empty_strided(a.shape, a.stride()).fill_(2.0),
    "new_zeros": lambda a: a.new_zeros(a.shape),
    "new_ones": lambda a: a.new_ones(a.shape),
    "new_full": lambda a: a.new_full(a.shape, 3.0),
}


@pytest.mark.parametrize("make", LAYOUT_ONLY.values(), ids=LAYOUT_ONLY.keys())
def test_an_op_that_reads_only_a_tensors_layout_does_not_replay_what_computed_it(make):
    def f(x):
        a = x.neg().t()  # autograd saves nothing of it; the op below reads its layout only
        m = make(a)  # saved by mul (x.t() requires grad, m does not): replayed
        return (x.t() * m).sum()

    x = torch.randn(6, 4, requires_grad=True)
    counts, graph = replayed(f, x)
    assert counts[aten.neg] == 0
    assert graph.passes == 1
    assert_same_grads(f, (x,))
    torch.manual_seed(0)
    checkpoint(f)(x).backward()
    after = torch.rand(3)  # replaying a random op left the generator where eager leaves it
    torch.manual_seed(0)
    f(x).backward()
    assert torch.equal(after, torch.rand(3))


def test_a_tensor_read_only_for_its_layout_may_change_between_forward_and_backward():
    def f(x, b):
        noise = torch.empty_like(b).bernoulli_(0.5)  # b's values are never read
        return (x * noise).sum()

    x, b = torch.randn(16, requires_grad=True), torch.randn(16)
    torch.manual_seed(0)
    expected = torch.autograd.grad(f(x, b), x)[0]
    torch.manual_seed(0)
    out = checkpoint(f)(x, b)
    b.add_(1.0)
    assert torch.equal(torch.autograd.grad(out, x)[0], expected)


def test_one_replay_pass_serves_every_handle_of_a_backward():
    def f(x, w):
        h = x @ w
        for _ in range(4):
            h = F.gelu(h) @ w
        return h.sum()

    x = torch.randn(8, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    counts, graph = replayed(f, x, w)
    assert graph.passes == 1
    assert counts[aten.gelu] == 4 and counts[aten.mm] == 4 + 2 * 5  # 4 replayed, 2 per matmul in backward


def test_kept_matmuls_are_not_replayed_and_ops_after_them_read_the_kept_value():
    def f(x, w1, w2):
        return (F.gelu(x @ w1) @ w2).tanh().sum()

    args = (
        torch.randn(8, 8, requires_grad=True),
        torch.randn(8, 16, requires_grad=True),
        torch.randn(16, 8, requires_grad=True),
    )
    counts, graph = replayed(f, *args, policy=policies.save_matmuls())
    assert counts[aten.mm] == 4, "backward's own matmuls only"
    assert counts[aten.gelu] == 1 and counts[aten.tanh] == 1  # tanh replays from the kept matmul
    assert_same_grads(f, args, policy=policies.save_matmuls())


def test_an_in_place_op_on_a_kept_result_reuses_it_instead_of_replaying_the_matmul():
    """relu_(x @ w): the kept storage already holds relu's output."""

    def f(x, w):
        h = x @ w
        h.relu_()
        return (h * h).sum()

    args = (torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    counts, _ = replayed(f, *args, policy=policies.save_matmuls())
    assert counts[aten.mm] == 2 and counts[aten.relu_] == 0
    assert_same_grads(f, args, policy=policies.save_matmuls())


@pytest.mark.parametrize(
    "write, op",
    [(lambda h: h.mul_(2), aten.mul_), (lambda h: h.add_(1), aten.add_)],
    ids=["mul_(2)", "add_(1)"],
)
def test_a_non_idempotent_in_place_op_on_a_kept_result_is_not_run_again(write, op):
    """The kept storage holds the write's result: run again on it, ``relu_`` changes nothing (only
    the op count above shows it), but ``mul_(2)`` doubles and ``add_(1)`` shifts the value the
    gradients are computed from."""

    def f(x, w):
        h = x @ w
        write(h)
        return (h * h).sum()

    args = (torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    counts, _ = replayed(f, *args, policy=policies.save_matmuls())
    assert counts[aten.mm] == 2 and counts[op] == 0
    assert_same_grads(f, args, policy=policies.save_matmuls())


@pytest.mark.parametrize("policy", [None, policies.save_matmuls(), policies.save_all()])
def test_writes_through_views_and_slice_assignment_replay_exactly(policy):
    def f(x, w):
        h = x @ w
        g = h + 1
        g[:, :4].mul_(2)  # a write through a view changes the base
        g.t()[1].add_(g[0, 0])  # and one through a view of a view, reading the base
        out = torch.zeros(8, 12)
        out[:, :8] = g.sigmoid()  # slice assignment: copy_ into a view
        out.index_add_(1, torch.tensor([9, 11, 9]), g[:, :3].exp())
        out[torch.arange(8), torch.arange(8)] = g.diagonal().cos()  # index_put_
        return (out[:, :8].tanh() * g.sin()).sum() + out.square().sum()

    args = (torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    assert_same_grads(f, args, policy=policy)


def test_a_value_read_before_an_in_place_write_is_replayed_in_its_old_state():
    def f(x):
        y = x.exp() + 1  # y in state 0...
        z = y.sin()  # ...saved as such by sin? no: sin saves its input, y at state 0
        y.mul_(3)  # state 1
        return (z * y.cos()).sum()  # cos saves y at state 1

    # eager refuses this (sin's saved input was modified); tracedac rebuilds both states
    x = torch.randn(6, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        f(x).backward()
    y0 = x.exp() + 1
    z = y0.sin()
    y1 = y0 * 3
    expected = torch.autograd.grad((z * y1.cos()).sum(), x)[0]
    got = torch.autograd.grad(checkpoint(f)(x), x)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_writes_to_an_input_inside_the_region_replay_from_a_copy_taken_before():
    def f(x, w):
        h = torch.tanh(x @ w)  # reads x at its first state
        x.mul_(0.5)  # an in-place update of the region's input
        return (h * x.sum()).sum()

    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, 4)
    x_eager = x.clone()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        f(x_eager.clone(), w).backward()  # eager refuses: mm saved x before the write
    h = torch.tanh(x_eager @ w)
    expected = torch.autograd.grad((h * (x_eager * 0.5).sum()).sum(), w)[0]
    got = torch.autograd.grad(checkpoint(f)(x, w), w)[0]
    assert torch.equal(got, expected) and torch.equal(x, x_eager * 0.5)


def test_out_variants_and_multi_output_ops_replay():
    def f(x):
        idx = torch.empty(6, dtype=torch.long)
        torch.argmax(x.detach().cos(), dim=1, out=idx)  # out= ops do not record gradients
        values, indices = x.exp().max(dim=1)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [6], None, None, 1e-5)
        picked = x.gather(1, idx[:, None]).squeeze(1)
        return (values.sin() * picked * indices + mean.squeeze() * rstd.squeeze()).sum()

    assert_same_grads(f, (torch.randn(6, 6, requires_grad=True),))


def test_data_dependent_shapes_replay_the_same_shapes():
    def f(x):
        idx = (x > 0).nonzero().squeeze(1)
        return x[idx].exp().sum() + x.masked_select(x < 0).sin().sum()

    assert_same_grads(f, (torch.randn(32, requires_grad=True),))


def test_ops_that_replace_a_tensors_storage_are_refused():
    def f(x):
        y = x.exp()
        y.set_(torch.zeros(8))
        return y.sum()

    with pytest.raises(CheckpointError, match="replaced or resized the storage"):
        checkpoint(f)(torch.randn(4, requires_grad=True))

    def g(x):
        y = x.exp()
        with torch.no_grad():
            z = y * 2
            z.resize_(1000)
        return (y * z[:4]).sum()

    with pytest.raises(CheckpointError, match="replaced or resized the storage"):
        checkpoint(g)(torch.randn(4, requires_grad=True))


def test_tensors_tracedac_cannot_replay_are_refused_at_record_time():
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(CheckpointError, match="layout torch.sparse_coo"):
        checkpoint(lambda x, s: torch.sparse.mm(s, x).sum())(torch.randn(3, 3, requires_grad=True), sparse)


def test_retained_graphs_replay_again_on_every_backward():
    def f(x):
        return F.dropout(x.exp(), 0.5, training=True).sum()

    x = torch.randn(16, requires_grad=True)
    with reporting() as regions:
        out = checkpoint(f)(x)
    g1 = torch.autograd.grad(out, x, retain_graph=True)[0]
    g2 = torch.autograd.grad(out, x, retain_graph=True)[0]
    assert torch.equal(g1, g2) and regions[0].graph.passes == 2


def test_a_kept_result_the_program_modifies_after_forward_is_never_used_stale():
    """The kept storage changed under the graph: rebuild it, or refuse; never replay from it."""

    def f(x, w):
        h = x @ w  # kept by save_matmuls, and returned
        return h, torch.tanh(F.gelu(h)).sum()  # tanh's output is replayed from h

    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    h, loss = checkpoint(f, policy=policies.save_matmuls())(x, w)
    with torch.no_grad():
        h.mul_(3)
    with pytest.raises(
        CheckpointError, match="aten.mm.default.*kept for backward, was modified in place after the forward"
    ):
        loss.backward()
