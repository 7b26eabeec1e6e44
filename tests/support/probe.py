"""Bytes in use at the CPU allocator, read from glibc rather than from tracedac: the tests'
own copy of the one reading they need from ``benchmarks/probe.py`` (whose docstring says
what the figure does and does not see), so that no test imports the benchmarks.

``allocated_bytes()``: glibc's ``mallinfo2()``, ``uordblks`` (bytes in chunks handed out from
the heap arenas) plus ``hblkhd`` (bytes in chunks served by their own ``mmap``, where large
tensors live): what was allocated and not freed. A test that needs it skips, saying why,
where glibc does not provide it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

__all__ = ["allocated_bytes"]


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
    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip(f"reads glibc's mallinfo2(); this platform is {sys.platform!r}")
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        fn = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError) as e:
        pytest.skip(f"reads glibc's mallinfo2() (glibc 2.33 or newer), which {name!r} lacks ({e})")
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


def allocated_bytes() -> int:
    """Bytes the CPU allocator has handed out and not had back."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd
