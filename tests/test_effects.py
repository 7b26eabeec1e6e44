"""Modules whose ops write what their schema hides, draw random numbers into an argument, or
return undefined tensors: gradients and every buffer end as in eager, under every policy.

The oracle is the same module run eagerly (a deep copy, same seed): BatchNorm's running
statistics and ``num_batches_tracked``, InstanceNorm's tracked statistics, rrelu's noise,
random fills of an ``empty_like``, and nn.LSTM/GRU/RNN (mkldnn_rnn_layer's workspace exists
only in grad mode).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tracedac
from tracedac import policies
from tracedac.region import reporting
from tracedac.replay.run import fill_fresh_with_nan

POLICIES = [
    policies.recompute_all(),
    policies.save_all(),
    policies.save_matmuls(),
    policies.memory_budget(0.3),
    policies.min_cut(),
]
IDS = [repr(p) for p in POLICIES]


def _first(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def assert_module_matches_eager(make, shape, policy, steps=2, dtype=torch.float64):
    """Two training steps of ``make()`` checkpointed with ``policy`` and run eagerly give the
    same outputs, gradients (input and parameters) and final buffers, bitwise."""
    torch.manual_seed(0)
    eager = make().to(dtype)
    ours = tracedac.checkpoint(copy.deepcopy(eager), policy=policy)
    for step in range(steps):
        x = torch.randn(shape, dtype=dtype)
        results = []
        for module in (eager, ours):
            xi = x.clone().requires_grad_()
            torch.manual_seed(100 + step)
            y = _first(module(xi))
            (y * torch.arange(y.numel(), dtype=dtype).view_as(y)).sum().backward()
            results.append(
                (y.detach(), xi.grad, [p.grad.clone() for p in module.parameters()], torch.get_rng_state())
            )
            module.zero_grad()
        (y0, gx0, gp0, rng0), (y1, gx1, gp1, rng1) = results
        assert torch.equal(y0, y1)
        assert torch.equal(gx0, gx1)
        for a, b in zip(gp0, gp1, strict=True):
            assert torch.equal(a, b)
        for (name, a), (_, b) in zip(eager.named_buffers(), ours.named_buffers(), strict=True):
            assert torch.equal(a, b), f"buffer {name} after step {step}: {a} vs {b}"
        assert torch.equal(rng0, rng1)  # after backward the generator is where eager leaves it


NORMS = {
    "bn1d": (lambda: nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)), (8, 5)),
    "bn1d_seq": (lambda: nn.Sequential(nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4)), (2, 3, 7)),
    "bn2d": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1)),
        (2, 3, 6, 6),
    ),
    "bn2d_cma": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.Tanh()),
        (2, 3, 5, 5),
    ),
    "bn2d_no_affine": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, affine=False)),
        (2, 3, 4, 4),
    ),
    "bn3d": (lambda: nn.Sequential(nn.Conv3d(2, 3, 2), nn.BatchNorm3d(3), nn.ReLU()), (2, 2, 4, 4, 4)),
    "bn_twice": (lambda: _Twice(nn.BatchNorm1d(4)), (6, 4)),
    "bn2d_channels_last": (
        lambda: nn.Sequential(_ChannelsLast(), nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)),
        (2, 3, 5, 5),
    ),
    "bn_eval": (lambda: nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6).eval(), nn.ReLU()), (8, 5)),
    "instance_tracked": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True, affine=True)
        ),
        (2, 3, 6, 6),
    ),
    "instance1d_tracked": (
        lambda: nn.Sequential(nn.InstanceNorm1d(3, track_running_stats=True), nn.Tanh()),
        (2, 3, 9),
    ),
}


class _ChannelsLast(nn.Module):
    def forward(self, x):
        return x.contiguous(memory_format=torch.channels_last)


class _Twice(nn.Module):
    """One BatchNorm applied twice in a region: its statistics are written twice, read between."""

    def __init__(self, bn):
        super().__init__()
        self.bn = bn

    def forward(self, x):
        return self.bn(torch.sin(self.bn(x)))


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
@pytest.mark.parametrize("name", sorted(NORMS))
def test_norm_running_statistics_end_as_in_eager(name, policy):
    make, shape = NORMS[name]
    assert_module_matches_eager(make, shape, policy)


def test_batch_norm_statistics_are_recorded_as_written():
    """The recorder marks native_batch_norm as writing the running statistics (its schema does
    not say so) and nothing replays it onto the live buffers."""
    bn = nn.BatchNorm1d(3)
    before = bn.running_mean.clone()
    with reporting() as regions:
        y = tracedac.checkpoint(bn)(torch.randn(5, 3, requires_grad=True))
    after_forward = bn.running_mean.clone()
    y.sum().backward()
    assert not torch.equal(before, after_forward)
    assert torch.equal(bn.running_mean, after_forward)  # backward's replay did not write it
    graph = regions[0].graph
    writers = [n.name for g in graph.groups if g is not None and g.creator is None for n in g.mutations]
    assert "aten.native_batch_norm.default" in writers


RANDOM = {
    "rrelu": lambda x: F.rrelu(x * 2, training=True),
    "rrelu_": lambda x: F.rrelu_(x * 2, training=True) * 1,
    "dropout": lambda x: F.dropout(x * 2, 0.4),
    "bernoulli_": lambda x: x * torch.empty_like(x).bernoulli_(0.3),
    "normal_": lambda x: x * torch.empty_like(x).normal_(),
    "uniform_": lambda x: x * torch.empty_like(x).uniform_(),
    "exponential_": lambda x: x * torch.empty_like(x).exponential_(),
    "geometric_": lambda x: x * torch.empty_like(x).geometric_(0.3),
    "cauchy_": lambda x: x * torch.empty_like(x).cauchy_(),
    "log_normal_": lambda x: x * torch.empty_like(x).log_normal_(),
    "random_": lambda x: x * torch.empty_like(x).random_(0, 7),
    "into_slice": lambda x: _fill_half(x),
}


def _fill_half(x):
    noise = torch.empty_like(x)
    noise[:, :2].normal_()
    noise[:, 2:].uniform_()
    return (x.sin() * noise).exp()


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x)).tanh()


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
@pytest.mark.parametrize("name", sorted(RANDOM))
def test_random_fills_of_an_argument_replay_the_same_numbers(name, policy):
    with fill_fresh_with_nan():
        assert_module_matches_eager(lambda: _Fn(RANDOM[name]), (5, 4), policy, steps=1)


def test_nan_fill_shows_a_replay_that_reads_uninitialized_memory():
    """The debug switch is live: a replayed empty_like that autograd reads unwritten is NaN."""
    x = torch.randn(3, requires_grad=True)

    def reads_garbage(x):
        e = torch.empty_like(x)
        return (x.exp() * e).sum()  # eager reads whatever was there too: only NaN tells

    with fill_fresh_with_nan():
        tracedac.checkpoint(reads_garbage)(x).backward()
    assert torch.isnan(x.grad).all()


RNNS = {
    "lstm": (lambda: nn.LSTM(4, 5), (3, 2, 4)),
    "lstm2_bi_drop": (lambda: nn.LSTM(4, 5, num_layers=2, bidirectional=True, dropout=0.3), (3, 2, 4)),
    "lstm_batch_first_proj": (lambda: nn.LSTM(4, 6, batch_first=True, proj_size=3), (2, 3, 4)),
    "gru2_bi": (
        lambda: nn.GRU(4, 5, num_layers=2, bidirectional=True, batch_first=True, dropout=0.2),
        (2, 3, 4),
    ),
    "rnn_relu2": (lambda: nn.RNN(4, 5, num_layers=2, nonlinearity="relu", dropout=0.5), (3, 2, 4)),
    "rnn_tanh_bi": (lambda: nn.RNN(4, 5, bidirectional=True, batch_first=True), (2, 3, 4)),
    "lstm_cell": (lambda: _Cells(nn.LSTMCell(4, 5)), (2, 4)),
    "gru_cell": (lambda: _Cells(nn.GRUCell(4, 5)), (2, 4)),
    "rnn_cell": (lambda: _Cells(nn.RNNCell(4, 5)), (2, 4)),
}


class _Cells(nn.Module):
    """A cell unrolled over three steps, as a hand-written RNN loop does."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def forward(self, x):
        state = None
        for _ in range(3):
            state = self.cell(x, state)
            h = state[0] if isinstance(state, tuple) else state
            x = h[:, :4]
        return h


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
@pytest.mark.parametrize("name", sorted(RNNS))
def test_recurrent_modules_match_eager(name, policy):
    make, shape = RNNS[name]
    with fill_fresh_with_nan():
        assert_module_matches_eager(make, shape, policy, steps=1, dtype=torch.float32)


