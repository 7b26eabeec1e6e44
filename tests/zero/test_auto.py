"""``MixedPrecision(param_dtype="auto")``, eager, on real gloo groups of 1 and 2 ranks: each
group travels in the dtype the program computes its parameters in under autocast, decided
from the first forward by every rank together. (Compiled: tests/zero/test_compile.py.)

Oracles: the module-list ``MixedPrecision()`` (Linear parameters in bf16, by a list the user
writes) trained the same way, and the bytes every all-gather moves at the process group
(``GatherLog``). The rank functions check what they compute (tests/support/ranks.py).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import tracedac.zero as zero

from ..support.compiled_graphs import GATHER, START, Graphs, gather_dtype
from ..support.ranks import run_ranks
from ..support.zero_logs import train_logged
from ..support.zero_model import D, max_diff, model, rank_batch

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


def _dtypes(m) -> dict:
    """Each group's name -> its travel dtype."""
    return {g.name: str(g.dtype).removeprefix("torch.") for g in m._tracedac_zero.all_groups}


def eager(rank, world):
    """``"auto"`` against the module list: nothing decided before a forward; the Linears'
    groups bf16 and the rest fp32 after it; the same losses and parameters (a cast moved before
    the gather changes no bit); an eval pass without autocast in fp32; the wire after the first
    step the list's."""
    listed = zero.shard(model(), mixed_precision=zero.MixedPrecision())
    auto = zero.shard(model(), mixed_precision=zero.MixedPrecision("auto"))
    first = _dtypes(auto)
    want_losses, want_wire = train_logged(listed, rank, world)
    losses, wire = train_logged(auto, rank, world)
    params = max_diff(zero.full_state_dict(auto), zero.full_state_dict(listed))
    # an eval pass without autocast after the decision: bf16 groups gather fp32 there
    plain = model()
    plain.load_state_dict(zero.full_state_dict(auto))
    x, _ = rank_batch(0, rank, world)
    with torch.no_grad():
        eval_diff = (auto(x) - plain(x)).abs().max().item()
    decided = _dtypes(auto)
    assert set(first.values()) == {"float32"}, first  # nothing decided before a forward
    linear = {n: d for n, d in decided.items() if "Linear" in n}
    assert linear and set(linear.values()) == {"bfloat16"}, decided  # weights and biases: cast by autocast
    assert {d for n, d in decided.items() if "Linear" not in n} == {"float32"}, decided  # LayerNorm, Block's
    assert losses == want_losses, (losses, want_losses)
    assert params == 0.0, params
    assert eval_diff < 1e-5, eval_diff  # without autocast a bf16-decided group gathers fp32: fp32 results
    (sent, gathered), (want_sent, want_gathered) = zip(*wire), zip(*want_wire)
    if world == 1:  # one rank sends nothing: its gathers are casts; what they made is the wire
        assert set(sent) == set(want_sent) == {0}, (sent, want_sent)
        wire, want_wire = gathered, want_gathered
    else:
        wire, want_wire = sent, want_sent
    # the first step gathers fp32 while it observes (and backward then regathers no Linear:
    # autograd saved autocast's bf16 copies); from the second on, the list's bytes, up to
    # grouping (auto groups by module class: Block's own `odd`, which backward does not
    # read, is no longer in the LayerNorms' group that backward gathers again)
    assert wire[0] != want_wire[0], (wire, want_wire)
    for got, want_bytes in zip(wire[1:], want_wire[1:], strict=True):
        assert abs(got - want_bytes) <= 0.02 * want_bytes, (wire, want_wire)


