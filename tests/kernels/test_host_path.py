"""The per-call host path: a call with a key seen before skips the checks and reuses its launch.

The key is every tensor's data pointer, dtype, shape, strides and device, dst's included;
the checks and the plan depend on nothing else. So a repeated call (every training step)
must give the same bits without running the checks again, and any change to that metadata
(a source moved onto dst, another dtype at the same address, another dst slice) must be
checked again and refused with the error a first call gets.
"""

import types

import pytest
import torch

from tracedac.kernels import launch as launch_module
from tracedac.kernels.bits import to_bits
from tracedac.ops import accumulate_, pack_cast
from tracedac.ops import cast as cast_module

from ..util import OpCounter
from .castcheck import assert_same_bits, expected_accumulate, expected_pack


@pytest.fixture
def counted(monkeypatch):
    """Empty key caches, and counts of the checks and of launch preparations made from now."""
    cast_module._pack_calls.clear()
    cast_module._accumulate_calls.clear()
    counts = dict.fromkeys(["check_pack_cast", "check_accumulate", "check_no_overlap", "prepare"], 0)
    for name in counts:
        original = getattr(cast_module, name)

        def wrapper(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(cast_module, name, wrapper)
    yield counts
    cast_module._pack_calls.clear()
    cast_module._accumulate_calls.clear()


def block(gen):
    """A small unit: a matrix, a transposed one, a bias, and bf16 and fp16 sources."""
    return [
        torch.randn(24, 16, generator=gen),
        torch.randn(16, 24, generator=gen).t(),
        torch.randn(24, generator=gen),
        torch.randn(40, generator=gen).to(torch.bfloat16),
        torch.randn(8, 3, generator=gen).to(torch.float16),
    ]


def test_a_repeated_call_skips_the_checks_and_gives_the_same_bits(backend, counted, gen):
    srcs = block(gen)
    dst = torch.empty(sum(s.numel() for s in srcs), dtype=torch.bfloat16)
    pack_cast(srcs, dst, backend=backend)
    first = to_bits(dst).clone()
    assert counted["check_pack_cast"] == counted["check_no_overlap"] == 1
    dst.fill_(0)
    # New tensor objects for the same memory and layout (as ``shard.detach()`` each step):
    # the key is the metadata, not the objects.
    again = [s.detach() for s in srcs]
    assert pack_cast(again, dst.detach(), backend=backend) is not None
    assert counted["check_pack_cast"] == counted["check_no_overlap"] == 1
    assert torch.equal(to_bits(dst), first)
    assert_same_bits(dst, expected_pack(srcs, torch.bfloat16))
    assert counted["prepare"] == (1 if backend == "triton" else 0)


def test_a_hit_reads_the_sources_current_values(backend, counted, gen):
    """The cache keeps what the metadata determines, never values."""
    srcs = block(gen)
    dst = torch.empty(sum(s.numel() for s in srcs), dtype=torch.float16)
    pack_cast(srcs, dst, backend=backend)
    for s in srcs:
        s.mul_(-3)
    pack_cast(srcs, dst, backend=backend)
    assert counted["check_pack_cast"] == 1
    assert_same_bits(dst, expected_pack(srcs, torch.float16))


def test_the_second_triton_call_launches_the_prepared_kernel_once(interpreter, counted, gen):
    srcs = block(gen)
    dst = torch.empty(sum(s.numel() for s in srcs), dtype=torch.bfloat16)
    pack_cast(srcs, dst, backend="triton")
    before = launch_module.launches
    pack_cast(srcs, dst, backend="triton")
    assert launch_module.launches == before + 1
    assert counted["prepare"] == 1


def test_a_hit_after_a_torch_call_still_prepares_the_triton_launch(interpreter, counted, gen):
    """One key serves both backends: the checks once, the launch when Triton first runs."""
    srcs = block(gen)
    dst = torch.empty(sum(s.numel() for s in srcs), dtype=torch.bfloat16)
    pack_cast(srcs, dst, backend="torch")
    dst.fill_(0)
    pack_cast(srcs, dst, backend="triton")
    assert counted["check_pack_cast"] == 1 and counted["prepare"] == 1
    assert_same_bits(dst, expected_pack(srcs, torch.bfloat16))


def test_same_address_other_layout_or_dtype_is_planned_and_checked_again(backend, counted, gen):
    """A source at the address of a cached one but with other strides, shape or dtype."""
    storage = torch.randn(64, generator=gen)
    square = storage.view(8, 8)
    dst = torch.empty(64, dtype=torch.bfloat16)
    pack_cast([square], dst, backend=backend)
    pack_cast([square.t()], dst, backend=backend)  # same address and shape, other strides
    assert_same_bits(dst, expected_pack([square.t()], torch.bfloat16))
    assert counted["check_pack_cast"] == 2
    as_half = storage.view(torch.float16)[:64]  # same address, other dtype
    pack_cast([as_half], dst, backend=backend)
    assert_same_bits(dst, expected_pack([as_half], torch.bfloat16))
    with pytest.raises(ValueError, match=r"hold 32 elements in all but dst has 64"):
        pack_cast([storage[:32]], dst, backend=backend)  # same address, other shape
    with pytest.raises(TypeError, match=r"srcs\[0\] is torch.float64"):
        pack_cast([storage.view(torch.float64)], dst[:32], backend=backend)
    with pytest.raises(ValueError, match=r"srcs\[0\] is on meta but dst is on cpu"):
        pack_cast([torch.empty(8, 8, device="meta")], dst, backend=backend)


def test_a_source_moved_onto_dst_after_a_cached_call_is_refused(backend, counted):
    buffer = torch.zeros(32)
    pack_cast([buffer[0:8]], buffer[16:24], backend=backend)
    pack_cast([buffer[0:8]], buffer[16:24], backend=backend)
    assert counted["check_no_overlap"] == 1
    with pytest.raises(ValueError, match=r"source 0 overlaps dst.*clone\(\)"):
        pack_cast([buffer[12:20]], buffer[16:24], backend=backend)  # same metadata, other address
    with pytest.raises(ValueError, match=r"source 0 overlaps dst"):
        pack_cast([buffer[0:8]], buffer[4:12], backend=backend)  # same source, another dst slice
    with pytest.raises(ValueError, match=r"stride 2"):
        pack_cast([buffer[0:8]], buffer[16:32:2], backend=backend)


def test_a_key_the_op_saw_is_still_argument_checked(counted):
    """Called directly, the op checks only the memory overlap; a later pack_cast with the same
    tensors must still run the argument checks and refuse them."""
    src = torch.ones(6)
    dst = torch.empty(6, dtype=torch.float64)
    torch.ops.tracedac.pack_cast([src], dst, "torch")
    assert counted["check_no_overlap"] == 1
    with pytest.raises(TypeError, match=r"dst is torch.float64"):
        pack_cast([src], dst, backend="torch")
    assert counted["check_no_overlap"] == 1  # the overlap check is not repeated


def test_modes_and_grad_are_looked_at_on_every_call(backend, counted, monkeypatch):
    """A cached key decides the checks, not whether the call goes through the op."""

    through_op = []
    impl = cast_module._pack_cast_impl
    monkeypatch.setattr(cast_module, "_pack_cast_impl", lambda *args: through_op.append(1) or impl(*args))
    src = torch.ones(4)
    dst = torch.zeros(4, requires_grad=True)
    pack_cast([src], dst.detach(), backend=backend)
    pack_cast([src], dst.detach(), backend=backend)  # a hit: run directly
    assert through_op == [] and counted["check_pack_cast"] == 1
    with OpCounter() as ops:
        pack_cast([src], dst.detach(), backend=backend)
    assert ops.counts[torch.ops.tracedac.pack_cast] == 1
    pack_cast([src], dst, backend=backend)  # same key, but dst requires grad: the op
    assert len(through_op) == 2
    with torch.no_grad():
        pack_cast([src], dst, backend=backend)
    assert len(through_op) == 2
    assert counted["check_pack_cast"] == 3  # the op path checks every call, as before


def test_the_key_caches_stay_bounded(counted, gen):
    size = cast_module._CACHE_SIZE
    dst = torch.empty(4, dtype=torch.bfloat16)
    grad = torch.zeros(4)
    srcs = [torch.randn(4, generator=gen) for _ in range(size + 10)]  # alive: distinct addresses
    halves = [src.to(torch.bfloat16) for src in srcs]
    for src, half in zip(srcs, halves):
        pack_cast([src], dst, backend="torch")
        accumulate_(grad, half, backend="torch")
    assert len(cast_module._pack_calls) == size
    assert len(cast_module._accumulate_calls) == size
    checks = counted["check_pack_cast"]
    pack_cast([srcs[-1]], dst, backend="torch")  # recent: kept
    assert counted["check_pack_cast"] == checks
    pack_cast([srcs[0]], dst, backend="torch")  # the oldest: evicted, checked again
    assert counted["check_pack_cast"] == checks + 1


def test_a_plan_holding_copies_is_not_kept(interpreter, counted, gen):
    """A source of more than four unmergeable dims is copied for the launch; that launch
    must not be reused (its copy would hold stale values), only the checks' verdict."""
    src = torch.randn(3, 4, 5, 2, 3, generator=gen).permute(4, 2, 0, 3, 1)
    dst = torch.empty(src.numel(), dtype=torch.bfloat16)
    pack_cast([src], dst, backend="triton")
    src.mul_(2)
    pack_cast([src], dst, backend="triton")
    assert_same_bits(dst, expected_pack([src], torch.bfloat16))
    assert counted["check_pack_cast"] == 1 and counted["prepare"] == 2
    (call,) = cast_module._pack_calls._entries.values()
    assert call.launch is None


def test_accumulate_repeats_skip_the_checks_and_changes_are_refused(backend, counted, gen):
    dst = torch.randn(6, 10, generator=gen)
    src = torch.randn(10, 6, generator=gen).to(torch.bfloat16).t()
    for _ in range(2):
        want = expected_accumulate(dst, src)
        accumulate_(dst, src, backend=backend)
        assert_same_bits(dst, want, "accumulate_")
    assert counted["check_accumulate"] == counted["check_no_overlap"] == 1
    assert counted["prepare"] == (1 if backend == "triton" else 0)
    with pytest.raises(ValueError, match=r"src has shape \(6, 10\) but dst has \(10, 6\)"):
        accumulate_(dst.view(10, 6), src.contiguous(), backend=backend)  # same address, other shape
    with pytest.raises(ValueError, match=r"contiguous dst, but dst has strides"):
        accumulate_(dst.t(), src.t(), backend=backend)  # same address and numel, other strides
    with pytest.raises(TypeError, match=r"src is torch.int16"):
        accumulate_(dst, src.view(torch.int16), backend=backend)  # same address, other dtype
    buffer = torch.zeros(20)
    accumulate_(buffer[:8], buffer[8:16], backend=backend)
    with pytest.raises(ValueError, match=r"source 0 overlaps dst"):
        accumulate_(buffer[:8], buffer[4:12], backend=backend)


class _Compiled:
    """A stand-in for Triton's compiled kernel: records what its launcher is called with."""

    function, packed_metadata = "function", ("warps", "ctas", "shared")

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Driver:
    current = 0

    def get_current_device(self):
        return self.current

    def get_current_stream(self, device):
        return 1000 + device


def test_a_prepared_launch_calls_the_compiled_kernels_launcher_unless_hooked(monkeypatch):
    """``_bare_launcher`` (CUDA only: checked here with stand-ins for the compiled kernel and
    Triton's driver; tests/kernels/test_gpu.py runs the real one) passes every parameter in
    the kernel's order, pointers as integers, on the device's current stream; another current
    device or a registered launch hook (a profiler's) leaves the launch to Triton's runner."""
    pytest.importorskip("triton")
    from triton import knobs
    from triton.runtime import driver

    from tracedac.kernels.triton_kernels import pack_cast_kernel

    fake = _Driver()
    monkeypatch.setattr(driver, "_active", fake)
    compiled = _Compiled()
    meta = dict(DST_KIND=1, ACCUMULATE=False, ALIGNED=True, DST_ALIGN=8, BLOCK=4096, num_warps=8)
    launch = launch_module._bare_launcher(compiled, pack_cast_kernel, 7, (11, 22, 33), meta)
    assert launch(0) is True
    assert compiled.calls == [
        (7, 1, 1, 1000, "function", compiled.packed_metadata, None, None, None)
        + (11, 22, 33, 1, False, True, 8, 4096)
    ]
    fake.current = 1
    assert launch(0) is False and len(compiled.calls) == 1
    fake.current = 0
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch(0) is False and len(compiled.calls) == 1
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert launch(0) is True and len(compiled.calls) == 2
    # a Triton whose compiled kernel has no such launcher: none is made, Triton's runner launches
    older = types.SimpleNamespace(run=compiled.run, packed_metadata=compiled.packed_metadata)
    assert launch_module._bare_launcher(older, pack_cast_kernel, 7, (11, 22, 33), meta) is None
