"""``shard()``: each parameter becomes its rank's ``Shard(0)`` DTensor; units gather and release.

A *unit* is a module whose parameters are gathered together (by default each child of a
``ModuleList``; everything else forms the root unit). Its parameters stay registered where
they were, as DTensors viewing one flat fp32 buffer per group (``layout``). Its pre-hook
all-gathers its groups (``tracedac::all_gather``) and shadows each parameter attribute
with a view of the gathered buffer (an instance ``__dict__`` entry wins over
``_parameters``); its post-hook removes the shadows, so the attribute reads the DTensor
again, and calls ``tracedac::release``: after the forward no full parameter is referenced.

What autograd saves on a gathered buffer (``mm`` keeps its weight) becomes a ``Handle``:
outside checkpoint regions through this module's ``saved_tensors_hooks``, inside them
through the region's own (the gather is a recorded node there, replayed in backward).
"""

from __future__ import annotations

import datetime
import threading
import weakref
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..checkpoint import current_region, module_matcher, tracing
from .._compat import class_forward, compiles_zero
from ..compile.registry import install_traced
from .auto import Auto
from .errors import ZeroError
from .layout import make_slices, spec_for, split_views
from .ops import FlatGroup, Gathered, Handle, Prefetch, handle_for

__all__ = ["MixedPrecision", "ZeroModule", "shard", "sharded"]


