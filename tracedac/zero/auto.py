"""``MixedPrecision(param_dtype="auto")`` in eager: each group travels in the dtype its
parameters are computed in, as the first forward shows it.

Under ``torch.autocast`` a Linear weight is cast to bf16 before its matmul and a LayerNorm
weight is read in fp32; no module list says so, the program does. ``shard`` groups an
``"auto"`` unit's parameters by the class of the module holding them (every Linear of the unit
together, every LayerNorm together...), all traveling fp32 at first. The first forward runs
under ``Observer``, a dispatch mode that follows each gathered parameter through views and
notes what reads it: a cast to bf16/fp16 (autocast's ``_to_copy``), or anything else (the
value itself, in fp32). At the next forward's start ``Auto.decide`` agrees with every rank
(one all-reduce of the notes: ranks that took different branches still decide alike, so
their gathers keep matching) and sets each group's travel dtype: the low dtype if every use
on every rank was a cast to it, fp32 otherwise (a parameter used both ways, or not used).
Nothing is observed after that.

A decision changes no value: a cast moved before the all-gather gives the bits the cast after
it gave. Gradients then arrive in the travel dtype (several uses of one parameter add up in
bf16, as with ``param_dtype=torch.bfloat16``) and are reduced in ``reduce_dtype``. A forward
already recorded keeps its dtype for its backward (``Gathered`` regathers in the dtype it
gathered). Compiled units are not observed: there the graph pass ``compile/passes/gather_cast.py``
makes the same decision per group from the compiled graph.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..agreements import host_group
from ..record.op_info import LOW_DTYPES, cast_dtype

__all__ = ["Auto", "Observer"]

_FULL = 0  # note columns: read as it is, cast to bf16, cast to fp16


class Observer(TorchDispatchMode):
    """Notes, for each tracked tensor's group, how ops read it (see the module docstring)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Compiled units called inside the observed forward (per-block compile) run compiled:
        # dynamo refuses to run under a mode that does not say so. Their gathers are graph
        # nodes, never tracked here (the gather-cast pass decides for them).
        return True

    # A compiled graph's higher-order ops reach the mode at run time (``run_and_save_rng_state``
    # for a replayed dropout): no gathered view of an eager unit goes into one; they run as they are.
    supports_higher_order_operators = True

    def __init__(self, auto: Auto):
        super().__init__()
        self.auto = auto
        # id(tensor) -> (a weak reference to it, the index of its group in auto.groups). Weak:
        # pinning the views would hold every unit's full parameters to the end of the forward.
        self.tracked: dict[int, tuple] = {}

    def track(self, tensor: torch.Tensor, index: int) -> None:
        self.tracked[id(tensor)] = (weakref.ref(tensor), index)

    def _group(self, a) -> int | None:
        entry = self.tracked.get(id(a))
        return entry[1] if entry is not None and entry[0]() is a else None  # not a reused id

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator):
            return out
        hit = [
            i
            for a in tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor) and (i := self._group(a)) is not None
        ]
        if hit:
            notes = self.auto.notes
            dtype = cast_dtype(func, args, kwargs)
            if func.is_view:  # a view reads nothing: follow it
                for o in tree_leaves(out):
                    if isinstance(o, torch.Tensor):
                        self.track(o, hit[0])
            elif dtype in LOW_DTYPES:
                for i in hit:
                    notes[i][1 + LOW_DTYPES.index(dtype)] = 1
            else:
                for i in hit:
                    notes[i][_FULL] = 1
        return out


class Auto:
    """The ``"auto"`` groups of one model, their notes, and the decision."""

    def __init__(self, groups: list, process_group):
        self.groups = list(groups)
        self.process_group = process_group
        self.notes = [[0, 0, 0] for _ in self.groups]
        self.pending = bool(self.groups)  # not decided yet
        self.observed = False  # a forward ran under the observer
        self.observer: Observer | None = None

    def adopt(self, other: Auto) -> None:
        """A nested shard's groups join this model's (one decision for the model)."""
        self.groups += other.groups
        self.notes += other.notes
        self.pending = self.pending or other.pending

    # -- the root unit's forward: begin, end --
    def begin(self) -> None:
        if not self.pending:
            return
        if self.observed:
            self.decide()
            return
        self.observer = Observer(self)
        self.observer.__enter__()

    def end(self) -> None:
        if self.observer is not None:
            observer, self.observer = self.observer, None
            observer.__exit__(None, None, None)
            self.observed = True

    def track(self, views: list, groups: list) -> None:
        """A unit gathered ``groups``, whose parameters' full views are ``views``."""
        if self.observer is None:
            return
        for g, per_group in zip(groups, views):
            if g in self.groups:
                i = self.groups.index(g)
                for v in per_group:
                    self.observer.track(v, i)
                    # A tensor-parallel parameter is read as a DTensor; where a mode above this
                    # one declines DTensor ops (a region's recorder), its local ops come here.
                    if isinstance(v, DTensor):
                        self.observer.track(v._local_tensor, i)

    def decide(self) -> None:
        notes = torch.tensor(self.notes, dtype=torch.int64)
        world = dist.get_world_size(self.process_group)
        if world > 1:
            group, device = host_group(self.process_group, self.groups[0].local.device)
            notes = notes.to(device)
            dist.all_reduce(notes, op=dist.ReduceOp.MAX, group=group)
            notes = notes.cpu()
        for g, (full, bf16, fp16) in zip(self.groups, notes.tolist()):
            low = [d for d, seen in zip(LOW_DTYPES, (bf16, fp16)) if seen]
            g.dtype = g.travel = low[0] if not full and len(low) == 1 else torch.float32
        self.pending = False
