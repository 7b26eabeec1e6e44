"""Shared test inputs and oracles for the tracedac.kernels tests."""

import torch

from tracedac.kernels.bits import FORMATS, convert_bits, from_bits, nan_rule, to_bits

CPU = torch.device("cpu")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
LOW = (torch.bfloat16, torch.float16)

# fp32 values that cast badly when a cast is done wrong.
ADVERSARIAL_F32 = [
    0x00000000,
    0x80000000,  # +-0
    0x7F800000,
    0xFF800000,  # +-inf
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0xFF800001,
    0x7FA00000,
    0x7FFFFFFF,
    0xFFFFFFFF,
    0x7FC12345,  # NaNs
    0x00000001,
    0x80000001,
    0x007FFFFF,
    0x00400000,
    0x00008000,
    0x00018000,  # fp32 subnormals
    0x00800000,
    0x00800001,  # smallest normal
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x7F7F7FFF,
    0x7F7F8000,
    0x7F7F8001,  # bf16: overflow and ties near max
    0x3F808000,
    0x3F818000,
    0x3F807FFF,
    0x3F808001,  # bf16 ties: to even down, to even up, near ties
    0x477FE000,
    0x477FEFFF,
    0x477FF000,
    0x477FF001,
    0x47800000,
    0xC77FF000,  # fp16: 65504 .. 65536
    0x3F801000,
    0x3F803000,
    0x3F800FFF,
    0x3F801001,  # fp16 ties at 1.0
    0x38800000,
    0x387FE000,
    0x387FF000,
    0x387FFFFF,  # fp16: smallest normal and just below
    0x33800000,
    0x33000000,
    0x33000001,
    0x32FFFFFF,
    0x33C00000,
    0x33A00000,  # fp16: 2**-24, 2**-25 ties
    0x34400000,
    0x34200000,
    0x34600000,
    0x35100000,
    0xB3000001,  # fp16 subnormal ties, odd and even
    0x3F800000,
    0xBF800000,
    0x40490FDB,
    0x3DCCCCCD,  # ordinary values
]


def f32(patterns) -> torch.Tensor:
    return from_bits(torch.tensor(patterns, dtype=torch.int64), torch.float32)


def boundary_sample(seed: int = 0, random_per_exponent: int = 1024) -> torch.Tensor:
    """fp32 bit patterns: every sign and exponent, each with the mantissas where rounding turns.

    For every bit position, the mantissas just below, on and just above a power of two, with
    the bit above it both clear and set (ties to an even and to an odd neighbour), plus
    random mantissas: every rounding boundary of bf16 and of fp16 (normal and subnormal) is hit.
    """
    special = []
    for k in range(23):
        for above in (0, 1 << min(k + 1, 22)):
            for base in ((1 << k) - 1, 1 << k, (1 << k) + 1):
                special.append((base | above) & 0x7FFFFF)
    special += [0, 0x7FFFFF, 0x400000, 0x3FFFFF]
    gen = torch.Generator().manual_seed(seed)
    random = torch.randint(0, 1 << 23, (512, random_per_exponent), generator=gen, dtype=torch.int64)
    mantissas = torch.cat([torch.tensor(special, dtype=torch.int64).expand(512, -1), random], dim=1)
    sign_exponent = torch.arange(512, dtype=torch.int64).unsqueeze(1) << 23  # [512, 1]
    return (sign_exponent | mantissas).reshape(-1)


def expected_bits(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bits of torch's src.to(dtype), flattened; NaNs as torch's contiguous cast gives them.

    Non-NaN values come from torch itself. NaNs follow the rule bits.nan_rule read from
    torch (test_bits checks that rule against torch), since torch's own NaN bits on CPU
    change with the layout and with the element's place in the vector loop.
    """
    flat = src.reshape(-1)
    got = to_bits(flat.to(dtype))
    if src.dtype == dtype:
        return got
    rule_bits = convert_bits(to_bits(flat), src.dtype, dtype, nan_rule(src.device, src.dtype, dtype))
    return torch.where(flat.isnan(), rule_bits, got)


def expected_pack(srcs, dtype: torch.dtype) -> torch.Tensor:
    parts = [expected_bits(s, dtype) for s in srcs]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def expected_accumulate(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    upcast = from_bits(expected_bits(src, torch.float32), torch.float32).view(dst.shape)
    return to_bits(dst.clone().add_(upcast)).reshape(-1)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "result") -> None:
    got = to_bits(actual).reshape(-1)
    assert got.shape == expected.shape, f"{what}: {got.numel()} elements, expected {expected.numel()}"
    bad = (got != expected).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {got.numel()} elements differ; first at {i}: "
            f"got {int(got[i]):#x}, expected {int(expected[i]):#x}"
        )


def guarded(numel: int, dtype: torch.dtype, guard: int = 37):
    """A buffer with a sentinel guard on each side, and dst: the slice between them."""
    width = FORMATS[dtype].width
    buffer = from_bits(torch.full((numel + 2 * guard,), 0x5A5A5A5A & ((1 << width) - 1)), dtype)
    return buffer, buffer[guard : guard + numel]


def assert_guards_untouched(buffer: torch.Tensor, guard: int = 37) -> None:
    width = FORMATS[buffer.dtype].width
    sentinel = 0x5A5A5A5A & ((1 << width) - 1)
    bits = to_bits(buffer)
    assert bool((bits[:guard] == sentinel).all()), "pack wrote before dst"
    assert bool((bits[-guard:] == sentinel).all()), "pack wrote after dst"
