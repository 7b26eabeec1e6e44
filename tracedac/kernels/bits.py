"""Float conversions computed on bit patterns, and the NaN bits torch's casts produce.

The Triton kernel converts with integer operations on the fp32 bit pattern rather than
``x.to(tl.bfloat16)``: Triton 3.9's interpreter truncates there instead of rounding, and
integer operations mean the same thing on every device (no flush-to-zero, no rounding-mode
state). The torch functions here are the kernel's algorithm step for step, on int64 tensors,
so it can be checked against torch's own casts on every fp32 bit pattern in minutes on a CPU.

Every non-NaN value comes out as torch rounds it (round to nearest, ties to even; overflow to
inf; subnormals kept). NaN bits are not fixed by IEEE 754 and torch's differ between devices
and even between code paths on one device, so :func:`nan_rule` asks torch what its cast gives
on contiguous data and the kernel mirrors that rule.
"""

import functools
from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "NanRule", "nan_rule", "to_bits", "from_bits", "widen", "narrow", "convert_bits"]


@dataclass(frozen=True)
class Format:
    """Bit layout of one float dtype, as the kernel sees it."""

    kind: int  # the number the kernel dispatches on
    width: int  # bits
    payload_shift: int  # how far an fp32 mantissa moves right to fit this format
    exponent_ones: int  # sign clear, exponent all ones, mantissa zero: +inf
    quiet_bit: int  # the top mantissa bit, set in a quiet NaN


FORMATS = {
    torch.float32: Format(0, 32, 0, 0x7F800000, 0x00400000),
    torch.bfloat16: Format(1, 16, 16, 0x7F80, 0x0040),
    torch.float16: Format(2, 16, 13, 0x7C00, 0x0200),
}

_INT_VIEW = {32: torch.int32, 16: torch.int16}


@dataclass(frozen=True)
class NanRule:
    """What one cast does to a NaN.

    ``canonical`` set: every NaN becomes exactly those bits. Otherwise the sign is kept, the
    top bits of the payload are kept if ``payload``, and the quiet bit is forced on if
    ``quiet``. Identity casts use ``NanRule(None, False)``: bits are copied unchanged.
    """

    canonical: int | None
    quiet: bool
    payload: bool = True

    def quiet_bits(self, dst_dtype: torch.dtype) -> int:
        return FORMATS[dst_dtype].quiet_bit if self.quiet else 0

    def payload_mask(self, dst_dtype: torch.dtype) -> int:
        return FORMATS[dst_dtype].quiet_bit * 2 - 1 if self.payload else 0


def to_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a float tensor as non-negative int64 values."""
    width = FORMATS[t.dtype].width
    return t.contiguous().view(_INT_VIEW[width]).to(torch.int64) & ((1 << width) - 1)


def from_bits(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float tensor whose bit patterns are ``bits`` (int64, non-negative)."""
    width = FORMATS[dtype].width
    signed = torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits)
    return signed.to(_INT_VIEW[width]).view(dtype)


def widen(bits: torch.Tensor, src_dtype: torch.dtype) -> torch.Tensor:
    """fp32 bit patterns of the values ``bits`` hold in ``src_dtype``: exact, NaN payload kept."""
    if src_dtype == torch.float32:
        return bits
    if src_dtype == torch.bfloat16:
        return bits << 16
    sign = (bits & 0x8000) << 16
    exponent = (bits >> 10) & 0x1F
    mantissa = bits & 0x3FF
    normal = ((exponent + 112) << 23) | (mantissa << 13)  # rebias 15 -> 127
    special = 0x7F800000 | (mantissa << 13)
    # A subnormal half is mantissa * 2**-24: convert the small integer exactly, then move the
    # exponent down by 24 (the result is a normal fp32, so no rounding happens).
    subnormal = (mantissa.to(torch.float32).view(torch.int32).to(torch.int64) - (24 << 23)) & 0xFFFFFFFF
    magnitude = torch.where(
        exponent == 0x1F,
        special,
        torch.where(exponent != 0, normal, torch.where(mantissa != 0, subnormal, 0)),
    )
    return sign | magnitude


