"""Units: the parameters one module gathers at once, and the hooks that gather and release them.

A *unit* is a module whose parameters are gathered together (by default each child of a
``ModuleList``; everything else forms the root unit). Its parameters stay registered where
they were, as DTensors viewing one flat fp32 buffer per group (``layout``). Its pre-hook
all-gathers its groups (``tracedac::all_gather``) and shadows each parameter attribute
with a view of the gathered buffer (an instance ``__dict__`` entry wins over
``_parameters``); its post-hook removes the shadows, so the attribute reads the DTensor
again, and calls ``tracedac::release``: after the forward no full parameter is referenced.
A tensor-parallel parameter's shadow is its gathered TP piece as a DTensor (``tp.wrap``).

What autograd saves on a gathered buffer (``mm`` keeps its weight) becomes a ``Handle``:
outside checkpoint regions through this module's ``saved_tensors_hooks`` (a saved DTensor
flattened, its local tensor the handle), inside them through the region's own (the gather is
a recorded node there, replayed in backward).
"""

from __future__ import annotations

import torch
from torch import nn

from .._compat import class_forward, is_wrapper_subclass, put_back_parameter
from ..compile.registry import install_traced
from ..errors import ZeroError
from ..record.subclasses import Constant, Flattened, is_subclass
from ..region import current_region, tracing
from .gathered import Gathered, Handle, handle_for
from .group import FlatGroup
from .layout import split_views
from .prefetch import Prefetch
from .tp import as_read

__all__ = ["Unit"]


class _Slot:
    """One module attribute that reads a sharded parameter: where, and which piece of which group."""

    __slots__ = ("module", "attr", "group", "piece")

    def __init__(self, module, attr, group, piece):
        self.module, self.attr = module, attr
        self.group = group  # index into the unit's gathered groups
        self.piece = piece  # index of the parameter in that group


_TRACED = "traced"  # in place of a unit's saved-tensor hooks: the forward ran under a compiler


class Unit:
    """The parameters one module gathers at once, and its forward pre/post hooks."""

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.module = module
        self.own: list[FlatGroup] = []  # groups this unit owns (its shards)
        self.groups: list[FlatGroup] = []  # groups it gathers: its own, then borrowed (shared params)
        self.slots: list[_Slot] = []
        self.active: list = []  # (gathered, hooks) per forward call running
        self.state: Prefetch | None = None  # the root unit's only: its forward starts a new order of gathers

    def pre(self, module, args):
        if tracing(args):
            return  # the unit's instance forward gathers (_UnitForward)
        if self.state is not None:
            self.state.begin(backward=False)  # a new forward: its gathers count from 0 again
            if self.state.auto is not None and not self.active:
                self.state.auto.begin()  # "auto" dtypes: observe this forward, or decide
        self.enter()

    def post(self, module, args, output):
        if not tracing(args):
            self.exit()
            if self.state is not None and not self.active:
                self.state.drain()  # the model's forward ended: a prefetch nobody used completes
                if self.state.auto is not None:
                    self.state.auto.end()

    def enter(self) -> None:
        """Gather the unit's groups and shadow each parameter attribute with its full view."""
        if any(g.summoned for g in self.groups):
            raise ZeroError(
                f"forward of {self.name or 'the model'} inside tracedac.zero.full_parameters(): the "
                "full parameters are plain tensors there and would not be gathered or reduced. "
                "Run forward outside the with block."
            )
        gathered = []
        try:
            for g in self.groups:
                gathered.append(Gathered(g, torch.ops.tracedac.all_gather(g.leaf, g.key, g.dtype_now())))
        except BaseException:  # (a ZeroError from an order check): nothing gathered here outlives it
            _release(gathered)
            raise
        views = [as_read(split_views(g.full, g.flat.slices, g.flat.world), g.flat.slices) for g in gathered]
        for s in self.slots:
            s.module.__dict__[s.attr] = views[s.group][s.piece]
        auto = self.groups[0].state.auto if self.groups else None
        if auto is not None and auto.observer is not None:
            auto.track(views, self.groups)
        hooks = None
        if (
            torch.is_grad_enabled()
            and current_region() is None
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        ):
            # Only when no other pair is active. A tracedac region turns gathered weights
            # into handles on its recorded gather node; torch.utils.checkpoint saves nothing
            # and re-runs the forward, which gathers again. Innermost wins, so pushing ours
            # would take their saved tensors from them.
            hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            hooks.__enter__()
        self.active.append((gathered, hooks))

    def enter_traced(self) -> None:
        """Under a compiler the gathers are graph nodes and nothing is registered at run time:
        the partitioner decides what backward keeps, and the joint-graph pass tags every gather
        to be recomputed (``compile/passes/zero_tags.py``), so backward gathers again. No
        ``Gathered`` entry and no saved-tensor hooks: the compiled code runs none of this.
        A tensor-parallel parameter's view is wrapped in its DTensor as in eager (``as_read``);
        AOTAutograd unwraps it to a view of the local one, so the passes see the gathered view
        and what is computed from it as plain tensors, exactly as without TP."""
        install_traced()
        # dtype explicit: the graph keeps the dtype it was traced with if "auto" changes it later
        fulls = [torch.ops.tracedac.all_gather(g.leaf, g.key, dtype=g.dtype_now()) for g in self.groups]
        views = [
            as_read(split_views(full, g.slices, g.world), g.slices) for full, g in zip(fulls, self.groups)
        ]
        for s in self.slots:
            # object.__setattr__ writes the instance __dict__ as below; dynamo tracks it as an
            # attribute store that the post-hook's delete undoes (a store to ``__dict__``
            # itself would make every view a graph output, alive until backward).
            object.__setattr__(s.module, s.attr, views[s.group][s.piece])
        self.active.append((fulls, _TRACED))

    def exit(self) -> None:
        if not self.active:
            return
        gathered, hooks = self.active.pop()
        if hooks is _TRACED:  # the gathered buffers themselves
            for s in self.slots:
                put_back_parameter(s.module, s.attr)  # (as the eager path's pop, traceable on 2.11)
            for full, g in zip(gathered, self.groups):
                torch.ops.tracedac.release(full, g.key)
            return
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for s in self.slots:  # the attribute reads the DTensor parameter again
            s.module.__dict__.pop(s.attr, None)
        _release(gathered)


