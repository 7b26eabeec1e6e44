"""The module side of a sharded model: ``ZeroModule``, mixed into the class of every module
``shard()`` was called on (FSDP2's ``FSDPModule``), and ``Sharded``, what one ``shard()``
call made (its units and groups, the shards nested in it), found by ``sharded(module)``.
Moving the model (``.to``, ``to_empty``) moves its flat buffers; ``load_state_dict(assign=True)``
is put back onto them (``_Reattach``).
"""

from __future__ import annotations

import threading
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ZeroError
from .layout import spec_for
from .tp import local_value

__all__ = ["Sharded", "ZeroModule", "sharded"]


class Sharded:
    """What one ``shard()`` call did: its units and groups, and the shards nested in it."""

    def __init__(self, module, group, units, groups, mixed_precision, mesh, state, children):
        self.module = module
        self.group = group
        self.units = units  # the units with hooks
        self.groups = groups  # the flat groups this call made
        self.mixed_precision = mixed_precision
        self.mesh = mesh
        self.dp_dim = 0  # the mesh dimension sharded over (N-D with tensor parallel: tp.py)
        self.checkpoint_group = None  # DCP's over an N-D mesh (tp.checkpoint_group)
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
    """What ``shard(module)`` made; for what ``torch.compile(model)`` returned, ``model``'s
    (``sharded(m).module`` is then the model itself)."""
    module = getattr(module, "_orig_mod", module)
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
                if mesh.ndim > 1:
                    raise ZeroError(
                        f"{type(self).__name__} is sharded by tracedac.zero with tensor parallel on a "
                        f"{mesh.device_type!r} mesh; moving it to {new.device.type!r} would leave its "
                        "DTensors on a mesh of the other device type. Build the mesh and the model on "
                        "the device you train on, then parallelize and shard."
                    )
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
            cls, type(f"Zero{cls.__name__}", (ZeroModule, cls), {"__module__": cls.__module__})
        )


_ZERO_CLASSES: dict = {}


def _mesh(group, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    kind = device.type
    if kind == "meta":  # built on meta: the mesh is where the collectives will run
        kind = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    return DeviceMesh.from_group(group, kind)


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
                if (
                    isinstance(new, DTensor)
                    and new.device_mesh == s.spec.mesh
                    and new.placements == s.spec.placements
                    and new.to_local().shape == s.local_shape
                ):
                    rows = new.to_local()  # already this rank's Shard(0) rows: no communication
                else:
                    full = new.full_tensor() if isinstance(new, DTensor) else new
                    if full.shape != s.spec.shape:
                        raise ZeroError(
                            f"load_state_dict(assign=True) gave {s.fqn!r} the shape "
                            f"{tuple(full.shape)}; the sharded parameter has {tuple(s.spec.shape)}."
                        )
                    rows = s.rows_of(local_value(s, full), g.rank, g.world)
                s.local(g.local).copy_(rows)