def narrow(u: torch.Tensor, dst_dtype: torch.dtype, rule: NanRule) -> torch.Tensor:
    """``dst_dtype`` bit patterns of the fp32 values whose bits are ``u``, rounded to nearest even."""
    fmt = FORMATS[dst_dtype]
    magnitude = u & 0x7FFFFFFF
    sign = (u >> (32 - fmt.width)) & (1 << (fmt.width - 1))
    if dst_dtype == torch.float32:
        rounded = u
    elif dst_dtype == torch.bfloat16:
        # Adding 0x7FFF (+1 when the kept part is odd) carries into the kept bits exactly when
        # the dropped half is above the midpoint, or on it with an odd kept part. A carry out of
        # the mantissa bumps the exponent, which also turns the largest finite values into inf.
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    else:
        rounded = sign | _fp16_magnitude(magnitude)
    payload = ((u & 0x7FFFFF) >> fmt.payload_shift) & rule.payload_mask(dst_dtype)
    if rule.canonical is not None:
        nan = torch.full_like(u, rule.canonical)
    else:
        nan = sign | fmt.exponent_ones | payload | rule.quiet_bits(dst_dtype)
    return torch.where(magnitude > 0x7F800000, nan, rounded)


def _fp16_magnitude(magnitude: torch.Tensor) -> torch.Tensor:
    rebiased = magnitude - 0x38000000  # exponent 127 -> 15; used only where the result is normal
    normal = (rebiased + 0xFFF + ((rebiased >> 13) & 1)) >> 13
    # Below 2**-14 the half is subnormal: m * 2**-24 with m the full significand shifted right
    # by (126 - exponent), rounded to nearest even by looking at the bits shifted out.
    exponent = magnitude >> 23
    significand = (magnitude & 0x7FFFFF) | torch.where(exponent > 0, 0x800000, 0)
    shift = (126 - exponent).clamp(1, 31)
    kept = significand >> shift
    dropped = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    kept = kept + ((dropped > half) | ((dropped == half) & ((kept & 1) == 1))).to(torch.int64)
    # 0x477FF000 is 65520, halfway between the largest half (65504) and 65536: from there on
    # the value rounds to inf (the tie goes to the even neighbour, 65536, which overflows).
    return torch.where(magnitude >= 0x477FF000, 0x7C00, torch.where(magnitude >= 0x38800000, normal, kept))


def convert_bits(
    bits: torch.Tensor, src_dtype: torch.dtype, dst_dtype: torch.dtype, rule: NanRule
) -> torch.Tensor:
    """``dst_dtype`` bit patterns of ``src_dtype`` bit patterns: what the kernel computes."""
    return narrow(widen(bits, src_dtype), dst_dtype, rule)


# NaN bit patterns to probe torch with: signalling with the payload only in the low bits (that
# a plain truncation would turn into inf), signalling and quiet with payloads, both signs.
_NAN_PROBES = {
    torch.float32: [0x7F800001, 0xFF812345, 0x7FA00000, 0xFFC12345, 0x7FFFFFFF, 0x7FC00000],
    torch.bfloat16: [0x7F81, 0xFF95, 0x7FA0, 0xFFC5, 0x7FFF, 0x7FC0],
    torch.float16: [0x7C01, 0xFD55, 0x7D00, 0xFE11, 0x7FFF, 0x7E00],
}
# Long enough that the elements read back are in the body of torch's vectorised loop on any
# ISA: on x86, torch's fp16 -> fp32 cast gives other NaN bits in the loop's tail.
_PROBE_REPEATS = 128
_PROBE_READ = 48


@functools.cache
def nan_rule(device: torch.device, src_dtype: torch.dtype, dst_dtype: torch.dtype) -> NanRule:
    """The rule torch's ``.to(dst_dtype)`` follows for NaNs of a contiguous ``src_dtype`` tensor.

    Runs one tiny cast on ``device`` the first time a pair is asked for. Torch's answer
    differs by device and by CPU ISA (AVX2 kernels and scalar ones differ); on CPU it also
    differs for strided inputs and for the last few elements of some casts, not mirrored.
    """
    if src_dtype == dst_dtype:
        return NanRule(None, False)
    probes = _NAN_PROBES[src_dtype]
    src_bits = torch.tensor(probes * _PROBE_REPEATS, dtype=torch.int64)
    src = from_bits(src_bits, src_dtype).to(device)
    got = to_bits(src.to(dst_dtype).cpu())[:_PROBE_READ]
    want_src = src_bits[:_PROBE_READ]
    if bool((got == got[0]).all()):
        candidates = [NanRule(int(got[0]), False)]
    else:
        candidates = [NanRule(None, quiet, payload) for payload in (True, False) for quiet in (True, False)]
    for rule in candidates:
        if torch.equal(convert_bits(want_src, src_dtype, dst_dtype, rule), got):
            return rule
    raise RuntimeError(
        f"torch's {src_dtype} -> {dst_dtype} cast on {device} turns NaNs {[hex(p) for p in probes]} "
        f"into {[hex(int(g)) for g in got[: len(probes)]]}: neither one fixed NaN nor a rule that "
        "keeps the sign (and maybe the payload), the rules the Triton kernel can mirror, so its "
        "output would not be bit-identical to torch's. Use backend='torch' for this cast."
    )
