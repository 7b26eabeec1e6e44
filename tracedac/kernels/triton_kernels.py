"""The Triton kernel behind ``pack_cast`` and ``accumulate_``: one launch for any number of sources.

Each program converts ``BLOCK`` elements of one source. It finds its source through the
segment table (see ``table.py``): a raw data pointer cast to a typed pointer, so sources are
read where they live, in any dtype and layout, without a gather or copy first.

Values are converted on their bit patterns with integer operations, the same algorithm as
``bits.py`` (which tests check against torch on every fp32 pattern): ``x.to(tl.bfloat16)``
truncates under Triton 3.9's interpreter, and integer operations cannot be flushed to zero.

The kernel is one function calling only Triton builtins (no ``@triton.jit`` helpers, nor
``tl.zeros`` or ``tl.cdiv``, which are ``@triton.jit`` functions themselves) so that
``launch.py`` can run the same source compiled or interpreted, whatever ``TRITON_INTERPRET``
was when Triton was imported.
"""

import triton
import triton.language as tl

from . import table as _table

_ADDR = tl.constexpr(_table.ADDR)
_KIND = tl.constexpr(_table.KIND)
_DST_START = tl.constexpr(_table.DST_START)
_NUMEL = tl.constexpr(_table.NUMEL)
_FIRST_BLOCK = tl.constexpr(_table.FIRST_BLOCK)
_CONTIGUOUS = tl.constexpr(_table.CONTIGUOUS)
_NAN_CANONICAL = tl.constexpr(_table.NAN_CANONICAL)
_NAN_QUIET_BITS = tl.constexpr(_table.NAN_QUIET_BITS)
_NAN_PAYLOAD_MASK = tl.constexpr(_table.NAN_PAYLOAD_MASK)
_SIZES = tl.constexpr(_table.SIZES)
_STRIDES = tl.constexpr(_table.STRIDES)
_COLS = tl.constexpr(_table.COLS)
_MAX_DIMS = tl.constexpr(_table.MAX_DIMS)