def _release(gathered: list[Gathered]) -> None:
    for g in gathered:
        # detached: release has no gradient, and through the custom op's autograd wrapper
        # (torch 2.13's Generated.apply) each call left ~300 bytes behind for good
        torch.ops.tracedac.release(g.full.detach(), g.flat.key)


class _UnitForward:
    """A unit's forward, set on the instance: under a compiler it gathers, runs the module's
    forward and releases, all in the frame dynamo traces (torch 2.13 runs a compiled
    module's own hooks as frames of their own, and a context cannot span them: a gather in
    the pre-hook's frame would be a graph output, held until backward). Eager, it only calls
    the forward: the hooks gather. ``tracedac.checkpoint`` applied after ``shard`` calls it
    inside its region (``tracedac_composes``). An object, so the module still pickles."""

    __slots__ = ("unit", "inner")
    tracedac_composes = True

    def __init__(self, unit: Unit, inner):
        self.unit, self.inner = unit, inner  # inner: an instance forward set before (checkpoint's), or None

    def __call__(self, *args, **kwargs):
        module = self.unit.module
        forward = self.inner if self.inner is not None else class_forward(module)
        if not tracing(args, kwargs):
            return forward(*args, **kwargs)
        self.unit.enter_traced()
        try:
            return forward(*args, **kwargs)
        finally:
            self.unit.exit()


class _Lazy:
    """A module inside a unit, run while its unit is not (``torch.utils.checkpoint`` re-running
    it in backward, or a direct call): gathers the unit around this module's forward."""

    def __init__(self, unit: Unit):
        self.unit = unit
        self.entered: list = []

    def pre(self, module, args):
        if tracing(args):
            self.entered.append(False)
            return
        lazy = not self.unit.active
        if lazy:
            self.unit.enter()
        self.entered.append(lazy)

    def post(self, module, args, output):
        if self.entered and self.entered.pop():
            self.unit.exit()


def _pack(t: torch.Tensor):
    if is_subclass(t):
        # A DTensor parameter of a tensor-parallel unit (``tp.wrap``): its local tensor is on
        # a gathered buffer. Kept as a Handle inside its flattened form; other subclasses as is.
        if not is_wrapper_subclass(t):
            return t
        flat = Flattened(t, _pack_inner)
        return flat if any(h.__class__ is Handle for h in flat.leaves()) else t
    h = handle_for(t)
    return t if h is None else h


def _pack_inner(t: torch.Tensor):
    return handle_for(t) or Constant(t)


def _unpack(x):
    return x.unpack() if x.__class__ is Handle or x.__class__ is Flattened else x


class _Autocast:
    """Runs a low-precision module's forward under ``torch.autocast``."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type, self.dtype = device_type, dtype
        self.stack: list = []

    def pre(self, module, args):
        if tracing(args):
            if (
                torch.is_autocast_enabled(self.device_type)
                and torch.get_autocast_dtype(self.device_type) == self.dtype
            ):
                return  # the caller's autocast already covers it (and the compiler traced it)
            raise ZeroError(
                "shard(mixed_precision=MixedPrecision(...)) runs its low-precision modules under "
                "torch.autocast from forward hooks, which a compiler cannot trace as one context. "
                "Under torch.compile, call the compiled model inside "
                f"torch.autocast({self.device_type!r}, dtype={self.dtype}) (the parameters still "
                "travel in param_dtype), or shard without mixed_precision: under autocast the "
                "compiled graph's cast of a gathered parameter moves into the gather."
            )
        ctx = torch.autocast(self.device_type, dtype=self.dtype)
        ctx.__enter__()
        self.stack.append(ctx)

    def post(self, module, args, output):
        if self.stack:
            self.stack.pop().__exit__(None, None, None)