class Divergent(nn.Module):
    """One Linear whose weight rank 0 reads through a matmul (autocast casts it) and rank 1
    reads as it is (a sum): only an agreement between ranks keeps their gathers matching."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, D)
        self.rank = rank

    def forward(self, x):
        if self.rank == 0:
            return self.lin(x).float().sum(-1)
        return (x * self.lin.weight.sum() + self.lin.bias.sum()).sum(-1)


def divergent(rank, world):
    m = zero.shard(Divergent(rank), mixed_precision=zero.MixedPrecision("auto"))
    losses, _ = train_logged(m, rank, world)
    dtypes = _dtypes(m)
    every = [None] * world
    torch.distributed.all_gather_object(every, dtypes)
    assert every[0] == every[1] and set(dtypes.values()) == {"float32"}, every
    assert len(losses) == 3, losses


class Tied(nn.Module):
    """An embedding whose weight is also the output projection's (read as it is by the lookup,
    cast by autocast for the matmul), beside a plain Linear."""

    def __init__(self, vocab=32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, D)
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.lin(self.embed(idx))).float()


def tied(rank, world, how):
    """The dtypes "auto" decides for the tied weight (fp32) and the Linear (bf16), ``how``:
    "eager" (the groups' dtypes after two steps) or "compiled" (the dtypes of the graph's gathers)."""
    import torch._dynamo

    idx = torch.arange(8).view(2, 4)
    if how == "eager":
        m = zero.shard(Tied(), mixed_precision=zero.MixedPrecision("auto"))
        for _ in range(2):
            with torch.autocast("cpu", torch.bfloat16):
                m(idx).sum().backward()
        got = _dtypes(m)
    else:
        torch._dynamo.reset()
        m = zero.shard(Tied(), mixed_precision=zero.MixedPrecision("auto"))
        g = Graphs()
        with torch.autocast("cpu", torch.bfloat16):
            torch.compile(m, fullgraph=True, backend=g.backend)(idx).sum().backward()
        names = {grp.key: grp.name for grp in m._tracedac_zero.all_groups}
        got = {
            names[n.args[1]]: gather_dtype(n)
            for gm in g.forward
            for n in gm.graph.nodes
            if n.target in (GATHER, START)
        }
        torch._dynamo.reset()
    got = {name.split("(")[1].split(",")[0]: dtype.removeprefix("torch.") for name, dtype in got.items()}
    assert got == {"trainable Embedding": "float32", "trainable Linear": "bfloat16"}, (how, got)


def nested(rank, world):
    """Each block sharded, then the model (FSDP2's pattern), "auto" at either level or both:
    after three steps under autocast, the Linear groups of the auto level bf16, the rest fp32."""
    for inner, outer in (("auto", "auto"), (None, "auto"), ("auto", None)):
        m = model()
        for b in m.blocks:
            zero.shard(b, mixed_precision=zero.MixedPrecision("auto") if inner else None)
        zero.shard(m, mixed_precision=zero.MixedPrecision("auto") if outer else None)
        train_logged(m, rank, world)
        groups = {
            (g.name.split("(")[1].rstrip(")"), str(g.dtype).removeprefix("torch."))
            for g in m._tracedac_zero.all_groups
        }
        levels = (inner, outer)
        auto = {(kind, dtype) for kind, dtype in groups if "auto" in kind}
        assert ("trainable Linear, auto dtype parameters", "bfloat16") in auto, (levels, groups)
        assert {d for kind, d in auto if "Linear" not in kind} <= {"float32"}, (levels, groups)
        plain = {d for kind, d in groups if "auto" not in kind}  # the level sharded without auto
        assert plain <= {"float32"}, (levels, groups)


def autocast_on_one_rank(rank, world):
    """Two steps under autocast on both ranks ("auto" decides bf16 for the Linear groups),
    then a forward under autocast on rank 0 only: rank 0 gathers those groups in bf16 and
    rank 1 in fp32: both raise a ZeroError at once, naming both dtypes."""
    m = zero.shard(model(), mixed_precision=zero.MixedPrecision("auto"), timeout=20)
    train_logged(m, rank, world, steps=2)
    x, _ = rank_batch(2, rank, world)
    start = time.monotonic()
    try:
        with torch.autocast("cpu", torch.bfloat16, enabled=rank == 0):
            m(x)
    except zero.ZeroError as e:
        elapsed, message = time.monotonic() - start, str(e)
    else:
        elapsed, message = time.monotonic() - start, None
    assert message is not None and "bfloat16" in message and "float32" in message, message
    assert elapsed < 10, elapsed


@pytest.mark.parametrize("world", [1, 2])
def test_auto_decides_from_the_first_forward_and_trains_as_the_module_list(world):
    run_ranks(eager, world, timeout=120)


def test_ranks_that_read_a_parameter_differently_agree_on_fp32():
    """Rank 0 only casts the weight, rank 1 reads it as it is: both decide fp32 (one
    all-reduce of what each saw), so their gathers keep matching and training goes on."""
    run_ranks(divergent, 2, timeout=120)


@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_a_weight_read_both_ways_travels_fp32_eager_and_compiled(how):
    """A tied embedding/output weight: the lookup reads it as it is, the projection's matmul
    casts it. Its group (the Embedding's) stays fp32; the Linear's group goes bf16."""
    run_ranks(tied, 1, how, timeout=120)


def test_auto_composes_with_nested_shards():
    """``shard(block)`` for each block, then ``shard(model)``: "auto" at the inner level, the
    outer or both is decided once for the whole model (the root's forward), on two ranks."""
    run_ranks(nested, 2, timeout=120)


def test_an_unknown_param_dtype_names_auto():
    with pytest.raises(TypeError, match='"auto"'):
        zero.MixedPrecision(param_dtype="bf16")


def test_ranks_that_gather_in_different_dtypes_all_raise_instead_of_aborting():
    """After "auto" decided bf16, a forward under autocast on one rank only: that rank
    gathers the Linear groups in bf16, the other in fp32. Same group, same element count,
    different bytes: without the dtype in the order check gloo aborts the process."""
    run_ranks(autocast_on_one_rank, 2, timeout=120)