@triton.jit
def pack_cast_kernel(
    table_ptr,  # int64 [rows * COLS]: one row per non-empty source
    block_row_ptr,  # int64 [programs]: the row each program works on
    dst_ptr,  # flat dst; read and added to when ACCUMULATE
    DST_KIND: tl.constexpr,  # 0 fp32, 1 bf16, 2 fp16 (bits.FORMATS)
    ACCUMULATE: tl.constexpr,  # dst += src instead of dst = src
    ALIGNED: tl.constexpr,  # host checked: all contiguous, 16-byte aligned, sizes % 8 == 0
    DST_ALIGN: tl.constexpr,  # elements per 16 bytes of dst
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_row_ptr + pid) * _COLS
    addr = tl.load(row + _ADDR)
    kind = tl.load(row + _KIND)
    dst_start = tl.load(row + _DST_START)
    numel = tl.load(row + _NUMEL)
    idx = (pid - tl.load(row + _FIRST_BLOCK)) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] int64

    if ALIGNED:
        # The hints let the compiler issue 16-byte vector loads and stores (a mask must also be
        # constant over each vector, hence the hint on numel).
        dst_start = tl.multiple_of(dst_start, DST_ALIGN)
        numel = tl.multiple_of(numel, 8)
        src32 = tl.multiple_of(addr.to(tl.pointer_type(tl.uint32)), 16)
        src16 = tl.multiple_of(addr.to(tl.pointer_type(tl.uint16)), 16)
        offs = idx
    else:
        src32 = addr.to(tl.pointer_type(tl.uint32))
        src16 = addr.to(tl.pointer_type(tl.uint16))
        if tl.load(row + _CONTIGUOUS) != 0:
            offs = idx
        else:
            offs = tl.full([BLOCK], 0, tl.int64)
            rest = idx
            for d in tl.static_range(_MAX_DIMS):
                size = tl.load(row + _SIZES + d)
                offs += (rest % size) * tl.load(row + _STRIDES + d)
                rest = rest // size
    mask = idx < numel

    # Widen to fp32 bit patterns, exactly, NaN payloads kept as they are.
    if kind == 0:
        u = tl.load(src32 + offs, mask=mask, other=0)
    else:
        h = tl.load(src16 + offs, mask=mask, other=0).to(tl.uint32)
        if kind == 1:
            u = h << 16
        else:
            exponent = (h >> 10) & 0x1F
            mantissa = h & 0x3FF
            normal = ((exponent + 112) << 23) | (mantissa << 13)  # rebias 15 -> 127
            special = 0x7F800000 | (mantissa << 13)
            # mantissa * 2**-24: the small integer converts exactly, then the exponent drops 24.
            subnormal = mantissa.to(tl.float32).to(tl.uint32, bitcast=True) - (24 << 23)
            zero_or_sub = tl.where(mantissa != 0, subnormal, 0)
            u = ((h & 0x8000) << 16) | tl.where(
                exponent == 0x1F, special, tl.where(exponent != 0, normal, zero_or_sub)
            )

    # Narrow to the destination format, rounding to nearest even on the bits.
    magnitude = u & 0x7FFFFFFF
    if DST_KIND == 0:
        sign = u & 0x80000000
        rounded = u
        payload = u & 0x7FFFFF
        exponent_ones = 0x7F800000
    elif DST_KIND == 1:
        sign = (u >> 16) & 0x8000
        # +0x7FFF (+1 if the kept part is odd) carries into the kept bits exactly when the
        # dropped half is past the midpoint or on it with an odd kept part; a carry out of
        # the mantissa bumps the exponent, which is also how the largest values become inf.
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        payload = (u & 0x7FFFFF) >> 16
        exponent_ones = 0x7F80
    else:
        sign = (u >> 16) & 0x8000
        rebiased = magnitude - 0x38000000  # exponent 127 -> 15; used only where normal
        normal_h = (rebiased + 0xFFF + ((rebiased >> 13) & 1)) >> 13
        # Below 2**-14 the half is subnormal: the full significand shifted right by
        # (126 - exponent), rounded to nearest even on the bits shifted out.
        exp32 = (magnitude >> 23).to(tl.int32)
        significand = (magnitude & 0x7FFFFF) | tl.where(exp32 > 0, 0x800000, 0).to(tl.uint32)
        shift = tl.minimum(tl.maximum(126 - exp32, 1), 31).to(tl.uint32)
        kept = significand >> shift
        dropped = significand & ((tl.full([BLOCK], 1, tl.uint32) << shift) - 1)
        half = tl.full([BLOCK], 1, tl.uint32) << (shift - 1)
        up = (dropped > half) | ((dropped == half) & ((kept & 1) == 1))
        kept = kept + up.to(tl.uint32)
        # 0x477FF000 is 65520, the midpoint between 65504 (the largest half) and 65536: from
        # there up the value rounds to inf (the tie goes to the even side, which overflows).
        rounded = sign | tl.where(
            magnitude >= 0x477FF000, 0x7C00, tl.where(magnitude >= 0x38800000, normal_h, kept)
        )
        payload = (u & 0x7FFFFF) >> 13
        exponent_ones = 0x7C00
    canonical = tl.load(row + _NAN_CANONICAL)
    payload = payload & tl.load(row + _NAN_PAYLOAD_MASK).to(tl.uint32)
    kept_nan = sign | exponent_ones | payload | tl.load(row + _NAN_QUIET_BITS).to(tl.uint32)
    nan = tl.where(canonical >= 0, canonical.to(tl.uint32), kept_nan)
    bits = tl.where(magnitude > 0x7F800000, nan, rounded)

    out = dst_ptr + dst_start + idx
    if ACCUMULATE:
        # src first: given two NaNs numpy (the interpreter) returns the first operand, as
        # torch's CPU add returns src's; on a GPU the add instruction decides, as for torch.
        tl.store(out, bits.to(tl.float32, bitcast=True) + tl.load(out, mask=mask), mask=mask)
    elif DST_KIND == 0:
        tl.store(out.to(tl.pointer_type(tl.uint32), bitcast=True), bits, mask=mask)
    else:
        tl.store(out.to(tl.pointer_type(tl.uint16), bitcast=True), bits.to(tl.uint16), mask=mask)