def test_hidden_write_table_is_torchs_and_true():
    """torch's SchemaInfo list is found (flagged by ``training``), and every extra entry names
    arguments the op has; batch_norm_update_stats, the one with a CPU kernel, really writes."""
    from tracedac.record.undeclared_writes import EXTRA, hidden_writes

    aten = torch.ops.aten
    assert hidden_writes(aten.native_batch_norm.default) == (
        5,
        "training",
        ((3, "running_mean"), (4, "running_var")),
    )
    assert hidden_writes(aten.cudnn_batch_norm.default)[2] == ((3, "running_mean"), (4, "running_var"))
    assert hidden_writes(aten._native_batch_norm_legit.default) is None  # its schema says so itself
    assert hidden_writes(aten.add.Tensor) is None
    for name, (written, reason) in EXTRA.items():
        namespace, op = name.split("::")
        packet = getattr(getattr(torch.ops, namespace), op)
        assert hidden_writes(packet.default)[2] == tuple(
            (i, a.name) for i, a in enumerate(packet.default._schema.arguments) if a.name in written
        ), reason
    mean, var = torch.zeros(3), torch.ones(3)
    aten.batch_norm_update_stats(torch.randn(4, 3, 5), mean, var, 0.1)
    assert not torch.equal(mean, torch.zeros(3)) and not torch.equal(var, torch.ones(3))


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_writes_that_grow_their_output_match_eager(policy):
    """addbmm_ on a broadcastable self and an out= tensor of the wrong size resize the written
    tensor in place, as eager does; replay grows its private copy the same way."""

    def fn(x):
        s = torch.ones(4, dtype=x.dtype) * x.sum()
        s.addbmm_(x.exp(), x.transpose(1, 2))
        out = torch.empty(0, dtype=x.dtype)
        with torch.no_grad():
            torch.mul(x.detach().exp(), 2, out=out)
        return s.sin().sum() + (out.cos() * x).sum()

    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(fn(x), x)[0]
    assert torch.equal(torch.autograd.grad(tracedac.checkpoint(fn, policy=policy)(x), x)[0], expected)


def test_a_sparse_result_is_refused_with_a_checkpoint_error():
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(tracedac.CheckpointError, match=r"sparse_coo .*returned by aten._to_sparse.*outside"):
        tracedac.checkpoint(lambda x: (x * 2).to_sparse().to_dense().sum())(x)


@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_writes_through_a_tensor_list_argument_match_eager(policy):
    """``Tensor(a!)[]`` arguments (the ``_foreach_*_`` ops, what fused optimizers and AMP's
    unscale run) write every tensor of the list: replay must start from the written values, and
    two views of one storage in the list are one write."""

    def fn(x):
        y, z = x * 2, x + 1  # (nothing autograd saves is written: eager must accept it)
        torch._foreach_mul_([y, z], 3.0)
        torch._foreach_add_([y[:2], y[2:]], [z[:2], z[2:]])
        return y.sin().sum() + z.cos().sum()

    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(fn(x), x)[0]
    with fill_fresh_with_nan():
        got = torch.autograd.grad(tracedac.checkpoint(fn, policy=policy)(x), x)[0]
    assert torch.equal(got, expected)
