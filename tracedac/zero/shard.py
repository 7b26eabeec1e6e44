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

from ..checkpoint import current_region, module_matcher
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
            raise TypeError(
                f"MixedPrecision(low_precision_modules=...) takes a tuple of nn.Module classes, got {mods!r}"
            )


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
        self.state: Prefetch | None = None  # the root unit's only: its forward starts a new order of gathers

    def pre(self, module, args):
        if self.state is not None:
            self.state.begin(backward=False)  # a new forward: its gathers count from 0 again
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
    uses = _uses(module, chosen)
    # Compared before anything a rank could refuse alone: a rank raising early would
    # leave the others waiting in this collective.
    meta = [(u.unit, u.fqn, tuple(u.param.shape), str(u.param.dtype), u.param.requires_grad) for u in uses]
    _arrive(group, timeout)
    _check_same_models(meta, group)
    for u in uses:
        if u.param.dtype != torch.float32 or u.param.is_sparse:
            raise ZeroError(
                f"parameter {u.fqn!r} is {u.param.dtype}{' sparse' if u.param.is_sparse else ''}; shard() "
                "keeps dense fp32 shards. Build the model in float32 and pass mixed_precision="
                "MixedPrecision(...) to compute in bf16."
            )
    modules = {"": module, **{name: module.get_submodule(name) for name in chosen.values()}}
    units_by_name = {name: Unit(name, m) for name, m in modules.items()}
    state = Prefetch(prefetch)
    owner = _make_flats(uses, units_by_name, group, mixed_precision, timeout, state)
    _attach(uses, units_by_name, owner)
    # The root is hooked even with no parameters of its own: its forward marks a new step.
    active = [u for u in units_by_name.values() if u.slots or not u.name]
    units_by_name[""].state = state
    for unit in active:
        unit.module.register_forward_pre_hook(unit.pre)
        unit.module.register_forward_hook(unit.post, always_call=True)
    mp = mixed_precision
    if mp is not None:
        device_type = uses[0].param.device.type if uses else "cpu"
        autocast = _Autocast(device_type, mp.param_dtype)
        for m in {id(u.module): u.module for u in uses if isinstance(u.module, mp.low_precision_modules)}.values():
            m.register_forward_pre_hook(autocast.pre)
            m.register_forward_hook(autocast.post, always_call=True)
    module._tracedac_zero = Sharded(group, active, keys, [u.fqn for u in uses], mp)
    return module


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


def _make_flats(uses, units: dict, group, mp, timeout, state) -> dict:
    """Each unit's flat groups and this rank's shards of them; returns id(param) -> (flat, piece).

    A parameter belongs to the unit it first appears in, and travels in ``param_dtype``
    only if every module reading it is low precision.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    low: dict[int, bool] = {}
    for u in uses:
        is_low = mp is not None and isinstance(u.module, mp.low_precision_modules)
        low[id(u.param)] = low.get(id(u.param), True) and is_low
    members: dict[tuple, list] = {}  # (unit, dtype, requires_grad) -> params, in order
    first: set[int] = set()
    for u in uses:
        if id(u.param) not in first:
            first.add(id(u.param))
            dtype = mp.param_dtype if low[id(u.param)] else torch.float32
            members.setdefault((u.unit, dtype, u.param.requires_grad), []).append(u.param)
    owner = {}
    for (name, dtype, requires_grad), params in members.items():
        unit = units[name]
        sizes = [p.numel() for p in params]
        numel = sum(sizes)
        per_rank = -(-numel // world)  # padded to a multiple of the world size
        with torch.no_grad():
            full = torch.cat([p.detach().reshape(-1) for p in params] + [params[0].new_zeros(per_rank * world - numel)])
            shard_param = nn.Parameter(full[rank * per_rank:(rank + 1) * per_rank].clone(), requires_grad=requires_grad)
        index = len(unit.own)
        unit.module.register_parameter(f"{FLAT_PREFIX}{index}", shard_param)
        kind = f"{'trainable' if requires_grad else 'frozen'} {str(dtype).removeprefix('torch.')}"
        flat = FlatParam(f"unit {name or '<root>'!r} ({kind} parameters)", shard_param, numel, dtype,
                         mp.reduce_dtype if mp is not None else torch.float32, group, timeout, state)
        flat.sizes = sizes + [per_rank * world - numel]  # how the gathered buffer splits
        flat.fqn = f"{name}.{FLAT_PREFIX}{index}" if name else f"{FLAT_PREFIX}{index}"
        flat.params = []  # (every key of the parameter, offset, shape): for state dicts
        offset = 0
        for piece, p in enumerate(params):
            owner[id(p)] = (flat, piece)
            flat.params.append(([], offset, tuple(p.shape)))
            offset += p.numel()
        unit.own.append(flat)
    return owner


def _attach(uses, units: dict, owner: dict) -> None:
    """Point every use at its piece of a gathered group; replace the parameters by placeholders."""
    for unit in units.values():
        unit.flats = list(unit.own)
    placeholders: dict[int, torch.Tensor] = {}
    done: set = set()
    for u in uses:
        unit = units[u.unit]
        flat, piece = owner[id(u.param)]
        flat.params[piece][0].append(u.fqn)
        if (id(u.module), u.attr) in done:
            continue  # a module reached twice (shared): one attribute, set by its first unit
        done.add((id(u.module), u.attr))
        if flat not in unit.flats:
            unit.flats.append(flat)  # a parameter shared with an earlier unit: gather its group too
        shape = tuple(u.param.shape)
        placeholder = placeholders.get(id(u.param))
        if placeholder is None:  # shape readable, no memory, fails loudly if computed with
            placeholder = placeholders[id(u.param)] = torch.empty(shape, dtype=u.param.dtype, device="meta")
        unit.slots.append(_Slot(u.module, u.attr, u.fqn, unit.flats.index(flat), piece, shape, placeholder))
    for u in uses:
        u.module._parameters.pop(u.attr, None)
        u.module.__dict__[u.attr] = placeholders[id(u.param)]
