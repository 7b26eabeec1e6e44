"""Bytes in use at the allocator, read from the allocator itself rather than from tracedac.

On CPU this is glibc's ``mallinfo2()``: ``uordblks`` (bytes in chunks handed out from the
heap arenas) plus ``hblkhd`` (bytes in chunks served by their own ``mmap``, which is where
large tensors live). Both count what was allocated and not freed, not what the process
maps, so a freed tensor leaves the figure at once even if glibc keeps the pages. On CUDA it
is ``torch.cuda.memory_allocated()``, the bytes of live blocks in torch's caching allocator.

What neither sees: CPython's small objects (512 bytes or less) live in arenas that CPython
maps itself, so Python bookkeeping such as a recorded graph's nodes is mostly invisible on
CPU; run under ``PYTHONMALLOC=malloc`` to route it through glibc and count it too. And what
it sees too much of: glibc parks up to seven freed chunks per size class of up to 1 KiB in a
per-thread cache, and ``mallinfo2`` counts those as in use; run with
``GLIBC_TUNABLES=glibc.malloc.tcache_count=0`` for an exact count (the benchmarks' memory
children do both).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys

import torch

__all__ = ["ProbeUnavailable", "StepPeak", "allocated_bytes", "describe", "keep_freed_memory"]


class ProbeUnavailable(RuntimeError):
    """The allocator of this platform cannot be asked how many bytes are in use."""


class _MallInfo2(ctypes.Structure):
    # Field order of glibc's struct mallinfo2 (malloc.h), all size_t.
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.lru_cache(maxsize=None)
def _mallinfo2():
    """glibc's ``mallinfo2`` as a ctypes function; raises ProbeUnavailable without it."""
    if not sys.platform.startswith("linux"):
        raise ProbeUnavailable(
            f"the CPU memory probe reads glibc's mallinfo2(), and this platform is {sys.platform!r}; "
            "run the benchmark on Linux with glibc, or on a CUDA device (device='cuda')."
        )
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        fn = libc.mallinfo2
    except (OSError, AttributeError) as e:
        raise ProbeUnavailable(
            f"the CPU memory probe needs glibc 2.33 or newer for mallinfo2(), and {name!r} does not "
            f"provide it ({e}); this happens with musl (Alpine) or an old glibc. Run the benchmark "
            "on a glibc-based Linux (Debian, Ubuntu, Fedora...) or on a CUDA device (device='cuda')."
        ) from e
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


# mallopt(3) parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS.

    By default every tensor over the mmap threshold gets fresh pages from the kernel and
    gives them back when freed, so each step pays page faults for all of its activations;
    on this kind of machine that cost varies by tens of percent from step to step and drowns
    the differences being measured. With mmap off and trimming off, glibc reuses freed
    blocks, as torch's CUDA caching allocator does (and as jemalloc or tcmalloc do on CPU).
    Applies to this process from now on; returns whether glibc accepted it (False elsewhere).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) and mallopt(_M_TOP_PAD, 256 << 20)
    return bool(ok)


def allocated_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes the allocator for ``device`` has handed out and not had back."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        info = _mallinfo2()()
        return info.uordblks + info.hblkhd
    raise ProbeUnavailable(
        f"no memory probe for device type {device.type!r}: the benchmark reads glibc's "
        "mallinfo2() on CPU and torch.cuda.memory_allocated() on CUDA. Run it on one of those."
    )


def describe(device: torch.device | str = "cpu") -> str:
    """How ``allocated_bytes`` measures on ``device``, for the benchmark's output."""
    if torch.device(device).type == "cuda":
        return "torch.cuda.memory_allocated()"
    return "glibc mallinfo2(): uordblks + hblkhd"


class StepPeak:
    """The most bytes of tensors a step held on ``device``, everything on the device included.

    On CUDA: ``torch.cuda.reset_peak_memory_stats`` at ``start`` and ``max_memory_allocated``
    at ``stop``. On the CPU, where glibc keeps no peak: the bytes of the tensor storages alive at
    ``start`` (every plain tensor the garbage collector knows, and leaves' gradients), plus the
    running maximum of torch's CPU allocator's allocation events until ``stop`` (the profiler
    with ``profile_memory=True``: every allocation and free of a tensor's memory, compiled code's
    included). A storage alive at ``start`` and freed during the step is not reported, so the
    CPU figure can only err upwards. Written apart from ``tracedac.policies.meter``, which the
    library plans with: this is the benchmark's own reading."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ProbeUnavailable(f"no step-peak probe for device type {self.device.type!r}: CPU or CUDA")
        self.base = 0
        self.profile = None

    def _alive(self) -> int:
        storages = {}
        for o in gc.get_objects():
            if type(o) is torch.Tensor or type(o) is torch.nn.Parameter:
                for t in (o, o.grad if o.is_leaf and o.requires_grad else None):
                    if (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.device == self.device:
                        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.base = self._alive()
        activities = [torch.profiler.ProfilerActivity.CPU]
        self.profile = torch.profiler.profile(activities=activities, profile_memory=True)
        self.profile.__enter__()

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        from torch._C._profiler import _EventType

        self.profile.__exit__(None, None, None)
        events, stack = [], list(self.profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation:
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
        level = most = 0
        for _, size in sorted(events):
            level += size
            most = max(most, level)
        self.profile = None
        return self.base + most

    def describe(self) -> str:
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_allocated() over the step"
        return "tensors alive before the step (gc) + the CPU allocator's profiled events over it"
