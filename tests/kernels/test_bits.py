"""The bit-level conversions (the kernel's algorithm, in torch) against torch's own casts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracedac.kernels.bits import FORMATS, NanRule, convert_bits, from_bits, nan_rule, to_bits

from .castcheck import ADVERSARIAL_F32, CPU, FLOATS, LOW, boundary_sample, f32


@pytest.mark.parametrize("src_dtype", LOW, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_every_16_bit_pattern_converts_like_torch(src_dtype, dst_dtype):
    """Upcasts and 16-bit to 16-bit casts go through fp32 bits; all 65536 inputs must agree.

    65536 is a multiple of every vector width, so torch's CPU cast has no tail here and its
    NaN bits follow one rule throughout.
    """
    patterns = torch.arange(1 << 16, dtype=torch.int64)
    want = to_bits(from_bits(patterns, src_dtype).to(dst_dtype))
    got = convert_bits(patterns, src_dtype, dst_dtype, nan_rule(CPU, src_dtype, dst_dtype))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dst_dtype", LOW, ids=str)
def test_every_fp32_exponent_rounds_like_torch_at_its_rounding_boundaries(dst_dtype):
    """Rounding errors hide at ties, at carries into the exponent, at overflow and in the
    subnormal range; every sign and exponent is tried with the mantissas where rounding turns.
    (All 2**32 patterns were checked once offline; see docs/guide/kernels.md.)"""
    patterns = boundary_sample()
    want = to_bits(from_bits(patterns, torch.float32).to(dst_dtype))
    got = convert_bits(patterns, torch.float32, dst_dtype, nan_rule(CPU, torch.float32, dst_dtype))
    assert torch.equal(got, want)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=64, max_size=64))
@settings(max_examples=200, deadline=None)
def test_random_fp32_patterns_round_like_torch(patterns):
    """Any fp32 pattern, NaNs included, matches torch's cast of a contiguous tensor."""
    bits = torch.tensor(patterns, dtype=torch.int64)
    x = from_bits(bits, torch.float32)
    for dst_dtype in LOW:
        want = to_bits(x.to(dst_dtype))
        assert torch.equal(
            convert_bits(bits, torch.float32, dst_dtype, nan_rule(CPU, torch.float32, dst_dtype)), want
        )


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_nan_rule_is_what_torch_gives_for_signalling_and_payload_nans(src_dtype, dst_dtype):
    """The kernel copies torch's NaN bits through this rule, so the rule must be torch's:
    checked on a long contiguous tensor of signalling NaNs, payload NaNs and both signs."""
    fmt = FORMATS[src_dtype]
    mantissa_mask = fmt.quiet_bit * 2 - 1
    gen = torch.Generator().manual_seed(0)
    payload = torch.randint(1, mantissa_mask + 1, (4096,), generator=gen, dtype=torch.int64)
    sign = torch.randint(0, 2, (4096,), generator=gen, dtype=torch.int64) << (fmt.width - 1)
    patterns = sign | fmt.exponent_ones | payload
    x = from_bits(patterns, src_dtype)
    assert bool(x.isnan().all())
    rule = nan_rule(CPU, src_dtype, dst_dtype)
    want = to_bits(x.to(dst_dtype))
    assert torch.equal(convert_bits(patterns, src_dtype, dst_dtype, rule), want)


def test_identity_casts_keep_every_bit_including_signalling_nans():
    """An fp32 -> fp32 or bf16 -> bf16 pack is a copy; torch keeps signalling NaNs there too."""
    for dtype in FLOATS:
        assert nan_rule(CPU, dtype, dtype) == NanRule(None, False)
    patterns = torch.tensor(ADVERSARIAL_F32, dtype=torch.int64)
    assert torch.equal(convert_bits(patterns, torch.float32, torch.float32, NanRule(None, False)), patterns)
    assert torch.equal(to_bits(f32(ADVERSARIAL_F32)), patterns)
