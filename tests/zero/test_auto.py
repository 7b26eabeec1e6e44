"""``MixedPrecision(param_dtype="auto")``, eager, on real gloo groups of 1 and 2 ranks: each
group travels in the dtype the program computes its parameters in under autocast, decided
from the first forward by every rank together. (Compiled: tests/zero/test_compile.py.)"""

from __future__ import annotations

import pytest

import tracedac.zero as zero

from . import auto_workers as aw
from .spawn import run_ranks

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


@pytest.mark.parametrize("world", [1, 2])
def test_auto_decides_from_the_first_forward_and_trains_as_the_module_list(world):
    for r in run_ranks(aw.eager, world, timeout=120):
        assert set(r["first"].values()) == {"float32"}  # nothing decided before a forward
        decided = r["decided"]
        linear = {n: d for n, d in decided.items() if "Linear" in n}
        assert linear and set(linear.values()) == {"bfloat16"}, (
            decided
        )  # weights and biases: cast by autocast
        assert {d for n, d in decided.items() if "Linear" not in n} == {"float32"}, (
            decided
        )  # LayerNorm, Block's own
        losses, want = r["losses"]
        assert losses == want
        assert r["params"] == 0.0
        assert r["eval_diff"] < 1e-5  # without autocast a bf16-decided group gathers fp32: fp32 results
        (sent, gathered), (want_sent, want_gathered) = (tuple(zip(*x)) for x in r["wire"])
        if world == 1:  # one rank sends nothing: its gathers are casts; what they made is the wire
            assert set(sent) == set(want_sent) == {0}, (sent, want_sent)
            wire, want_wire = gathered, want_gathered
        else:
            wire, want_wire = sent, want_sent
        # the first step gathers fp32 while it observes (and backward then regathers no Linear:
        # autograd saved autocast's bf16 copies); from the second on, the list's bytes, up to
        # grouping (auto groups by module class: Block's own `odd`, which backward does not
        # read, is no longer in the LayerNorms' group that backward gathers again)
        assert wire[0] != want_wire[0]
        for got, want_bytes in zip(wire[1:], want_wire[1:], strict=True):
            assert abs(got - want_bytes) <= 0.02 * want_bytes, (wire, want_wire)


def test_ranks_that_read_a_parameter_differently_agree_on_fp32():
    """Rank 0 only casts the weight, rank 1 reads it as it is: both decide fp32 (one
    all-reduce of what each saw), so their gathers keep matching and training goes on."""
    (d0, l0), (d1, l1) = run_ranks(aw.divergent, 2, timeout=120)
    assert d0 == d1 and set(d0.values()) == {"float32"}, (d0, d1)
    assert len(l0) == len(l1) == 3


@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_a_weight_read_both_ways_travels_fp32_eager_and_compiled(how):
    """A tied embedding/output weight: the lookup reads it as it is, the projection's matmul
    casts it. Its group (the Embedding's) stays fp32; the Linear's group goes bf16."""
    (r,) = run_ranks(aw.tied, 1, how, timeout=120)
    got = {name.split("(")[1].split(",")[0]: dtype.removeprefix("torch.") for name, dtype in r.items()}
    assert got == {"trainable Embedding": "float32", "trainable Linear": "bfloat16"}, (how, r)


def test_auto_composes_with_nested_shards():
    """``shard(block)`` for each block, then ``shard(model)``: "auto" at the inner level, the
    outer or both is decided once for the whole model (the root's forward), on two ranks."""
    for r in run_ranks(aw.nested, 2, timeout=120):
        for levels, groups in r.items():
            auto = {(kind, dtype) for kind, dtype in groups if "auto" in kind}
            assert ("trainable Linear, auto dtype parameters", "bfloat16") in auto, (levels, groups)
            assert {d for kind, d in auto if "Linear" not in kind} <= {"float32"}, (levels, groups)
            plain = {d for kind, d in groups if "auto" not in kind}  # the level sharded without auto
            assert plain <= {"float32"}, (levels, groups)


def test_an_unknown_param_dtype_names_auto():
    with pytest.raises(TypeError, match='"auto"'):
        zero.MixedPrecision(param_dtype="bf16")


def test_ranks_that_gather_in_different_dtypes_all_raise_instead_of_aborting():
    """After "auto" decided bf16, a forward under autocast on one rank only: that rank
    gathers the Linear groups in bf16, the other in fp32. Same group, same element count,
    different bytes: without the dtype in the order check gloo aborts the process."""
    for elapsed, message in run_ranks(aw.autocast_on_one_rank, 2, timeout=120):
        assert message is not None and "bfloat16" in message and "float32" in message, message
        assert elapsed < 10, elapsed
