"""``Prefetch``: the order of gathers in a model's last forward and backward, to start the
next all-gather while this one's unit computes. One per model, shared by its flat groups
(``FlatGroup.state``); it only orders them, ``group.py`` runs the collectives.
"""

from __future__ import annotations

import torch

from .group import FlatGroup, _in_backward

__all__ = ["Prefetch"]


class Prefetch:
    """Per model: the order of gathers in the last forward and backward, to prefetch by.

    The i-th gather of a forward (or backward) starts the (i+1)-th gather of the previous
    one, if the i-th was the same group then. A group may appear several times (a shared
    parameter's group is gathered by each unit using it): positions, not links between
    groups, so the last gather of a pass never starts one nobody will consume. A gather
    started but not consumed in its pass (the order changed) is waited for and dropped when
    the pass ends (``drain``: the root unit's forward post-hook; an autograd engine callback
    at the end of a backward), or at the latest when the next pass begins: no prefetched
    buffer outlives the pass, so none can predate an optimizer step, a load, or the process
    group's destruction.
    """

    __slots__ = ("enabled", "backward", "current", "learned", "inflight", "queued", "auto")

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.backward = None  # whether the pass being recorded is a backward; None: none yet
        self.current: list = []
        self.learned: dict = {}  # backward: bool -> the order of that kind of pass, last time
        self.inflight: list = []  # groups with a prefetched gather started in this pass
        self.queued = False  # a drain is queued for the end of the running backward
        self.auto = None  # the model's zero.auto.Auto, under MixedPrecision(param_dtype="auto")

    def _pass(self, backward: bool) -> None:
        """A gather of a forward (``backward`` False) or backward: a new pass if the kind changed."""
        if backward != self.backward:
            self.begin(backward)

    def begin(self, backward: bool) -> None:
        if self.backward is not None:
            self.learned[self.backward] = self.current
        self.backward, self.current = backward, []
        self.drain()

    def drain(self) -> None:
        """Wait for and drop every prefetched gather nobody consumed: at the end of a forward
        (the root's post-hook) and of a backward (an engine callback), so none stays in flight
        past its pass (into an optimizer step, a load, or ``destroy_process_group``)."""
        self.queued = False
        inflight, self.inflight = self.inflight, []
        for group in inflight:
            pending, group.pending = group.pending, None
            if pending is not None:
                group.wait(pending.work, "all-gather (prefetched, not used)")

    def together(self, group: FlatGroup, backward: bool, at: int | None = None) -> tuple:
        """The groups of ``group``'s unit that the last pass of this kind gathered right after
        it, from position ``at`` (default: the gather about to be recorded), and not started
        yet: their all-gathers start with ``group``'s, after one order check for all (a unit
        of "auto" groups, say a LayerNorm, a Linear and an MoE group, checks once, not three
        times). The same on every rank: the order is."""
        if not self.enabled:
            return ()
        if at is None:
            self._pass(backward)  # (what ``after`` does; here before anything starts)
            at = len(self.current)
        order = self.learned.get(backward, ())
        if at >= len(order) or order[at] is not group:
            return ()
        run: list = []
        for g in order[at + 1 :]:
            if g.owner is not group.owner or g is group or g in run:
                break
            if g.pending is None:
                run.append(g)
        return tuple(run)

    def started(self, group: FlatGroup) -> None:
        """``group``'s all-gather is in flight: drained with its pass if no gather takes it (in
        backward, an engine callback at its end)."""
        self.inflight.append(group)
        if _in_backward() and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)

    def after(self, group: FlatGroup, backward: bool) -> FlatGroup | None:
        """Record a gather of ``group``; return the group to prefetch next, if any."""
        self._pass(backward)
        i = len(self.current)
        self.current.append(group)
        order = self.learned.get(backward, ())
        if self.enabled and i + 1 < len(order) and order[i] is group:
            return order[i + 1]
        return None
