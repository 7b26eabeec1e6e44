"""All-gathers in flight: a group's own (``Pending``), or its share (``Part``) of one all-gather
for several groups of a unit (``Joint``). ``FlatGroup`` (``group.py``) issues them and waits.
"""

from __future__ import annotations

import torch

from ..ops import pack_cast

__all__ = ["Joint", "Part", "Pending"]


class Pending:
    """An all-gather in flight: its work handle, its output, and its input (alive until done)."""

    __slots__ = ("work", "_out", "src", "dtype")

    def __init__(self, work, out, src):
        self.work, self._out, self.src, self.dtype = work, out, src, out.dtype

    @property
    def out(self) -> torch.Tensor:
        return self._out

    def wrote(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this gather's output (what ``all_gather_start`` handed out)."""
        return self._out is not None and self._out.data_ptr() == t.data_ptr()


class Part(Pending):
    """One group's share of a ``Joint``: its output is allocated when first read, so that a
    joint gather in flight holds its one byte buffer, not that and each group's output too."""

    __slots__ = ("index",)

    def __init__(self, joint, index: int, dtype: torch.dtype):
        self.work, self.src, self.index, self.dtype = joint, None, index, dtype

    @property
    def out(self) -> torch.Tensor:
        return self.work.output(self.index)

    @property
    def _out(self) -> torch.Tensor | None:  # what ``wrote`` compares: None until allocated
        return self.work.outs[self.index]


class Joint:
    """One all-gather for several groups of a unit (``FlatGroup.start`` with ``together``):
    each group's input, cast to its travel dtype, lies in one byte buffer (the widest dtypes
    first, so that every piece is aligned to its element size), gathered once. The first wait,
    by whichever group, copies each group's rank-major piece into that group's own output,
    and lets the byte buffers go; the others find it done. It is the work handle of each
    group's ``Part``."""

    __slots__ = ("work", "out", "src", "world", "spans", "outs", "sizes")

    def __init__(self, world: int, run: list):
        """``run``: ``(FlatGroup, shard, dtype)`` for each group, in the order checked."""
        device = run[0][1].device
        placed = sorted(range(len(run)), key=lambda i: -run[i][2].itemsize)  # stable: ties keep order
        at, self.spans = 0, [None] * len(run)
        for i in placed:
            g, _, dtype = run[i]
            self.spans[i] = (at, at + g.shard_numel * dtype.itemsize)
            at = self.spans[i][1]
        self.src = torch.empty(at, dtype=torch.uint8, device=device)
        for (g, shard, dtype), (lo, hi) in zip(run, self.spans):
            pack_cast([shard.detach()], self.src[lo:hi].view(dtype))
        self.world = world
        self.out = torch.empty(self.world * at, dtype=torch.uint8, device=device)
        self.outs = [None] * len(run)
        self.sizes = [(self.world * g.shard_numel, dtype, device) for g, _, dtype in run]
        self.work = None  # the all-gather of ``src`` into ``out``, once the caller issued it

    def parts(self) -> list[Part]:
        return [Part(self, i, dtype) for i, (_, dtype, _) in enumerate(self.sizes)]

    def output(self, i: int) -> torch.Tensor:
        if self.outs[i] is None:
            numel, dtype, device = self.sizes[i]
            self.outs[i] = torch.empty(numel, dtype=dtype, device=device)
        return self.outs[i]

    def wait(self, timeout=None):
        if self.out is None:
            return True  # another group's wait copied every piece out
        done = self.work.wait(timeout) if timeout is not None else self.work.wait()
        if done is False:
            return False
        rows = self.out.view(self.world, -1)
        for i, (lo, hi) in enumerate(self.spans):
            out = self.output(i)
            out.view(self.world, -1).copy_(rows[:, lo:hi].view(out.dtype))
        self.out = self.src = None
        return True
