"""The compiled Triton kernel on a CUDA device: same bits as torch's CUDA casts, one launch."""

import pytest
import torch

from tracedac.kernels.bits import from_bits, to_bits
from tracedac.ops import accumulate_, pack_cast

from .castcheck import (
    ADVERSARIAL_F32,
    FLOATS,
    LOW,
    assert_same_bits,
    boundary_sample,
    expected_accumulate,
    expected_pack,
    f32,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def guarded_on_cuda(numel, dtype, guard=64):
    buffer = torch.full((numel + 2 * guard,), 7.0, dtype=dtype, device=CUDA)
    return buffer, buffer[guard : guard + numel]


def pack_and_check(srcs, dtype, guard=64):
    """Pack into a slot between two guard regions; check the bits and the guards."""
    total = sum(s.numel() for s in srcs)
    buffer, dst = guarded_on_cuda(total, dtype, guard)
    pack_cast(srcs, dst, backend="triton")
    assert_same_bits(dst, expected_pack(srcs, dtype).to(CUDA))
    assert bool((buffer[:guard] == 7).all()) and bool((buffer[-guard:] == 7).all())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_adversarial_and_boundary_values_match_torch_cuda_casts(dtype):
    """The NaN rule is probed on the device, so CUDA's canonical NaNs must come out too."""
    srcs = [f32(ADVERSARIAL_F32).to(CUDA), from_bits(boundary_sample(), torch.float32).to(CUDA)]
    pack_and_check(srcs, dtype)


@pytest.mark.parametrize("guard", [64, 63], ids=["aligned", "misaligned"])
def test_aligned_and_misaligned_slots_both_cast_exactly(guard):
    """A 16-byte aligned slot takes the vectorised variant, a misaligned one the scalar one."""
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=gen).to(CUDA) for n in (4096, 1024, 8, 65536 + 8)]
    pack_and_check(srcs, torch.bfloat16, guard)


def test_strided_mixed_and_many_sources_match_torch_cuda_casts():
    """Strided reads (div/mod on the GPU), all three source dtypes and 300 sources in one launch."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 7, 8, generator=gen).to(CUDA)
    srcs = [
        base.transpose(0, 2),
        base[:, ::2, 1:7:3],
        torch.randn(3, 4, 5, 2, 3).to(CUDA).permute(4, 2, 0, 3, 1),
    ]
    srcs += [
        torch.randn(int(n) + 1, generator=gen).to(CUDA).to(dt) for n, dt in zip(range(300), FLOATS * 100)
    ]
    for dtype in FLOATS:
        pack_and_check(srcs, dtype)


def test_a_unit_of_many_tensors_is_packed_by_one_kernel():
    """The point of the kernel: one launch whatever the number of tensors."""
    from torch.profiler import ProfilerActivity, profile

    srcs = [torch.randn(257, device=CUDA) for _ in range(200)]
    dst = torch.empty(257 * 200, dtype=torch.bfloat16, device=CUDA)
    pack_cast(srcs, dst, backend="triton")  # compile, and upload the table
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pack_cast(srcs, dst, backend="triton")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["pack_cast_kernel"], kernels


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
def test_accumulate_matches_torch_cuda_add(src_dtype):
    """Every adversarial pair, upcast then added in fp32: the kernel's add must round (and
    treat subnormals and NaNs) exactly as torch's CUDA add does."""
    values = f32(ADVERSARIAL_F32)
    dst = values.repeat_interleave(len(ADVERSARIAL_F32)).to(CUDA)
    src = values.repeat(len(ADVERSARIAL_F32)).to(src_dtype).to(CUDA)
    want = expected_accumulate(dst, src)
    accumulate_(dst, src, backend="triton")
    assert_same_bits(dst, want)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_auto_picks_triton_on_cuda_and_agrees_with_torch_backend(dtype):
    """'auto' on CUDA is the Triton kernel; on ordinary values it must equal the torch backend."""
    gen = torch.Generator().manual_seed(2)
    srcs = [torch.randn(1000, 3, generator=gen).to(CUDA).t(), torch.randn(4099, generator=gen).to(CUDA)]
    a = torch.empty(7099, dtype=dtype, device=CUDA)
    b = torch.empty_like(a)
    pack_cast(srcs, a)
    pack_cast(srcs, b, backend="torch")
    assert torch.equal(to_bits(a), to_bits(b))


def test_a_repeated_launch_skips_tritons_runner_and_honours_a_launch_hook():
    """After the first call, a prepared launch calls the compiled kernel's launcher itself
    (``launch._bare_launcher``): the same bits on new values, on another stream, and a launch
    hook registered meanwhile (a profiler's) sends the call through Triton's runner again."""
    from triton import knobs

    from tracedac.ops import cast as cast_module

    cast_module._pack_calls.clear()
    gen = torch.Generator().manual_seed(3)
    srcs = [torch.randn(n, generator=gen).to(CUDA) for n in (4096, 1000, 8 * 999)]
    dst = torch.empty(sum(s.numel() for s in srcs), dtype=torch.bfloat16, device=CUDA)
    pack_cast(srcs, dst, backend="triton")
    entry = next(iter(cast_module._pack_calls._entries.values()))
    assert entry.launch.bare  # Triton 3.6 and 3.9 both have the launcher (False: none)
    for s in srcs:
        s.mul_(-2)
    dst.fill_(0)
    pack_cast(srcs, dst, backend="triton")
    assert_same_bits(dst, expected_pack(srcs, torch.bfloat16).to(CUDA))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in srcs:
            s.add_(1)
        pack_cast(srcs, dst, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    assert_same_bits(dst, expected_pack(srcs, torch.bfloat16).to(CUDA))
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731 (a LazyDict)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        pack_cast(srcs, dst, backend="triton")
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["pack_cast_kernel"]
