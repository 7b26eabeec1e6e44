"""Random programs under random policies give eager's gradients, and side effects run once."""

import zlib
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

import tracedac
from tracedac import CheckpointError, checkpoint, policies
from tracedac.offload import host as offload
from tracedac.record import warm
from tracedac.record.template import TEMPLATES
from tracedac.replay.run import fill_fresh_with_nan

aten = torch.ops.aten
SHAPE = (4, 6)


def _fresh(t):
    return t * 1.0  # a new tensor nothing has saved yet: safe to write in place in eager too


# Each entry: (name, arity, fn(pool tensors..., w, extras) -> new tensor)
TABLE = [
    ("sin", 1, lambda a, e: a.sin()),
    ("tanh", 1, lambda a, e: torch.tanh(a)),
    ("sigmoid", 1, lambda a, e: a.sigmoid()),
    ("gelu", 1, lambda a, e: F.gelu(a)),
    ("relu", 1, lambda a, e: F.relu(a)),
    ("square", 1, lambda a, e: a.square() * 0.5),
    ("exp", 1, lambda a, e: a.tanh().exp()),
    ("add", 2, lambda a, b, e: a + b),
    ("mul", 2, lambda a, b, e: a * b),
    ("sub", 2, lambda a, b, e: a - b),
    ("where", 2, lambda a, b, e: torch.where(a > b, a, b)),
    ("matmul", 1, lambda a, e: a @ e["w"]),
    ("bmm", 1, lambda a, e: torch.bmm(a.view(2, 2, 6), e["w"].expand(2, 6, 6)).view(SHAPE)),
    ("softmax", 1, lambda a, e: a.softmax(-1)),
    ("layer_norm", 1, lambda a, e: F.layer_norm(a, (6,))),
    ("row_sum", 1, lambda a, e: a * a.sum(-1, keepdim=True).tanh()),
    ("col_max", 1, lambda a, e: a - a.amax(0, keepdim=True)),
    ("transpose_view", 1, lambda a, e: a.t().reshape(6, 4).t().reshape(SHAPE).sin()),
    ("slice_cat", 1, lambda a, e: torch.cat([a[:, 3:].cos(), a[:, :3]], dim=1)),
    ("gather", 1, lambda a, e: a.gather(1, a.detach().argsort(1))),
    ("dropout", 1, lambda a, e: F.dropout(a, 0.3, training=True)),
    ("noise", 1, lambda a, e: a * torch.rand_like(a) + torch.randn(SHAPE) * 0.1),
    # ops that read only a layout (here a transposed one): their argument is not replayed
    (
        "like",
        1,
        lambda a, e: (
            a * (torch.full_like(a.t(), 0.5).t() + torch.empty_like(a).fill_(1.0) + a.new_zeros(SHAPE))
        ),
    ),
    ("mul_", 2, lambda a, b, e: _fresh(a).mul_(b)),
    ("add_view_", 2, lambda a, b, e: _inplace_view(a, b)),
    ("relu_", 1, lambda a, e: _fresh(a).relu_()),
    ("index_add_", 2, lambda a, b, e: _fresh(a).index_add_(1, torch.tensor([0, 2, 0]), b[:, :3])),
    ("slice_assign", 2, lambda a, b, e: _slice_assign(a, b)),
    ("counter", 1, lambda a, e: _count(a, e)),
    # ops that write what their schema hides (running statistics), draw random numbers into
    # an argument (rrelu's noise), return undefined optional tensors, or write a buffer
    (
        "batch_norm",
        1,
        lambda a, e: F.batch_norm(a, e["running_mean"], e["running_var"], training=True, momentum=0.3),
    ),
    ("rrelu", 1, lambda a, e: F.rrelu(a, training=True)),
    ("gru_cell", 2, lambda a, b, e: e["cell"](a, b.tanh())),
    (
        "embedding_max_norm",
        1,
        lambda a, e: a * F.embedding(torch.tensor([3, 0, 4, 0]), e["table"], max_norm=1.0),
    ),
    (
        "index_put_acc",
        2,
        lambda a, b, e: _fresh(a).index_put_((torch.tensor([0, 2, 0]),), b[:3], accumulate=True),
    ),
    ("pre_hook", 1, lambda a, e: e["hooked"](a)),
]


