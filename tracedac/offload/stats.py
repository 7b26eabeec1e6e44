"""What the host copies of offloading cost a step, counted by tracedac itself
(``tracedac.offload.tracked``): bytes and copies each way, and on CUDA how long the compute
stream stood waiting for them. A copy the compute hides costs no wait; what is left is the part
of the copies it did not hide.

A wait is timed with two CUDA events on the compute stream, one before it is told to wait for a
copy and one after: the time between them on the device is the stall (a copy brought back
ahead that is not done yet, a copy that was not brought back ahead and runs on the compute
stream itself, a write that must wait for the copy of the value it overwrites). Events are made
only inside ``tracked``; outside it, nothing is counted and nothing is added to a copy's path.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["CopyStats", "tracked"]

_active: list = []  # the CopyStats counted into now (nested ``tracked`` blocks all count)


class CopyStats:
    """Host copies made and brought back inside one ``tracked`` block."""

    __slots__ = ("out_bytes", "out_copies", "back_bytes", "back_copies", "_waits")

    def __init__(self):
        self.out_bytes = self.out_copies = self.back_bytes = self.back_copies = 0
        self._waits: list = []  # (start, end) CUDA events around each wait of the compute stream

    @property
    def stalled_s(self) -> float:
        """Seconds the compute stream waited for copies (CUDA; 0 elsewhere). Reading it waits
        for the events to complete."""
        total = 0.0
        for start, end in self._waits:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total

    def __repr__(self) -> str:
        return (
            f"CopyStats(out: {self.out_copies} copies, {self.out_bytes} B; back: {self.back_copies} "
            f"copies, {self.back_bytes} B; compute stream stalled {self.stalled_s * 1e3:.3f} ms)"
        )


@contextlib.contextmanager
def tracked():
    """Count the host copies made (``out``) and brought back (``back``) inside the block, and on
    CUDA the time the compute stream waited for them (``stalled_s``): yields a ``CopyStats``."""
    stats = CopyStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


def copied(way: str, nbytes: int) -> None:
    """A copy of ``nbytes`` went to the host (``way`` "out") or is coming back ("back")."""
    for s in _active:
        if way == "out":
            s.out_bytes += nbytes
            s.out_copies += 1
        else:
            s.back_bytes += nbytes
            s.back_copies += 1


def waiting(stream):
    """A context around the compute stream ``stream`` waiting for a copy (a CUDA stream, or
    None): timed while a ``tracked`` block counts."""
    if not _active or stream is None:
        return contextlib.nullcontext()
    return _Wait(stream)


class _Wait:
    __slots__ = ("stream", "start")

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record(self.stream)

    def __exit__(self, *exc):
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        for s in _active:
            s._waits.append((self.start, end))
        return False
