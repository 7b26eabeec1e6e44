"""``Prefetch``: the order of gathers in a model's last forward and backward, to start the
next all-gather while this one's unit computes. One per model, shared by its flat groups
(``FlatGroup.state``); it only orders them, ``group.py`` runs the collectives.
"""

from __future__ import annotations

import torch

from .group import FlatGroup, _graph_task, _in_backward

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

    __slots__ = (
        "enabled",
        "backward",
        "current",
        "learned",
        "inflight",
        "queued",
        "auto",
        "reduced",
        "learned_reduced",
        "waiting",
        "task",
    )

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.backward = None  # whether the pass being recorded is a backward; None: none yet
        self.current: list = []
        self.learned: dict = {}  # backward: bool -> the order of that kind of pass, last time
        self.inflight: list = []  # groups with a prefetched gather started in this pass
        self.queued = False  # a drain is queued for the end of the running backward
        self.auto = None  # the model's zero.auto.Auto, under MixedPrecision(param_dtype="auto")
        self.reduced: list | None = None  # the groups reduced so far in the running backward
        self.learned_reduced: list = []  # and in the last backward
        self.waiting: list = []  # (group, gradient): reductions held for the rest of their unit
        self.task = -1  # the backward ``reduced`` belongs to

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

    def reduce(self, group: FlatGroup, grad: torch.Tensor) -> None:
        """Reduce-scatter ``group``'s gradient into its ``.grad``: now, or, where the last
        backward reduced the rest of its unit's groups right after it, with them in one
        collective once the last of them arrives (``together``'s counterpart: an "auto" block's
        three groups reduce once, not three times). The order is the same on every rank, and
        the joint collective's order check names every group in it. Whatever waits when the
        order changes goes at once; at the end of the backward (an engine callback) nothing
        waits any more. A gradient with a graph of its own (``create_graph=True``) goes alone,
        through ``tracedac::reduce_scatter``, whose adjoint differentiates it."""
        if not self.enabled or group.world == 1 or grad.requires_grad or not _in_backward():
            _reduce_alone(group, grad)
            return
        if self.reduced is None or self.task != _graph_task():  # this backward's first reduction
            # Another backward's record: a backward nested in it (a reentrant checkpoint's), or
            # one that raised before its end callback ran. What waits is reduced now, as it
            # would have been without waiting; only the next joint collective is lost.
            self._flush()
            self.reduced, self.task = [], _graph_task()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_reductions)
        i, order = len(self.reduced), self.learned_reduced
        self.reduced.append(group)
        expected = i < len(order) and order[i] is group
        if self.waiting and not expected:
            self._flush()  # the order changed: what waited goes now, without this one
        self.waiting.append((group, grad))
        nxt = order[i + 1] if expected and i + 1 < len(order) else None
        if (
            nxt is None
            or nxt.owner is not group.owner
            or nxt.reduce_dtype != group.reduce_dtype
            or any(nxt is g for g, _ in self.waiting)
        ):
            self._flush()

    def _flush(self) -> None:
        waiting, self.waiting = self.waiting, []
        if len(waiting) == 1:
            _reduce_alone(*waiting[0])
        elif waiting:
            (first, grad), rest = waiting[0], [(g, g.take_held(x)) for g, x in waiting[1:]]
            for (g, _), part in zip(waiting, first.reduce_scatter_with(first.take_held(grad), rest)):
                g.add_grad(part)

    def _end_reductions(self) -> None:
        self._flush()
        self.learned_reduced, self.reduced = self.reduced or [], None

    def after(self, group: FlatGroup, backward: bool) -> FlatGroup | None:
        """Record a gather of ``group``; return the group to prefetch next, if any."""
        self._pass(backward)
        i = len(self.current)
        self.current.append(group)
        order = self.learned.get(backward, ())
        if self.enabled and i + 1 < len(order) and order[i] is group:
            return order[i + 1]
        return None


def _reduce_alone(group: FlatGroup, grad: torch.Tensor) -> None:
    part = group.take_held(grad)  # the held sum (a buffer of ours) if gradient sync was off
    if group.world == 1 and not part.requires_grad and _upcast_exact(part.dtype, group.reduce_dtype):
        # One rank sums nothing: the gradient goes into .grad as it is, upcast in the same pass
        # (bit for bit what the reduce dtype's copy, a one-rank reduce-scatter, a division by
        # one and the add gave: three passes over the unit and a collective call). A reduce
        # dtype that rounds the gradient still rounds it, through the op.
        group.add_grad(part, owned=part is not grad)
        return
    group.add_grad(torch.ops.tracedac.reduce_scatter(part, group.key))


def _upcast_exact(dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
    """Whether casting ``dtype`` to ``reduce_dtype`` changes no value."""
    low = (torch.bfloat16, torch.float16)
    return dtype == reduce_dtype or (reduce_dtype == torch.float32 and dtype in low)