class _Hooked(torch.nn.Module):
    """A module whose forward pre-hook writes a buffer (as quantization observers do)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(6))
        self.register_forward_pre_hook(self.observe)

    @staticmethod
    def observe(module, args):
        module.seen.add_(args[0].detach().mean(0))  # returns None: the arguments stay as they are

    def forward(self, a):
        return a * self.seen.sigmoid()


def make_state(seed):
    """Everything outside the region that the table's ops read or write, made afresh per run."""
    torch.manual_seed(seed + 2)
    return {
        "buffer": torch.zeros(6),
        "calls": [],
        "running_mean": torch.zeros(6),
        "running_var": torch.ones(6),
        "cell": torch.nn.GRUCell(6, 6),
        "table": torch.randn(5, 6) * 2,
        "hooked": _Hooked(),
    }


def final_state(e) -> list:
    """The tensors the table's ops may write, as they ended."""
    return [e["buffer"], e["running_mean"], e["running_var"], e["table"], e["hooked"].seen]


def _inplace_view(a, b):
    y = _fresh(a)
    y[:, 1:4].add_(b[:, :3])  # written through a view...
    y.t()[0].mul_(2)  # ...and a view of a transpose
    return y


def _slice_assign(a, b):
    out = torch.zeros(SHAPE)
    out[:, :2] = a[:, :2].tanh().exp()
    out[1:, 2:] = b[1:, 2:] * a[1:, 2:]
    return out


def _count(a, e):
    e["calls"].append(1)  # Python side effect
    e["buffer"].add_(a.detach().sum(0))  # and a buffer update, inside the region
    return a * e["buffer"].tanh()


def run(program, x, w, state, labels):
    extras = {"w": w, **state}
    pool = [x, x.cos()]
    for step, (op, i, j) in enumerate(program):
        name, arity, fn = TABLE[op]
        args = [pool[i % len(pool)], pool[j % len(pool)]][:arity]
        out = fn(*args, extras)
        if step in labels:
            tracedac.name(out, f"t{step}")
        pool.append(out)
    state.get("pool", []).extend(pool[1:])  # (a test that writes them after the forward asks)
    return sum(t.sigmoid().sum() for t in pool[1:])


def random_policy(draw_policy, seed):
    if draw_policy == 0:
        return policies.recompute_all()
    if draw_policy == 1:
        return policies.save_all()
    if draw_policy == 2:
        return policies.save_matmuls()
    if draw_policy == 3:
        return policies.save_ops(aten.sin, aten.mul.Tensor, aten.relu_)
    if draw_policy == 4:
        return policies.either(policies.save_names("t1", "t3", "t4"), policies.save_matmuls())
    if draw_policy == 6:  # whole-graph planners; plans cached across examples are checked node by node
        return policies.memory_budget((seed % 11) / 10)
    if draw_policy == 7:
        return policies.min_cut(replay_matmuls=seed % 2 == 0)
    if draw_policy == 8:
        return policies.either(
            policies.save_names("t1", "t3"), policies.memory_budget(seed % 4096 + 1024)
        )  # room for t1 and t3

    def coin(node):  # a user callable: a coin per op and position, the same in every process
        flip = zlib.crc32(f"{seed} {node.index} {node.name}".encode()) % 3 == 0
        return CheckpointPolicy.PREFER_SAVE if flip else CheckpointPolicy.PREFER_RECOMPUTE

    return coin


