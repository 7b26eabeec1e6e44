"""pack_cast, both backends (Triton under its CPU interpreter), against torch's casts bit for bit."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracedac.kernels import launch as launch_module
from tracedac.kernels.bits import from_bits
from tracedac.kernels.table import plan_for
from tracedac.ops import pack_cast

from .castcheck import (
    ADVERSARIAL_F32,
    FLOATS,
    LOW,
    assert_guards_untouched,
    assert_same_bits,
    boundary_sample,
    expected_pack,
    f32,
    guarded,
)


def pack_and_check(srcs, dtype, backend):
    total = sum(s.numel() for s in srcs)
    buffer, dst = guarded(total, dtype)
    assert pack_cast(srcs, dst, backend=backend) is dst
    assert_same_bits(dst, expected_pack(srcs, dtype))
    assert_guards_untouched(buffer)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_adversarial_fp32_values_cast_bit_exactly(backend, dtype):
    """NaNs with payloads, infinities, signed zeros, subnormals, overflow and exact ties are
    where a hand-written cast goes wrong; each must come out as torch's cast gives it."""
    pack_and_check([f32(ADVERSARIAL_F32)], dtype, backend)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_every_exponent_boundary_casts_bit_exactly(backend, dtype):
    """~600k patterns: every sign and exponent with the mantissas where rounding turns, in one
    source, so the kernel's rounding (not just bits.py's) is checked on all of them."""
    pack_and_check([from_bits(boundary_sample(), torch.float32)], dtype, backend)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_low_precision_sources_cast_and_copy_bit_exactly(backend, dtype):
    """bf16/fp16 sources: upcasts, cross casts and identity copies (signalling NaNs kept)."""
    patterns = torch.arange(1 << 16, dtype=torch.int64)
    srcs = [from_bits(patterns, torch.bfloat16), from_bits(patterns, torch.float16)]
    pack_and_check(srcs, dtype, backend)


def test_many_small_odd_sized_sources_pack_in_order(backend, gen):
    """A unit has many small tensors (norms, biases) of odd sizes; each lands at its offset."""
    sizes = torch.randint(0, 40, (150,), generator=gen).tolist()
    srcs = [torch.randn(n, generator=gen) * 1e3 for n in sizes]
    pack_and_check(srcs, torch.bfloat16, backend)


def test_one_large_source_packs_bit_exactly(backend, gen):
    """A 4M-element shard of odd length (a few seconds under the interpreter)."""
    src = torch.randn(4 * 1024 * 1024 + 3, generator=gen) * 100
    pack_and_check([src], torch.bfloat16, backend)


def strided_sources(gen):
    base = torch.randn(6, 7, 8, generator=gen)
    return [
        base.transpose(0, 2),  # [8, 7, 6], permuted
        base[:, ::2, 1:7:3],  # stepped slices
        base[2],  # a plain view at an offset
        torch.randn(5, 1, generator=gen).expand(5, 4),  # stride 0
        torch.randn(3, 4, 5, 2, 3, generator=gen).permute(4, 2, 0, 3, 1),  # 5 dims, none merge
        torch.randn(2, 3, generator=gen).to(torch.bfloat16).t(),
        torch.randn(4, 6, generator=gen).to(torch.float16)[:, 1::2],
        torch.randn(1, 1, 1, generator=gen),
    ]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_non_contiguous_sources_are_read_through_their_strides(backend, gen, dtype):
    """Shards can be views (transposed weights, slices); they must be read in logical order."""
    srcs = strided_sources(gen)
    assert not any(s.is_contiguous() for s in srcs[:2])
    pack_and_check(srcs, dtype, backend)


@pytest.mark.parametrize("guard, aligned", [(64, True), (37, False)], ids=["aligned", "misaligned"])
def test_aligned_and_misaligned_slots_both_cast_exactly(interpreter, gen, guard, aligned):
    """Aligned contiguous sources take the kernel variant with vector-width hints; a slot at
    an odd offset takes the scalar one. Both must give the same bits."""
    srcs = [torch.randn(n, generator=gen) * 7 for n in (1024, 8, 4096 + 16)]
    total = sum(s.numel() for s in srcs)
    buffer, dst = guarded(total, torch.bfloat16, guard)
    assert plan_for(srcs, dst, block=1024).aligned is aligned
    pack_cast(srcs, dst, backend="triton")
    assert_same_bits(dst, expected_pack(srcs, torch.bfloat16))
    assert_guards_untouched(buffer, guard)


def test_empty_sources_and_empty_dst_are_accepted(backend):
    """A unit may hold zero-size tensors, or nothing on this rank."""
    pack_and_check([torch.empty(0), torch.ones(3), torch.empty(0, 4)], torch.bfloat16, backend)
    pack_and_check([], torch.bfloat16, backend)


def test_triton_backend_uses_one_launch_whatever_the_source_count(interpreter, gen):
    """One launch for all of a unit's tensors is the point of the kernel."""
    for count in (1, 7, 60):
        srcs = [torch.randn(int(n) + 1, generator=gen) for n in torch.randint(0, 30, (count,), generator=gen)]
        dst = torch.empty(sum(s.numel() for s in srcs), dtype=torch.bfloat16)
        before = launch_module.launches
        pack_cast(srcs, dst, backend="triton")
        assert launch_module.launches == before + 1


def test_a_cached_plan_reads_the_sources_current_values(interpreter, gen):
    """Plans are cached by pointer and layout; the values must still be read each call, and a
    same-address source of another dtype must not reuse the plan."""
    src = torch.randn(1000, generator=gen)
    dst = torch.empty(1000, dtype=torch.bfloat16)
    pack_cast([src], dst, backend="triton")
    src.mul_(3)
    pack_cast([src], dst, backend="triton")
    assert_same_bits(dst, expected_pack([src], torch.bfloat16))
    as_half = src[:500].view(torch.float16).view(500, 2)  # same address, other dtype and shape
    pack_cast([as_half], dst, backend="triton")
    assert_same_bits(dst, expected_pack([as_half], torch.bfloat16))


layouts = st.sampled_from(["contiguous", "transposed", "stepped", "offset"])


@st.composite
def source_lists(draw):
    srcs = []
    for _ in range(draw(st.integers(1, 6))):
        rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 9))
        dtype = draw(st.sampled_from(FLOATS))
        scale = draw(st.sampled_from([1e-42, 1e-6, 1.0, 6e4, 3e38]))
        seed = draw(st.integers(0, 2**31))
        t = (torch.randn(rows + 1, 2 * cols, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
        layout = draw(layouts)
        if layout == "contiguous":
            t = t[:rows].contiguous()
        elif layout == "transposed":
            t = t.t()
        elif layout == "stepped":
            t = t[:, ::2]
        else:
            t = t[1:, 1:]
        srcs.append(t)
    return srcs


@given(srcs=source_lists(), dtype=st.sampled_from(FLOATS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_source_lists_pack_bit_exactly(backend, srcs, dtype):
    """Random counts, shapes, dtypes, layouts and magnitudes (subnormal to near-overflow)."""
    pack_and_check(srcs, dtype, backend)
