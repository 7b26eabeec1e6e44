"""``shard()``: flat fp32 shards per unit, and the forward hooks that gather and release them.

A *unit* is a module whose parameters are gathered together (by default each child of a
``ModuleList``; everything else forms the root unit). Its pre-hook all-gathers its flat
groups (``tracedac::all_gather``) and sets each parameter attribute to a view of the
gathered buffer; its post-hook puts meta-device placeholders back and calls
``tracedac::release``, so after the forward no full parameter is referenced by the model.

What autograd saves on a gathered buffer (``mm`` keeps its weight) becomes a ``Handle``:
outside checkpoint regions through this module's ``saved_tensors_hooks``, inside them
through the region's own (the gather is a recorded node there, replayed in backward).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import current_region
from .errors import ZeroError
from .ops import FlatParam, Gathered, Handle, Prefetch, handle_for

__all__ = ["MixedPrecision", "shard", "sharded"]

FLAT_PREFIX = "_tracedac_flat"


@dataclass(frozen=True)
class MixedPrecision:
    """Which parameters travel and compute in ``param_dtype``; gradients reduce in ``reduce_dtype``.

    Only parameters of ``low_precision_modules`` instances are cast (used by no other kind
    of module), and those modules' forwards run under ``torch.autocast``; norms,
    embeddings and the rest stay fp32, as autocast would keep them.
    """

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    low_precision_modules: tuple = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def __post_init__(self):
        for field, value in (("param_dtype", self.param_dtype), ("reduce_dtype", self.reduce_dtype)):
            if value not in (torch.float32, torch.bfloat16, torch.float16):
                raise TypeError(f"MixedPrecision({field}=...) takes torch.float32, bfloat16 or float16, got {value!r}")
        mods = self.low_precision_modules
        if not isinstance(mods, tuple) or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in mods):
            raise TypeError(f"MixedPrecision(low_precision_modules=...) takes a tuple of nn.Module classes, got {mods!r}")


class _Slot:
    """One module attribute that reads a sharded parameter: where, and which piece of which flat."""

    __slots__ = ("module", "attr", "fqn", "flat", "piece", "shape", "placeholder")

    def __init__(self, module, attr, fqn, flat, piece, shape, placeholder):
        self.module, self.attr, self.fqn = module, attr, fqn
        self.flat = flat  # index into the unit's gathered flats
        self.piece = piece  # index of the parameter in that flat's split
        self.shape = shape
        self.placeholder = placeholder


class Unit:
    """The parameters one module gathers at once, and its forward pre/post hooks."""

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.module = module
        self.own: list[FlatParam] = []  # flat groups this unit owns (its shards)
        self.flats: list[FlatParam] = []  # groups it gathers: its own, then borrowed (shared params)
        self.slots: list[_Slot] = []
        self.active: list = []  # (gathered, hooks) per forward call running
        self.root = False  # the model itself: its forward starts a new order of gathers

    def pre(self, module, args):
        if self.root:
            self.own[0].state.begin(backward=False)  # a new forward: its gathers start at 0
        gathered = [Gathered(f, torch.ops.tracedac.all_gather(f.shard, f.key)) for f in self.flats]
        pieces = [g.full.split_with_sizes(g.flat.sizes) for g in gathered]
        for s in self.slots:
            s.module.__dict__[s.attr] = pieces[s.flat][s.piece].view(s.shape)
        hooks = None
        if torch.is_grad_enabled() and current_region() is None:
            # Inside a checkpoint region the region's hooks (innermost wins) already turn
            # the gathered weights into handles on the recorded gather node.
            hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            hooks.__enter__()
        self.active.append((gathered, hooks))

    def post(self, module, args, output):
        if not self.active:
            return
        gathered, hooks = self.active.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
        for s in self.slots:
            s.module.__dict__[s.attr] = s.placeholder
        for g in gathered:
            torch.ops.tracedac.release(g.full, g.flat.key)


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
        ctx = torch.autocast(self.device_type, dtype=self.dtype)
        ctx.__enter__()
        self.stack.append(ctx)

    def post(self, module, args, output):
        if self.stack:
            self.stack.pop().__exit__(None, None, None)


class Sharded:
    """What ``shard()`` did to a model: its units, flat groups and original state_dict keys."""

    def __init__(self, group, units, keys, param_fqns, mixed_precision):
        self.group = group
        self.units = units
        self.flats = [f for u in units for f in u.own]
        self.keys = keys  # the unsharded model's state_dict keys, in order
        self.param_fqns = param_fqns  # the keys that are parameters
        self.mixed_precision = mixed_precision
        self.mesh = None  # a DeviceMesh over group, made for sharded state dicts


def sharded(module) -> Sharded:
    z = getattr(module, "_tracedac_zero", None) if isinstance(module, nn.Module) else None
    if z is None:
        raise ZeroError(
            f"{type(module).__name__} is not sharded by tracedac.zero; call "
            "tracedac.zero.shard(model) first (on the model itself, not a submodule)."
        )
    return z


def _unit_matcher(units):
    if units is None:
        return None
    if isinstance(units, type) or (isinstance(units, tuple) and units):
        classes = units if isinstance(units, tuple) else (units,)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"shard(units=...) takes nn.Module classes, got {units!r}")
        return lambda name, m: isinstance(m, classes)
    if callable(units):
        return units
    raise TypeError(
        "shard(units=...) takes an nn.Module class, a non-empty tuple of them, or a predicate "
        f"(qualified_name, module) -> bool, got {units!r} of type {type(units).__name__}"
    )


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


def shard(module: nn.Module, *, group=None, units=None, mixed_precision: MixedPrecision | None = None,
          prefetch: bool = True, timeout=None) -> nn.Module:
    """Shard ``module``'s parameters in place across ``group`` (ZeRO-3); returns ``module``.

    ``units``: classes, or a predicate ``(qualified_name, module) -> bool``, choosing the
    modules whose parameters are gathered together (default: each child of a
    ``ModuleList``; the rest form a root unit). Each rank keeps one flat fp32 shard per
    unit and group of parameters (by travel dtype and ``requires_grad``), padded to a
    multiple of the world size; they are the module's ``parameters()``. Ranks must hold
    the same values before sharding (same seed), as with FSDP. ``timeout`` (seconds or a
    timedelta) bounds every wait on a collective: a rank that dies makes the others raise.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
    if getattr(module, "_tracedac_zero", None) is not None:
        raise ZeroError(f"{type(module).__name__} is already sharded by tracedac.zero; shard it once.")
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
    keys = list(module.state_dict().keys())

    # Every (unit, module, attribute) reading a parameter, in module order; a shared
    # parameter belongs to the unit it first appears in.
    seen: list = []

    def walk(prefix, m, unit):
        for attr, p in m._parameters.items():
            if p is not None:
                seen.append((unit, prefix + attr, m, attr, p))
        for child_name, child in m._modules.items():
            if child is not None:
                walk(f"{prefix}{child_name}.", child, chosen.get(id(child), unit))

    walk("", module, "")
    for _, fqn, _, _, p in seen:
        if p.dtype != torch.float32 or p.is_sparse:
            raise ZeroError(
                f"parameter {fqn!r} is {p.dtype}{' sparse' if p.is_sparse else ''}; shard() keeps dense "
                "fp32 shards. Build the model in float32 and pass mixed_precision="
                "MixedPrecision(...) to compute in bf16."
            )
    _check_same_models([(u, fqn, tuple(p.shape), str(p.dtype), p.requires_grad) for u, fqn, _, _, p in seen], group)

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mp = mixed_precision
    low = {}  # id(param) -> whether every module reading it is low precision
    for _, _, m, _, p in seen:
        is_low = mp is not None and isinstance(m, mp.low_precision_modules)
        low[id(p)] = low.get(id(p), True) and is_low
    state = Prefetch(prefetch)
    modules = {"": module}
    modules.update({name: module.get_submodule(name) for name in chosen.values()})
    unit_objs: dict[str, Unit] = {}
    owner: dict[int, tuple] = {}  # id(param) -> (FlatParam, piece)
    members: dict[tuple, list] = {}  # (unit, dtype, requires_grad) -> params, in order
    for u, fqn, _, _, p in seen:
        if id(p) in owner:
            continue
        owner[id(p)] = None
        dtype = mp.param_dtype if mp is not None and low[id(p)] else torch.float32
        members.setdefault((u, dtype, p.requires_grad), []).append(p)
    for (u, dtype, requires_grad), params in members.items():
        unit = unit_objs.get(u) or unit_objs.setdefault(u, Unit(u, modules[u]))
        sizes = [p.numel() for p in params]
        numel = sum(sizes)
        per_rank = -(-numel // world)
        with torch.no_grad():
            full = torch.cat([p.detach().reshape(-1) for p in params] + [params[0].new_zeros(per_rank * world - numel)])
            local = full[rank * per_rank:(rank + 1) * per_rank].clone()
        shard_param = nn.Parameter(local, requires_grad=requires_grad)
        index = len(unit.own)
        unit.module.register_parameter(f"{FLAT_PREFIX}{index}", shard_param)
        kind = f"{'trainable' if requires_grad else 'frozen'} {str(dtype).removeprefix('torch.')}"
        flat = FlatParam(f"unit {u or '<root>'!r} ({kind} parameters)", shard_param, numel, dtype,
                         mp.reduce_dtype if mp is not None else torch.float32, group, timeout, state)
        flat.sizes = sizes + [per_rank * world - numel]
        flat.fqn = f"{u}.{FLAT_PREFIX}{index}" if u else f"{FLAT_PREFIX}{index}"
        flat.params = []  # (fqns, offset, shape) per parameter, for state dicts
        offset = 0
        for piece, p in enumerate(params):
            owner[id(p)] = (flat, piece)
            flat.params.append(([], offset, tuple(p.shape)))
            offset += p.numel()
        unit.own.append(flat)
    placeholders: dict[int, torch.Tensor] = {}
    done: set = set()
    for u, fqn, m, attr, p in seen:
        unit = unit_objs.get(u) or unit_objs.setdefault(u, Unit(u, modules[u]))
        flat, piece = owner[id(p)]
        flat.params[piece][0].append(fqn)
        if (id(m), attr) in done:
            continue  # a module reached twice (shared): one attribute, set once
        done.add((id(m), attr))
        if not unit.flats:
            unit.flats = list(unit.own)
        if flat not in unit.flats:
            unit.flats.append(flat)  # a parameter shared with an earlier unit: gather its group too
        if id(p) not in placeholders:
            placeholders[id(p)] = torch.empty(p.shape, dtype=p.dtype, device="meta")
        unit.slots.append(_Slot(m, attr, fqn, unit.flats.index(flat), piece, tuple(p.shape), placeholders[id(p)]))
    for _, _, m, attr, _ in seen:
        m._parameters.pop(attr, None)  # the attribute becomes a placeholder, then a view in forward
    units_list = list(unit_objs.values())
    if "" in unit_objs and unit_objs[""].own:
        unit_objs[""].root = True
    for unit in units_list:
        for s in unit.slots:
            s.module.__dict__[s.attr] = s.placeholder
        unit.module.register_forward_pre_hook(unit.pre)
        unit.module.register_forward_hook(unit.post, always_call=True)
    if mp is not None:
        device_type = next((f.shard.device.type for u in units_list for f in u.own), "cpu")
        autocast = _Autocast(device_type, mp.param_dtype)
        for m in {id(m): m for _, _, m, _, _ in seen if isinstance(m, mp.low_precision_modules)}.values():
            m.register_forward_pre_hook(autocast.pre)
            m.register_forward_hook(autocast.post, always_call=True)
    module._tracedac_zero = Sharded(group, units_list, keys, [fqn for _, fqn, _, _, _ in seen], mp)
    return module