@dataclass(frozen=True)
class MixedPrecision:
    """Which parameters travel and compute in ``param_dtype``; gradients reduce in ``reduce_dtype``.

    Only parameters of ``low_precision_modules`` instances are cast (used by no other kind
    of module), and those modules' forwards run under ``torch.autocast``; norms,
    embeddings and the rest stay fp32, as autocast would keep them.

    ``param_dtype="auto"``: no module list. The caller runs the model under
    ``torch.autocast``, and each parameter travels in the dtype the program computes with it
    there, as the first forward shows (``zero/auto.py``) or, compiled, as the graph shows
    (``compile/gather_cast.py``): a Linear weight in bf16, a LayerNorm weight in fp32, a
    parameter read both ways in fp32. ``low_precision_modules`` is not used.
    """

    param_dtype: torch.dtype | str = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    low_precision_modules: tuple = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def __post_init__(self):
        for field, value in (("param_dtype", self.param_dtype), ("reduce_dtype", self.reduce_dtype)):
            if value not in (torch.float32, torch.bfloat16, torch.float16) and not (field == "param_dtype" and value == "auto"):
                also = ' or "auto"' if field == "param_dtype" else ""
                raise TypeError(f"MixedPrecision({field}=...) takes torch.float32, bfloat16 or float16{also}, "
                                f"got {value!r}")
        mods = self.low_precision_modules
        if not isinstance(mods, tuple) or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in mods):
            raise TypeError(
                f"MixedPrecision(low_precision_modules=...) takes a tuple of nn.Module classes, got {mods!r}"
            )


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
        views = [split_views(g.full, g.flat.slices, g.flat.world) for g in gathered]
        for s in self.slots:
            s.module.__dict__[s.attr] = views[s.group][s.piece]
        auto = self.groups[0].state.auto if self.groups else None
        if auto is not None and auto.observer is not None:
            auto.track(views, self.groups)
        hooks = None
        if (torch.is_grad_enabled() and current_region() is None
                and torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
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
        to be recomputed (``compile/zero_tags.py``), so backward gathers again. No
        ``Gathered`` entry and no saved-tensor hooks: the compiled code runs none of this."""
        install_traced()
        compiles_zero(torch.compiler.is_dynamo_compiling())  # (torch >= 2.13)
        # dtype explicit: the graph keeps the dtype it was traced with if "auto" changes it later
        fulls = [torch.ops.tracedac.all_gather(g.leaf, g.key, dtype=g.dtype_now()) for g in self.groups]
        views = [split_views(full, g.slices, g.world) for full, g in zip(fulls, self.groups)]
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
                s.module.__dict__.pop(s.attr, None)
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
    h = handle_for(t)
    return t if h is None else h


def _unpack(x):
    return x.unpack() if x.__class__ is Handle else x


class _Autocast:
    """Runs a low-precision module's forward under ``torch.autocast``."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        self.device_type, self.dtype = device_type, dtype
        self.stack: list = []

    def pre(self, module, args):
        if tracing(args):
            if torch.is_autocast_enabled(self.device_type) and \
                    torch.get_autocast_dtype(self.device_type) == self.dtype:
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


class Sharded:
    """What one ``shard()`` call did: its units and groups, and the shards nested in it."""

    def __init__(self, module, group, units, groups, mixed_precision, mesh, state, children):
        self.module = module
        self.group = group
        self.units = units  # the units with hooks
        self.groups = groups  # the flat groups this call made
        self.mixed_precision = mixed_precision
        self.mesh = mesh
        self.state = state
        self.children = children  # Sharded of submodules sharded before (FSDP2's nesting)
        self.parent: Sharded | None = None

    @property
    def all_groups(self) -> list:
        return [g for c in self.children for g in c.all_groups] + self.groups

    @property
    def all_units(self) -> list:
        return [u for c in self.children for u in c.all_units] + self.units

    def adopt(self, child: Sharded, prefix: str) -> None:
        """Run ``child``'s gathers in this model's order of gathers (one prefetch chain); name
        its groups from this model (``prefix``: the child's qualified name here)."""
        child.parent = self
        if child.state.auto is not None:  # one "auto" decision for the whole model
            if self.state.auto is None:
                self.state.auto = child.state.auto
            else:
                self.state.auto.adopt(child.state.auto)
        for g in child.all_groups:
            g.state = self.state
            g.name = g.name.replace("unit '", f"unit '{prefix}.", 1).replace(".<root>'", "'", 1)
            g.crc = zlib.crc32(g.name.encode())
        for u in child.all_units:
            u.state = None


def sharded(module) -> Sharded:
    z = module.__dict__.get("_tracedac_zero") if isinstance(module, nn.Module) else None
    if z is None:
        raise ZeroError(
            f"{type(module).__name__} is not sharded by tracedac.zero; call "
            "tracedac.zero.shard(model) first (on the model itself, not a submodule)."
        )
    return z


class ZeroModule:
    """Mixed into the class of every module ``shard()`` was called on (as FSDP2's ``FSDPModule``)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Reduce gradients in backward (True, the default) or accumulate them unsharded on
        each rank (False: no communication in backward, one full gradient held per group)
        until a backward with sync on reduces the sum. FSDP2's name and meaning."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync takes True or False, got {requires_gradient_sync!r}")
        z = sharded(self)
        for g in z.all_groups if recurse else z.groups:
            g.sync = requires_gradient_sync

    def _apply(self, fn, recurse=True):
        """``to_empty``, ``.to(device)`` move the flat buffers and rebuild the DTensors over them;
        a dtype change (``.to(dtype)``, ``.half()``) is refused before anything changes."""
        z = self.__dict__.get("_tracedac_zero")
        root = z is not None
        z = z or self.__dict__["_tracedac_zero_unit_of"]
        if getattr(_applying, "on", False):
            return super()._apply(fn, recurse)  # an enclosing shard's _apply moves our groups
        groups = z.all_groups
        moved = [fn(g.local) for g in groups]
        for g, new in zip(groups, moved):
            if new.dtype != g.local.dtype:
                raise ZeroError(
                    f"{type(self).__name__} is sharded by tracedac.zero, which keeps fp32 shards "
                    f"and casts them when gathering; converting them to {new.dtype} is refused. "
                    "Pass mixed_precision=MixedPrecision(param_dtype=...) to shard() instead, "
                    "or convert the model before sharding it."
                )
        if not root and any(new is not g.local for g, new in zip(groups, moved)):
            raise ZeroError(
                f"{type(self).__name__} is a unit of a model sharded by tracedac.zero; move the "
                f"model shard() was called on ({type(z.module).__name__}), whose shards move together."
            )
        uses = [(m, attr) for g in groups for s in g.slices for m, attr in s.uses]
        # Popped and put back below: remember each module's order, so named_parameters()
        # and state_dict keep theirs.
        orders = {id(m): (m, list(m._parameters)) for m, _ in uses}
        for m, attr in uses:
            m._parameters.pop(attr, None)
        # One mesh for the device the shards move to, computed once: every group is
        # re-specced over it (not only the first one that moved).
        mesh = z.mesh
        for g, new in zip(groups, moved):
            if new is not g.local and new.device != g.local.device and new.device.type != mesh.device_type:
                mesh = _mesh(g.group, new.device)
                break
        _applying.on = True
        try:
            super()._apply(fn, recurse)  # buffers and anything that is not a shard
        finally:
            _applying.on = False
            if mesh is not z.mesh:
                for c in _all_sharded(z):
                    c.mesh = mesh
                for g in groups:
                    for s in g.slices:
                        s.spec = spec_for(mesh, s.shape)
            for g, new in zip(groups, moved):
                if new is not g.local:
                    if g.local.is_meta:
                        new.zero_()  # to_empty: the padding must hold zeros
                    g.bind(new)  # new DTensor parameters: build the optimizer after moving
                else:
                    for s in g.slices:
                        for m, attr in s.uses:
                            m._parameters[attr] = s.param
            for m, order in orders.values():
                now = dict(m._parameters)
                m._parameters.clear()
                m._parameters.update({k: now.pop(k) for k in order if k in now} | now)
        return self


_applying = threading.local()


def _all_sharded(z: Sharded) -> list[Sharded]:
    return [z] + [d for c in z.children for d in _all_sharded(c)]


def _as_zero_module(module: nn.Module) -> None:
    cls = module.__class__
    if not issubclass(cls, ZeroModule):
        module.__class__ = _ZERO_CLASSES.get(cls) or _ZERO_CLASSES.setdefault(
            cls, type(f"Zero{cls.__name__}", (ZeroModule, cls), {"__module__": cls.__module__}))


_ZERO_CLASSES: dict = {}


def _mesh(group, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    kind = device.type
    if kind == "meta":  # built on meta: the mesh is where the collectives will run
        kind = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    return DeviceMesh.from_group(group, kind)


def _unit_matcher(units):
    return None if units is None else module_matcher(units, "shard(units=...)")


def _choose_units(module: nn.Module, match) -> dict[int, str]:
    """id(module) -> qualified name of each unit module other than the root."""
    chosen = {}
    for name, m in module.named_modules():
        if not name:
            continue
        if match is None:
            parent = module.get_submodule(name.rpartition(".")[0])
            if isinstance(parent, nn.ModuleList):
                chosen[id(m)] = name
        elif match(name, m):
            chosen[id(m)] = name
    if match is not None and not chosen:
        classes = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(
            f"shard(units=...) matched no submodule of {type(module).__name__}, so every "
            f"parameter would be gathered at once. Module classes present: {', '.join(classes)}."
        )
    return chosen


def _timeout(timeout):
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return datetime.timedelta(seconds=timeout)
    raise TypeError(f"shard(timeout=...) takes seconds (a positive number) or a datetime.timedelta, got {timeout!r}")


def _arrive(group, timeout) -> None:
    """Wait until every rank has reached shard(), for at most ``timeout`` (gloo's
    monitored_barrier names the ranks missing; other backends wait their group's timeout)."""
    if timeout is None or dist.get_backend(group) != "gloo":
        return
    try:
        dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        raise ZeroError(
            f"rank {dist.get_rank(group)}: not every rank reached tracedac.zero.shard() within "
            f"{timeout.total_seconds():g} s ({e}). A rank died or runs different code before "
            "shard(); look at its error first."
        ) from e


def _check_same_models(meta: list, group) -> None:
    """Every rank must shard the same parameters: compare (unit, name, shape, dtype) lists."""
    world = dist.get_world_size(group)
    everyone = [None] * world
    dist.all_gather_object(everyone, meta, group=group)
    for rank in range(1, world):
        other = everyone[rank]
        if other == everyone[0]:
            continue
        for i in range(max(len(other), len(everyone[0]))):
            a = everyone[0][i] if i < len(everyone[0]) else None
            b = other[i] if i < len(other) else None
            if a != b:
                break
        raise ZeroError(
            f"ranks 0 and {rank} are sharding different models: parameter {i} is {a} on rank 0 "
            f"but {b} on rank {rank} (unit, name, shape, dtype, requires_grad). Every rank must "
            "build the same model before shard(); check rank-dependent construction code."
        )


def _nested(module: nn.Module, uses) -> list[Sharded]:
    """The shards of submodules made before this call; refuse parameters sharded elsewhere."""
    if module.__dict__.get("_tracedac_zero") is not None:
        raise ZeroError(f"{type(module).__name__} is already sharded by tracedac.zero; shard it once.")
    inner = [m.__dict__["_tracedac_zero"] for m in module.modules() if "_tracedac_zero" in m.__dict__]
    children = [z for z in inner if z.parent is None]
    mine = {id(g) for z in inner for g in z.all_groups}
    made_by = {id(g): z for z in inner for g in z.groups}
    names = {id(m): name for name, m in module.named_modules()}
    for u in uses:
        replaced = getattr(u.param, "_tracedac_replaced_by", None)
        g = replaced[0]() if replaced is not None else None
        if g is not None and id(g) in made_by:
            inner_fqn = f"{names[id(made_by[id(g)].module)]}.{replaced[1]}".lstrip(".")
            raise ZeroError(
                f"parameter {u.fqn!r} is the same Parameter as {inner_fqn!r}, which an earlier "
                f"shard() call on a submodule already sharded: it replaced {inner_fqn!r} with its "
                f"shard but cannot see {u.fqn!r} outside that submodule, so the two would be "
                "untied and train apart. Shard at a level containing both uses: do not shard "
                "that submodule on its own, let this shard() call take it (units=... still "
                "chooses what is gathered together)."
            )
        g = getattr(u.param, "_tracedac_group", None)
        if g is not None and id(g) not in mine:
            raise ZeroError(
                f"parameter {u.fqn!r} is already sharded, by a shard() call on a module that "
                f"encloses {type(module).__name__} (its {g.name}). Shard inner modules first, "
                "then the model that contains them (FSDP2's order): each parameter goes to the "
                "innermost shard() call, the outer one takes what the inner ones did not."
            )
    return children


def shard(module: nn.Module, *, group=None, units=None, mixed_precision: MixedPrecision | None = None,
          prefetch: bool = True, timeout=None) -> nn.Module:
    """Shard ``module``'s parameters in place across ``group`` (ZeRO-3); returns ``module``.

    Every parameter stays where it was, under its name, as its rank's ``Shard(0)`` piece: a
    ``DTensor`` (``.full_tensor()`` is its value), so optimizers, parameter groups, state
    dicts and ``torch.distributed.checkpoint`` see the model's own parameters.

    ``units``: classes, or a predicate ``(qualified_name, module) -> bool``, choosing the
    modules whose parameters are gathered together (default: each child of a
    ``ModuleList``; the rest form a root unit). A unit's parameters of one travel dtype and
    ``requires_grad`` share one flat fp32 buffer per rank (one all-gather). Submodules
    sharded before keep their parameters (FSDP2's nesting: shard the blocks, then the
    model). Ranks must hold the same values before sharding (same seed), or load after.
    ``prefetch``: start the next unit's all-gathers (and a unit's groups together, one
    order check for them) in the order the last pass ran them.
    ``timeout`` (seconds or a timedelta) bounds every wait on a collective: a rank that
    dies makes the others raise.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ZeroError(
            "tracedac.zero.shard() needs a torch.distributed process group, and none is "
            "initialized. Launch with torchrun and call torch.distributed.init_process_group() "
            "(backend 'gloo' on CPU, 'nccl' on GPU) before shard(); for one process, "
            "init_process_group('gloo', init_method='file:///tmp/x', rank=0, world_size=1)."
        )
    if group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"shard(group=...) takes a torch.distributed ProcessGroup, got {type(group).__name__}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"shard(mixed_precision=...) takes a tracedac.zero.MixedPrecision, got {mixed_precision!r}")
    if not isinstance(prefetch, bool):
        raise TypeError(f"shard(prefetch=...) takes True or False, got {prefetch!r}")
    timeout = _timeout(timeout)
    chosen = _choose_units(module, _unit_matcher(units))
    all_uses = _uses(module, chosen)
    children = _nested(module, all_uses)
    uses = [u for u in all_uses if getattr(u.param, "_tracedac_group", None) is None]
    # Compared before anything a rank could refuse alone: a rank raising early would
    # leave the others waiting in this collective.
    meta = [(u.unit, u.fqn, tuple(u.param.shape), str(u.param.dtype), u.param.requires_grad) for u in uses]
    _arrive(group, timeout)
    _check_same_models(meta, group)
    for u in uses:
        if u.param.dtype != torch.float32 or u.param.is_sparse or u.param.dim() == 0 or isinstance(u.param, DTensor):
            what = ("a DTensor already" if isinstance(u.param, DTensor) else "0-dimensional" if u.param.dim() == 0
                    else f"{u.param.dtype}{' sparse' if u.param.is_sparse else ''}")
            raise ZeroError(
                f"parameter {u.fqn!r} is {what}; shard() keeps dense fp32 parameters of at least one "
                "dimension as Shard(0) pieces. Build the model in float32 (pass mixed_precision="
                "MixedPrecision(...) to compute in bf16) and give a scalar parameter the shape (1,)."
            )
    device = uses[0].param.device if uses else torch.device("cpu")
    mesh = _mesh(group, device)
    modules = {"": module, **{name: module.get_submodule(name) for name in chosen.values()}}
    units_by_name = {name: Unit(name, m) for name, m in modules.items()}
    state = Prefetch(prefetch)
    owner = _make_groups(uses, units_by_name, group, mesh, mixed_precision, timeout, state)
    _attach(uses, units_by_name, owner)
    # The root is hooked even with no parameters of its own: its forward marks a new step.
    active = [u for u in units_by_name.values() if u.slots or not u.name]
    units_by_name[""].state = state
    if mixed_precision is not None and mixed_precision.param_dtype == "auto":
        state.auto = Auto([g for u in units_by_name.values() for g in u.own], group)
    for unit in active:
        unit.module.register_forward_pre_hook(unit.pre)
        unit.module.register_forward_hook(unit.post, always_call=True)
        inner = unit.module.__dict__.get("forward")
        if inner is not None and not getattr(inner, "tracedac_composes", False):
            raise ZeroError(
                f"module {unit.name or type(unit.module).__name__!r} has a forward set on the instance; "
                "shard() sets its own there to gather under torch.compile. Set forward on the class, "
                "or shard before setting it."
            )
        unit.module.forward = _UnitForward(unit, inner)
        for m in {id(s.module): s.module for s in unit.slots if s.module is not unit.module}.values():
            lazy = _Lazy(unit)
            m.register_forward_pre_hook(lazy.pre)
            m.register_forward_hook(lazy.post, always_call=True)
    mp = mixed_precision
    if mp is not None and mp.param_dtype != "auto":
        autocast = _Autocast(device.type, mp.param_dtype)
        for m in {id(u.module): u.module for u in uses if isinstance(u.module, mp.low_precision_modules)}.values():
            m.register_forward_pre_hook(autocast.pre)
            m.register_forward_hook(autocast.post, always_call=True)
    groups = [g for u in units_by_name.values() for g in u.own]
    held: dict = {}
    for g in groups:
        for sl in g.slices:
            for m, attr in sl.uses:
                held.setdefault(id(m), (m, []))[1].append((attr, g, sl))
    for m, places in held.values():
        m.register_load_state_dict_post_hook(_Reattach(places))
    z = Sharded(module, group, active, groups, mp, mesh, state, children)
    names = {id(m): name for name, m in module.named_modules()}
    for child in children:
        z.adopt(child, names[id(child.module)])
    for unit in active:  # a unit's .to(dtype) / .half() must raise at the call too
        if unit.module is not module:
            _as_zero_module(unit.module)
            unit.module.__dict__["_tracedac_zero_unit_of"] = z
    _as_zero_module(module)
    module.__dict__["_tracedac_zero"] = z
    return module


class _Reattach:
    """A load_state_dict post hook: ``assign=True`` (which ``set_model_state_dict`` uses) put
    new Parameter objects where the shards were, which no gather would read and no gradient
    reach. Copy each assigned value's rows into the flat buffer and put the group's own
    parameter back; a value or model on meta cannot be copied and is refused."""

    def __init__(self, places):
        self.places = places  # (attr, group, slice) of the module the hook is on

    def __call__(self, module, incompatible_keys) -> None:
        assigned = []
        for attr, g, s in self.places:  # every place restored first: an error leaves none detached
            new = module._parameters.get(attr)
            if new is not s.param:
                module._parameters[attr] = s.param
                if new is not None:
                    assigned.append((g, s, new))
        for g, s, new in assigned:
            if g.local.is_meta or new.is_meta:
                raise ZeroError(
                    f"load_state_dict(assign=True) (set_model_state_dict uses it) put a new tensor at "
                    f"{s.fqn!r} of a model sharded by tracedac.zero while "
                    f"{'the model' if g.local.is_meta else 'that tensor'} is on meta: nothing can be "
                    "copied into the shards, and the new tensor would be silently detached from them. "
                    "Call model.to_empty(device=...) after shard() and before loading, and load real "
                    "values (or use tracedac.zero.load_full_state_dict)."
                )
            with torch.no_grad():
                if (isinstance(new, DTensor) and new.device_mesh == s.spec.mesh and new.placements == s.spec.placements
                        and new.to_local().shape == s.local_shape):
                    rows = new.to_local()  # already this rank's Shard(0) rows: no communication
                else:
                    full = new.full_tensor() if isinstance(new, DTensor) else new
                    if full.shape != s.shape:
                        raise ZeroError(f"load_state_dict(assign=True) gave {s.fqn!r} the shape "
                                        f"{tuple(full.shape)}; the sharded parameter has {tuple(s.shape)}.")
                    rows = s.rows_of(full, g.rank, g.world)
                s.local(g.local).copy_(rows)


class _Use:
    """One module attribute reading a parameter, and the unit whose forward runs it."""

    __slots__ = ("unit", "fqn", "module", "attr", "param")

    def __init__(self, unit, fqn, module, attr, param):
        self.unit, self.fqn, self.module, self.attr, self.param = unit, fqn, module, attr, param


def _uses(module: nn.Module, chosen: dict) -> list[_Use]:
    """Every (module, attribute) reading a parameter, in state_dict order, with its unit.
    Not deduplicated: a shared parameter or module appears once per place, as in state_dict."""
    uses = []

    def walk(prefix, m, unit):
        for attr, p in m._parameters.items():
            if p is not None:
                uses.append(_Use(unit, prefix + attr, m, attr, p))
        for child_name, child in m._modules.items():
            if child is not None:
                walk(f"{prefix}{child_name}.", child, chosen.get(id(child), unit))

    walk("", module, "")
    return uses


def _make_groups(uses, units: dict, group, mesh, mp, timeout, state) -> dict:
    """Each unit's flat groups, their buffers and DTensor parameters; returns id(param) -> (group, piece).

    A parameter belongs to the unit it first appears in, and travels in ``param_dtype``
    only if every module reading it is low precision.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    auto = mp is not None and mp.param_dtype == "auto"
    low: dict[int, bool] = {}
    for u in uses:
        is_low = mp is not None and not auto and isinstance(u.module, mp.low_precision_modules)
        low[id(u.param)] = low.get(id(u.param), True) and is_low
    members: dict[tuple, list] = {}  # (unit, dtype, requires_grad, module class) -> first uses, in order
    first: set[int] = set()
    for u in uses:
        if id(u.param) not in first:
            first.add(id(u.param))
            dtype = mp.param_dtype if low[id(u.param)] else torch.float32
            # "auto": one group per module class, each to travel in the dtype its uses show
            members.setdefault((u.unit, dtype, u.param.requires_grad, type(u.module) if auto else None), []).append(u)
    owner = {}
    for (name, dtype, requires_grad, cls), firsts in members.items():
        unit = units[name]
        params = [u.param for u in firsts]
        slices, numel = make_slices([u.fqn for u in firsts], [p.shape for p in params], world, rank)
        local = torch.zeros(numel, dtype=torch.float32, device=params[0].device)
        if not local.is_meta:
            with torch.no_grad():
                for s, p in zip(slices, params):
                    s.local(local).copy_(s.rows_of(p.detach(), rank, world))
        for s in slices:
            s.spec = spec_for(mesh, s.shape)
        kind = f"{'trainable' if requires_grad else 'frozen'} {str(dtype).removeprefix('torch.')}"
        if cls is not None:
            kind = f"{'trainable' if requires_grad else 'frozen'} {cls.__name__}, auto dtype"
        g = FlatGroup(f"unit {name or '<root>'!r} ({kind} parameters)", slices, numel, requires_grad, dtype,
                      mp.reduce_dtype if mp is not None else torch.float32, group, timeout, state)
        g.local = local  # bound (DTensors made) once _attach knows every place each is held
        g.auto = cls is not None
        g.owner = unit
        for piece, p in enumerate(params):
            owner[id(p)] = (g, piece)
            # The replaced Parameter remembers where it went: a later shard() of an enclosing
            # model that still finds it (tied to a module outside this call) refuses it.
            p._tracedac_replaced_by = (weakref.ref(g), slices[piece].fqn)
        unit.own.append(g)
    return owner


def _attach(uses, units: dict, owner: dict) -> None:
    """Point every use at its piece of a gathered group; put the DTensor parameters in place."""
    for unit in units.values():
        unit.groups = list(unit.own)
    done: set = set()
    for u in uses:
        unit = units[u.unit]
        g, piece = owner[id(u.param)]
        if (id(u.module), u.attr) in done:
            continue  # a module reached twice (shared): one attribute, set by its first unit
        done.add((id(u.module), u.attr))
        g.slices[piece].uses.append((u.module, u.attr))
        if g not in unit.groups:
            unit.groups.append(g)  # a parameter shared with an earlier unit: gather its group too
        unit.slots.append(_Slot(u.module, u.attr, unit.groups.index(g), piece))
    for unit in units.values():
        for g in unit.own:
            g.bind(g.local)
