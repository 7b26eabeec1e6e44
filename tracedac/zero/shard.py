"""``shard()``: each parameter becomes its rank's ``Shard(0)`` DTensor, gathered by units.

``shard`` chooses the units (``unit.py``), cuts their parameters into flat groups
(``group.py``, laid out by ``layout.py``), puts the DTensor parameters in place, hooks
each unit's forward, and records the call on the module (``module.py``).
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ZeroError
from ..matching import module_matcher, no_match_error
from .auto import Auto
from .group import FlatGroup
from .layout import make_slices, spec_for
from .module import Sharded, _as_zero_module, _mesh, _Reattach
from .prefetch import Prefetch
from .tp import mesh_for as tp_mesh_for
from .tp import spec as tp_spec
from .unit import Unit, _Autocast, _Lazy, _Slot, _UnitForward

__all__ = ["MixedPrecision", "shard"]


@dataclass(frozen=True)
class MixedPrecision:
    """Which parameters travel and compute in ``param_dtype``; gradients reduce in ``reduce_dtype``.

    Only parameters of ``low_precision_modules`` instances are cast (used by no other kind
    of module), and those modules' forwards run under ``torch.autocast``; norms,
    embeddings and the rest stay fp32, as autocast would keep them.

    ``param_dtype="auto"``: no module list. The caller runs the model under
    ``torch.autocast``, and each parameter travels in the dtype the program computes with it
    there, as the first forward shows (``zero/auto.py``) or, compiled, as the graph shows
    (``compile/passes/gather_cast.py``): a Linear weight in bf16, a LayerNorm weight in fp32, a
    parameter read both ways in fp32. ``low_precision_modules`` is not used.
    """

    param_dtype: torch.dtype | str = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    low_precision_modules: tuple = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def __post_init__(self):
        for field, value in (("param_dtype", self.param_dtype), ("reduce_dtype", self.reduce_dtype)):
            if value not in (torch.float32, torch.bfloat16, torch.float16) and not (
                field == "param_dtype" and value == "auto"
            ):
                also = ' or "auto"' if field == "param_dtype" else ""
                raise TypeError(
                    f"MixedPrecision({field}=...) takes torch.float32, bfloat16 or float16{also}, "
                    f"got {value!r}"
                )
        mods = self.low_precision_modules
        if not isinstance(mods, tuple) or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in mods
        ):
            raise TypeError(
                f"MixedPrecision(low_precision_modules=...) takes a tuple of nn.Module classes, got {mods!r}"
            )


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
        raise no_match_error(
            module,
            f"shard(units=...) matched no submodule of {type(module).__name__}, so "
            "every parameter would be gathered at once",
        )
    return chosen


def _timeout(timeout):
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return datetime.timedelta(seconds=timeout)
    raise TypeError(
        f"shard(timeout=...) takes seconds (a positive number) or a datetime.timedelta, got {timeout!r}"
    )


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


def _apart(module: nn.Module, group) -> dict[str, tuple]:
    """Parameters a submodule's earlier ``shard()`` put on another group than ``group`` (expert
    parallel's experts, on their own ranks): qualified name -> that group's ranks."""
    ranks = dist.get_process_group_ranks(group)
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        g = getattr(p, "_tracedac_group", None)
        if g is not None and dist.get_process_group_ranks(g.group) != ranks:
            out[name] = tuple(dist.get_process_group_ranks(g.group))
    return out


def _check_one_name_per_group(apart: list[dict], group) -> None:
    """Two ranks holding parameters of different groups under one name would store different
    data under one checkpoint key (and DCP would keep one): refused here, before training."""
    seen: dict[str, set] = {}
    for held in apart:
        for name, ranks in held.items():
            seen.setdefault(name, set()).add(ranks)
    clash = {name: sorted(r) for name, r in seen.items() if len(r) > 1}
    if clash:
        shown = "; ".join(f"{n!r} on the groups of ranks {r}" for n, r in list(clash.items())[:5])
        raise ZeroError(
            f"parameters sharded earlier over different process groups share a name: {shown}"
            f"{' (and more)' if len(clash) > 5 else ''}. Each group's ranks hold their own values "
            "(expert parallel: different experts), so a checkpoint would keep one under that name "
            "and every rank would load it. Name them apart before sharding, by what they hold: "
            "experts by global index (a ModuleDict keyed by str(expert index), so rank 1's are "
            "'experts.2', 'experts.3')."
        )


def _check_same_models(meta: list, apart: dict, group) -> None:
    """Every rank must shard the same parameters: compare (unit, name, shape, dtype) lists;
    and parameters nested shards put on other groups must be named apart (``_apart``)."""
    world = dist.get_world_size(group)
    gathered = [None] * world
    dist.all_gather_object(gathered, (meta, apart), group=group)
    _check_one_name_per_group([a for _, a in gathered], group)
    everyone = [m for m, _ in gathered]
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
            f"but {b} on rank {rank} (unit, name, shape, dtype, requires_grad, placements). Every rank must "
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


def shard(
    module: nn.Module,
    *,
    group=None,
    units=None,
    mixed_precision: MixedPrecision | None = None,
    prefetch: bool = True,
    timeout=None,
) -> nn.Module:
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
    ``prefetch``: start the next unit's all-gathers (and a unit's groups together: one
    order check and, with two ranks or more, one all-gather for them; in backward one
    reduce-scatter) in the order the last pass ran them.
    ``timeout`` (seconds or a timedelta) bounds every wait on a collective: a rank that
    dies makes the others raise. On NCCL each such wait blocks the host until the
    collective is done (torch's ``Work.wait(timeout)``); leave it None on GPUs.
    Tensor parallel: a parameter ``parallelize_module`` made a DTensor on ``mesh["tp"]`` is
    sharded by its local tensor over ``group = mesh["dp"].get_group()``; forward reads the TP
    DTensor, optimizers and DCP a DTensor on the 2-D mesh (``tp.py``).
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
        raise TypeError(
            f"shard(group=...) takes a torch.distributed ProcessGroup, got {type(group).__name__}"
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"shard(mixed_precision=...) takes a tracedac.zero.MixedPrecision, got {mixed_precision!r}"
        )
    if not isinstance(prefetch, bool):
        raise TypeError(f"shard(prefetch=...) takes True or False, got {prefetch!r}")
    timeout = _timeout(timeout)
    chosen = _choose_units(module, _unit_matcher(units))
    all_uses = _uses(module, chosen)
    children = _nested(module, all_uses)
    uses = [u for u in all_uses if getattr(u.param, "_tracedac_group", None) is None]
    # Compared before anything a rank could refuse alone: a rank raising early would
    # leave the others waiting in this collective.
    meta = [
        (u.unit, u.fqn, tuple(u.param.shape), str(u.param.dtype), u.param.requires_grad, _placements(u.param))
        for u in uses
    ]
    _arrive(group, timeout)
    _check_same_models(meta, _apart(module, group), group)
    for u in uses:
        if u.param.dtype != torch.float32 or u.param.is_sparse or u.param.dim() == 0:
            what = (
                "0-dimensional"
                if u.param.dim() == 0
                else f"{u.param.dtype}{' sparse' if u.param.is_sparse else ''}"
            )
            raise ZeroError(
                f"parameter {u.fqn!r} is {what}; shard() keeps dense fp32 parameters of at least one "
                "dimension as Shard(0) pieces. Build the model in float32 (pass mixed_precision="
                "MixedPrecision(...) to compute in bf16) and give a scalar parameter the shape (1,)."
            )
    tp = [(u.fqn, u.param._spec) for u in uses if isinstance(u.param, DTensor)]
    device = uses[0].param.device if uses else torch.device("cpu")
    mesh, dp_dim = tp_mesh_for(group, tp, children) or (_mesh(group, device), 0)
    modules = {"": module, **{name: module.get_submodule(name) for name in chosen.values()}}
    units_by_name = {name: Unit(name, m) for name, m in modules.items()}
    state = Prefetch(prefetch)
    owner = _make_groups(uses, units_by_name, group, (mesh, dp_dim), mixed_precision, timeout, state)
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
        for m in {
            id(u.module): u.module for u in uses if isinstance(u.module, mp.low_precision_modules)
        }.values():
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
    z.dp_dim = dp_dim
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


def _placements(p) -> str | None:
    return str(tuple(p.placements)) if isinstance(p, DTensor) else None


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


def _make_groups(uses, units: dict, group, where, mp, timeout, state) -> dict:
    """Each unit's flat groups, their buffers and DTensor parameters; returns id(param) -> (group, piece).

    A parameter belongs to the unit it first appears in, and travels in ``param_dtype``
    only if every module reading it is low precision. A tensor-parallel parameter (a
    DTensor) is cut by its local tensor (``tp.py``); ``where``: (mesh, its dp dimension).
    """
    mesh, dp_dim = where
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
            members.setdefault(
                (u.unit, dtype, u.param.requires_grad, type(u.module) if auto else None), []
            ).append(u)
    owner = {}
    for (name, dtype, requires_grad, cls), firsts in members.items():
        unit = units[name]
        params = [u.param for u in firsts]
        values = [p._local_tensor if isinstance(p, DTensor) else p for p in params]  # TP: its local tensor
        slices, numel = make_slices([u.fqn for u in firsts], [v.shape for v in values], world, rank)
        local = torch.zeros(numel, dtype=torch.float32, device=params[0].device)
        if not local.is_meta:
            with torch.no_grad():
                for s, v in zip(slices, values):
                    s.local(local).copy_(s.rows_of(v.detach(), rank, world))
        for s, p in zip(slices, params):
            s.tp = p._spec if isinstance(p, DTensor) else None
            s.spec = spec_for(mesh, s.shape) if mesh.ndim == 1 else tp_spec(mesh, dp_dim, s)
        kind = f"{'trainable' if requires_grad else 'frozen'} {str(dtype).removeprefix('torch.')}"
        if cls is not None:
            kind = f"{'trainable' if requires_grad else 'frozen'} {cls.__name__}, auto dtype"
        g = FlatGroup(
            f"unit {name or '<root>'!r} ({kind} parameters)",
            slices,
            numel,
            requires_grad,
            dtype,
            mp.reduce_dtype if mp is not None else torch.float32,
            group,
            timeout,
            state,
        )
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
