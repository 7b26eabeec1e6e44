"""Gathered buffers and the handles autograd saves on them.

A unit's forward registers each buffer it gathered (``Gathered``, in ``group.LIVE`` until
``tracedac::release``); what autograd, or a checkpoint region, saves on one becomes a
``Handle``, which backward turns into a second gather.
"""

from __future__ import annotations

import torch

from ..ops import zero as _ops  # noqa: F401 (registers the tracedac:: ops this module names)
from ..record.decisions import recompute_by_default
from ..record.op_info import storage_address as _address
from ..region import REBUILDERS
from .group import LIVE, FlatGroup

__all__ = ["Gathered", "Handle", "handle_for"]

recompute_by_default(
    torch.ops.tracedac.all_gather.default,
    "keeping a gathered parameter pins the full unit after forward; ZeRO-3 gathers it again",
)


class Gathered:
    """One gather done by a unit's forward, and the handles autograd saved on its buffer.

    In backward the first handle unpacked gathers the group again; the buffer is cached
    until every live handle has been unpacked in this backward (or dropped), then let go:
    each unit is gathered once per backward and freed after its last use. A later backward
    of the same graph (``retain_graph=True``) starts a new round and does the same.
    """

    __slots__ = ("flat", "dtype", "full", "alive", "remaining", "round", "cached", "__weakref__")

    def __init__(self, flat: FlatGroup, full: torch.Tensor):
        self.flat = flat
        self.dtype = full.dtype  # backward gathers in it again, whatever the group travels in by then
        self.full = full  # until release
        self.alive = 0  # handles not yet garbage collected
        self.remaining = 0  # of those, how many this round has not unpacked yet
        self.round = 0
        self.cached = None  # the buffer gathered again in backward
        LIVE[_address(full)] = self

    def handle(self, t: torch.Tensor) -> Handle:
        self.alive += 1
        self.remaining += 1
        return Handle(self, t.size(), t.stride(), t.storage_offset())

    def regather(self) -> torch.Tensor:
        if self.cached is None:
            with torch.no_grad():
                self.cached = torch.ops.tracedac.all_gather(self.flat.leaf, self.flat.key, self.dtype)
        return self.cached

    def done(self, handle: Handle, dropped: bool) -> None:
        """``handle`` was unpacked or garbage collected: after the round's last, free the buffer."""
        if dropped:
            self.alive -= 1
        if handle.round != self.round:
            return  # already unpacked in this round
        handle.round += 1  # wanted again in the next round
        self.remaining -= 1
        if self.remaining <= 0:
            self.cached = None
            self.round += 1
            self.remaining = self.alive


class Handle:
    """What autograd (or a checkpoint region) holds for a tensor on a gathered buffer."""

    __slots__ = ("entry", "size", "stride", "offset", "round")

    def __init__(self, entry: Gathered, size, stride, offset):
        self.entry = entry
        self.size, self.stride, self.offset = size, stride, offset
        self.round = entry.round  # the first round (backward) it has not been unpacked in

    def unpack(self) -> torch.Tensor:
        entry = self.entry
        if entry.full is not None:  # the forward is still running: nothing was released
            return entry.full.as_strided(self.size, self.stride, self.offset)
        view = entry.regather().as_strided(self.size, self.stride, self.offset)
        entry.done(self, dropped=False)
        return view

    def __del__(self):
        self.entry.done(self, dropped=True)


def handle_for(t: torch.Tensor) -> Handle | None:
    """A handle if ``t`` lives on a buffer gathered by a forward still running, else None."""
    entry = LIVE.get(_address(t))
    if entry is None or t.dtype != entry.dtype:
        return None
    return entry.handle(t)


class _GatheredOwner:
    """Lets a checkpoint region that reads a gathered parameter from outside hold a Handle."""

    def owns(self, t: torch.Tensor) -> bool:
        entry = LIVE.get(_address(t))
        return entry is not None and t.dtype == entry.dtype

    def handle(self, t: torch.Tensor) -> Handle | None:
        return handle_for(t)


REBUILDERS.append(_GatheredOwner())