programs = st.lists(
    st.tuples(st.integers(0, len(TABLE) - 1), st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=12
)


def inputs(seed):
    """The program's x and w for ``seed``."""
    torch.manual_seed(seed)
    return torch.randn(SHAPE, requires_grad=True), (torch.randn(6, 6) / 3).requires_grad_()


def attempt(fn, program, x, w, seed, labels):
    """``fn``'s loss and gradients on a fresh state, the buffers as they ended, the Python calls;
    the generator left where the forward left it (replay draws on saved states)."""
    state = make_state(seed)
    torch.manual_seed(seed + 1)
    loss = fn(program, x, w, state, labels)
    after_forward = torch.get_rng_state()
    grads = torch.autograd.grad(loss, (x, w), allow_unused=True, materialize_grads=True)
    assert torch.equal(torch.get_rng_state(), after_forward), "replay left the generator where it was"
    return loss, grads, final_state(state), state["calls"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=programs,
    which=st.integers(0, 8),
    seed=st.integers(0, 2**16),
    labels=st.sets(st.integers(0, 11)),
    change=st.tuples(st.integers(0, 11), st.integers(0, len(TABLE) - 1), st.integers(0, 50)),
)
def test_random_programs_under_random_policies_match_eager_and_run_python_once(
    program, which, seed, labels, change
):
    """Each program runs three times on other values of the same shapes (the first call records
    a template, the others run it warm: record/warm.py), then once with one op changed (a warm
    call that falls back to a full record at that op, wherever it is), each time against eager."""
    TEMPLATES.clear()
    region = checkpoint(run, policy=random_policy(which, seed))
    k = change[0] % len(program)
    changed = [*program[:k], (change[1], change[2], program[k][2]), *program[k + 1 :]]
    before = warm.stats()
    for prog, s in ((program, seed), (program, seed + 1), (program, seed + 2), (changed, seed + 3)):
        x, w = inputs(s)
        loss0, grads0, written0, calls0 = attempt(run, prog, x, w, s, labels)
        with fill_fresh_with_nan():  # a replay reading memory it never wrote shows as NaN
            loss1, grads1, written1, calls1 = attempt(region, prog, x, w, s, labels)
        bitwise = dict(rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(loss1, loss0, **bitwise)
        for a, b in zip(grads1, grads0):
            torch.testing.assert_close(a, b, **bitwise)
        assert calls1 == calls0, "Python ran once"
        for a, b in zip(written1, written0, strict=True):
            assert torch.equal(a, b), "every buffer ends as in eager"
    if which != 5:  # (5: a user's function, which may decide from anything: every call records)
        ran = warm.stats()
        # planners make their template on the second call, from the plan cached by the first
        assert ran["warm"] - before["warm"] >= (1 if which in (6, 7, 8) else 2), (ran, before)


def offload_policy(which, seed):
    """Policies that offload: per op, per label, what another policy keeps, the region's inputs,
    and the planners choosing among keep, offload and replay over a link from none to free."""
    link = policies.Link(bandwidth=(0.0, 1e6, 1e9, float("inf"))[seed % 4], flop_rate=1e9)
    if which == 0:
        return policies.offload_ops(aten.sin, aten.mm, aten.mul.Tensor, aten.relu_, aten.tanh)
    if which == 1:
        return policies.offload_kept(policies.save_all())
    if which == 2:
        return policies.offload_inputs(policies.offload_kept(policies.save_matmuls()))
    if which == 3:
        return policies.offload_inputs()
    if which == 4:
        return policies.memory_budget((seed % 11) / 10, offload=link)
    if which == 5:
        return policies.min_cut(replay_matmuls=seed % 2 == 0, offload=link)
    if which == 6:
        return policies.either(policies.offload_names("t1", "t3"), policies.save_names("t2", "t4"))
    return policies.offload_inputs(policies.memory_budget((seed % 5) / 4, offload=link))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    program=programs,
    which=st.integers(0, 7),
    seed=st.integers(0, 2**16),
    labels=st.sets(st.integers(0, 11)),
    served=st.booleans(),
    nested=st.booleans(),
    poke=st.integers(0, 8),
    twice=st.booleans(),
)
def test_random_programs_under_offload_policies_give_eagers_gradients_or_refuse_a_later_write(
    program, which, seed, labels, served, nested, poke, twice
):
    """Offload policies, copies served as on a GPU (a separate tensor comes back) or in place,
    regions nested or not. ``poke`` writes, after the forward, a tensor the program read or wrote
    (a buffer, an input) or one it computed (what eager refuses only if autograd saved that
    tensor): tracedac gives the gradient of the values the forward saw, or refuses naming the
    write; ``twice``: a second backward through the retained graph."""
    x, w = inputs(seed)

    def outer_of(inner):
        return lambda program, x, w, state, labels: inner(program, x.cos() * 1.0, w, state, labels)

    base, fn = run, checkpoint(run, policy=offload_policy(which, seed))
    if nested:
        outer = offload_policy((which + seed) % 8, seed // 3)
        base, fn = outer_of(run), checkpoint(outer_of(fn), policy=outer)

    def attempt_writing(fn, poke):  # attempt(), then the write after the forward
        state = {**make_state(seed), "pool": []}
        torch.manual_seed(seed + 1)
        loss = fn(program, x, w, state, labels)
        if poke:
            pool = state["pool"]
            written = [*final_state(state), x, w, pool[seed % len(pool)]][poke - 1]
            with torch.no_grad():
                written.mul_(1.5).add_(0.25)
        grads = []
        for retain in (True, False)[not twice :]:
            grads += torch.autograd.grad(
                loss, (x, w), allow_unused=True, materialize_grads=True, retain_graph=retain
            )
        return loss, grads, state["calls"]

    loss0, grads0, calls0 = attempt_writing(base, 0)  # the values the forward saw, never poked
    serving = mock.patch.object(offload, "_in_place", lambda device: False) if served else nullcontext()
    try:
        with serving, fill_fresh_with_nan():
            loss1, grads1, calls1 = attempt_writing(fn, poke)
    except CheckpointError as e:
        assert poke and "modified in place after the forward" in str(e), e
        return
    bitwise = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(loss1, loss0, **bitwise)
    for a, b in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(a, b, **bitwise)
    assert calls1 == calls0, "Python ran once"
