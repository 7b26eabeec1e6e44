"""accumulate_, both backends (Triton under its CPU interpreter): dst += src upcast, bit for bit."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracedac.kernels.bits import from_bits, to_bits
from tracedac.ops import accumulate_

from .castcheck import ADVERSARIAL_F32, FLOATS, assert_same_bits, expected_accumulate, f32


def accumulate_and_check(dst, src, backend):
    want = expected_accumulate(dst, src)
    assert accumulate_(dst, src, backend=backend) is dst
    assert_same_bits(dst, want, "accumulate_")


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
def test_adversarial_values_add_like_torch(backend, src_dtype):
    """inf + -inf, NaN on either side (with payloads), signed zeros, subnormals and values that
    cancel: every pairing of the adversarial values, added in fp32 with one rounding."""
    values = f32(ADVERSARIAL_F32)
    dst = values.repeat_interleave(len(ADVERSARIAL_F32)).clone()  # [n * n]
    src = values.repeat(len(ADVERSARIAL_F32)).to(src_dtype)
    accumulate_and_check(dst, src, backend)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_low_precision_pattern_is_upcast_exactly_before_adding(backend, src_dtype):
    """All 65536 source patterns added to a mix of magnitudes: the upcast must be exact."""
    src = from_bits(torch.arange(1 << 16, dtype=torch.int64), src_dtype)
    dst = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)) * 1e-3
    accumulate_and_check(dst, src, backend)


def test_strided_sources_and_shaped_dst_accumulate_in_place(backend, gen):
    """The reduced gradient may arrive as a view; dst keeps its shape and other memory."""
    buffer = torch.randn(100, generator=gen)
    dst = buffer[10:70].view(6, 10)
    src = torch.randn(10, 6, generator=gen).to(torch.bfloat16).t()
    outside = torch.cat([buffer[:10], buffer[70:]]).clone()
    accumulate_and_check(dst, src, backend)
    assert torch.equal(torch.cat([buffer[:10], buffer[70:]]), outside)


def test_a_tensor_can_be_accumulated_into_itself(backend, gen):
    """dst += dst is elementwise, as torch allows."""
    dst = torch.randn(1000, generator=gen)
    want = to_bits(dst * 2)
    accumulate_(dst, dst, backend=backend)
    assert_same_bits(dst, want)


@given(
    numel=st.integers(0, 3000),
    src_dtype=st.sampled_from(FLOATS),
    scale=st.sampled_from([1e-40, 1.0, 1e30]),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_gradients_accumulate_bit_exactly(backend, numel, src_dtype, scale, seed):
    """Random sizes and magnitudes, from fp32 subnormals to values near overflow."""
    g = torch.Generator().manual_seed(seed)
    dst = torch.randn(numel, generator=g) * scale
    src = (torch.randn(numel, generator=g) * scale).to(src_dtype)
    accumulate_and_check(dst, src, backend)
