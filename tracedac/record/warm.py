"""The warm path: a region whose recorded structure repeats runs at about a dispatch mode's cost.

A region call that may be warm pushes a ``WarmMode`` instead of the recorder. It has two
ways to run:

- **Logging** (no template yet for the region's key): every op goes to the region's
  ``TracerMode`` as usual, and the mode writes down beside it what a later call must repeat
  (``template.py``'s events); the region's end builds the template from them
  (``WarmMode.keep``).
- **Warm** (a template found): each op is run and checked against the next event (the op,
  its constants, its tensors by identity, where needed its outputs' storage and geometry),
  and the recorder's actions are repeated with this call's tensors: outside tensors bound to
  their groups, outside storages copied before their first write, generator states kept,
  what the policy keeps held, autograd's saved tensors packed as handles on this call's
  graph (``pack``), labels checked (``label``). The region's end builds the graph a recorded
  call would have left, from the template's and this call's tensors (``finish``), without
  recording or planning anything.

The moment anything differs (another op, another constant, another tensor, a tensor subclass,
an unpack while the region records, a nested region, the end coming early or late), the call
becomes a recorded one: ``fallback.convert`` rebuilds the recorder's state from the events
that matched, bound to this call's tensors, and the recorder goes on from there; nothing
wrong has been kept, since every event is checked before what it made is used.

``tracedac.warm_path(False)`` (``enable`` here; or ``TRACEDAC_WARM=0``) turns the warm path
off: every call records.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

from .decisions import effect
from .graph import Group, Layout, TensorMeta, flatten_outputs
from .handlers import make as make_handlers
from .op_info import _INFO, op_info
from .op_info import storage_address as _address
from .subclasses import has_subclass, is_subclass
from .template import (
    ALIAS,
    CREATED,
    EXACT,
    KEPT,
    MAX_MISSES,
    PLAIN,
    SAME,
    TEMPLATES,
    VIEW,
    FirstSight,
    LabelEvent,
    Opaque,
    OpEvent,
    PackEvent,
    at,
    build,
    check_rest,
    copy_node,
    exact_arguments,
    same,
)
from .tracer import UNRECORDED, RegionMode, _generator, _local
from .undeclared_writes import writes_now

__all__ = ["WarmMode", "enable", "enabled", "stats"]

_Tensor = torch.Tensor
_NO_KWARGS: dict = {}
_SEQUENCES = (list, tuple)
_stats_lock = threading.Lock()
_STATS = {"warm": 0, "fell_back": 0, "templates": 0}


def _from_environment() -> bool:
    value = os.environ.get("TRACEDAC_WARM", "").strip().lower()
    if value in ("", "1", "true", "on"):
        return True
    if value in ("0", "false", "off"):
        return False
    raise ValueError(
        f"TRACEDAC_WARM={value!r} is not a setting tracedac knows: use 1 (the warm path on, the "
        "default) or 0 (every region call records in full), or leave it unset."
    )


_enabled = _from_environment()
# Whether warm calls run the handlers written for each event (``handlers.py``); False checks
# every event with the generic path (``WarmMode._general``): slower, the same checks.
GENERATED = True


def enable(on: bool | None = None) -> bool:
    """Turn the warm path on or off for the process (``None`` leaves it); returns the previous
    setting. Off, every region call records in full, as before the warm path existed.
    (``tracedac.warm_path``; ``TRACEDAC_WARM=0`` starts the process with it off.)"""
    global _enabled
    before = _enabled
    if on is not None:
        if not isinstance(on, bool):
            raise TypeError(f"enable() takes True, False or None, got {on!r}")
        _enabled = on
    return before


def enabled() -> bool:
    return _enabled


def stats() -> dict:
    """Counts since start: region calls run ``warm`` to the end, that ``fell_back`` to a full
    record midway, ``templates`` built, and ``unwarmable: <why>`` per key that records in full
    for good because of what its record did."""
    return dict(_STATS)


def _count(what: str) -> None:
    with _stats_lock:
        _STATS[what] = _STATS.get(what, 0) + 1


_DYNAMIC: dict = {}  # id(op) -> (op, whether its outputs' geometry can depend on values)
_EXACT: dict = {}  # id(op) -> (op, exact_arguments(op))


def _dynamic(func) -> bool:
    known = _DYNAMIC.get(id(func))
    if known is None:
        namespace = getattr(func, "namespace", None)
        value = torch.Tag.dynamic_output_shape in func.tags or namespace not in ("aten", "prims")
        known = _DYNAMIC[id(func)] = (func, value)
    return known[1]


def _exact_of(func) -> tuple:
    known = _EXACT.get(id(func))
    if known is None:
        known = _EXACT[id(func)] = (func, exact_arguments(func))
    return known[1]


def _paths(args, kwargs):
    """(path, tensor) for every tensor argument, inside lists and tuples too."""
    for p, a in enumerate(args):
        if isinstance(a, _Tensor):
            yield (p, None), a
        elif a.__class__ in _SEQUENCES:
            for j, x in enumerate(a):
                if isinstance(x, _Tensor):
                    yield (p, j), x
    for k, a in kwargs.items():
        if isinstance(a, _Tensor):
            yield (k, None), a
        elif a.__class__ in _SEQUENCES:
            for j, x in enumerate(a):
                if isinstance(x, _Tensor):
                    yield (k, j), x


def _written_paths(info, args, kwargs) -> list:
    """(path, tensor) of the tensors ``info``'s op writes in this call."""
    writes = info.writes if info.hidden is None else info.writes + writes_now(info.hidden, args, kwargs)
    out = []
    for pos, name in writes:
        where = pos if pos < len(args) else name
        t = args[pos] if pos < len(args) else kwargs.get(name)
        if isinstance(t, _Tensor):
            out.append(((where, None), t))
        elif t.__class__ in _SEQUENCES:
            out += [((where, j), x) for j, x in enumerate(t) if isinstance(x, _Tensor)]
    return out


def _geometry(t: torch.Tensor, gid, state) -> TensorMeta:
    return TensorMeta(gid, state, t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset())


def _same_geometry(t: torch.Tensor, m: TensorMeta) -> bool:
    return (
        t.dtype is m.dtype
        and t.size() == m.size
        and t.stride() == m.stride
        and t.storage_offset() == m.offset
    )


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A detached alias sharing ``t``'s version counter (``Region.alias``: made above autograd)."""
    with torch._C._DisableTorchDispatch():
        return t.detach()


def _index(items: list, x) -> int | None:
    return next((k for k, y in enumerate(items) if y is x), None)


class _Diverged(Exception):
    """Internal: the call stopped following its template."""


class WarmMode(RegionMode):
    """The dispatch mode of a region call that may run warm. ``entry``: the template cache's
    entry to run (warm), or None (record, and log a template); ``slot``: ``replay.Slot``, the
    handle class (passed in: record/ sits below replay/); ``owner``: ``REBUILDERS``' lookup
    (``region._owner``), or None while there are none."""

    def __init__(self, region, entry, cache_key, slot, owner):
        super().__init__()
        self.region = region  # (the region drops this mode when it ends: no cycle outlives it)
        self.entry = entry
        self.cache_key = cache_key
        self.Slot = slot
        self.owner = owner
        self.tracer = region.tracer
        template = entry.template if entry is not None else None
        self.template = template
        self.unwarmable = None  # why this call's record cannot make a template (logging)
        self.i = 0
        if template is None:
            self.cold = self.tracer  # recording; every op goes to the recorder
            self.events = self.handlers = ()
            self.log = []
            self.ids: dict = {}
            self.refs: list = []
            self.vid_gid: list = []  # per vid, the group of its storage (known after its event)
            self.pending: list = []  # (group id, tensor) held during the current event
            self.packs_since: list = []  # handles packed since the last recorded node
            return
        self.cold = None
        self.log = None
        self.events = template.events
        self.handlers = template.handlers if GENERATED else ()  # (none: every event through _general)
        self.n_events = len(template.events)
        self.i = 0
        self.vals = [None] * template.n_vids  # vid -> the tensor, from its first sight to its last use
        self.addr: dict = {}  # storage address -> group id, for the outside tensors bound so far
        self.seen: dict = {}  # storage address -> vids on it, of tensors looked at (``_group_at``)
        self.scanned = 0  # vids below this were looked at
        self.ext: dict = {}  # group id -> the outside tensor bound to it
        self.snap: dict = {}  # group id -> its storage copied before the region first wrote it
        self.held: dict = {}  # group id -> the tensor held for it (the program's, or a detached alias)
        self.raw: dict = {}  # group id -> the program's tensor held for it (``Region.raw_held``)
        self.rngs: dict = {}  # node index -> (generator, state before, node it follows or None)
        self.rng_last: dict = {}  # generator -> (index of its last random node, state after)
        self.labels: list = []  # (node index, label) given in this call, in order
        self.last_packs: list = []  # (slot, tensor) packed since the last recorded node
        self.settling: list = []  # (slot, tensor, its version, meta after) to settle at the next node
        self.graph = region.graph
        self.kept = region.kept

    # -- warm: the op ----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # The next event's own handler (``handlers.py``): the fast path's checks, written for
        # that event. Past the last event, and in a recorded call (no handlers), ``_slow``.
        try:
            h = self.handlers[self.i]
        except IndexError:
            return self._slow(func, types, args, kwargs)
        return h(self, func, types, args, kwargs)

    def _bind_args(self, first, args) -> bool:
        """Bind the tensors first seen at a fast-path event (all positional)."""
        bound = []
        try:
            for f in first:
                self._bind(f, args[f.path[0]], bound)
        except _Diverged:
            self._unbind(bound)
            return False
        return True

    def _undo(self, e: OpEvent, func, types, args, kwargs):
        """A fast-path event that bound first sights, then differed: unbind them, diverge."""
        if e.first:
            self._unbind_event(e)
        return self._diverge(func, types, args, kwargs)

    def _unbind_event(self, e: OpEvent) -> None:
        for f in reversed(e.first):
            if f.store:
                self.vals[f.vid] = None
            if f.new and f.layout is None:
                x = self.ext.pop(f.gid, None)
                if x is not None:
                    del self.addr[_address(x)]

    def _output(self, e: OpEvent, out, args) -> bool:
        """A single output on a storage the region knows: the one the template says."""
        if type(out) is not _Tensor:
            return False
        if e.what == ALIAS:
            return self._alias_of(e, out, e.gid, args)
        return out is self.vals[e.vid]  # SAME: the very tensor (an in-place op's self)

    def _alias_of(self, e: OpEvent, o, gid, args) -> bool:
        """Whether ``o`` (a result of ``e`` that shares a storage) is on group ``gid``'s storage:
        the argument's it shared in the template (``_unsafe_view``'s self), or found by storage."""
        a = _address(o)
        p = e.alias_arg
        if p is not None and p < len(args) and isinstance(args[p], _Tensor):
            return a == _address(args[p])
        return self._group_at(a, self.i - 1) == gid  # (the op ran: its event is the last one)

    def _group_at(self, a, i: int):
        """The group of the storage at address ``a``, among the storages this call holds a tensor
        of (outside tensors, tensors a later event reads, results held: a kept handle's tensor
        is an outside one or a held result's alias); None if none is there. No address is taken
        as an op runs: a first sight (rare: inputs, weights) asks, and each tensor's address is
        taken once, by the first sight after it. ``i``: the event being checked."""
        gid = self.addr.get(a)
        if gid is not None:
            return gid
        vals, seen, vid_gid = self.vals, self.seen, self.template.vid_gid
        upto = self.events[i].vids
        for v in range(self.scanned, upto):  # the tensors registered since the last first sight
            x = vals[v]
            if x is not None and vid_gid[v] is not None:
                k = _address(x)
                known = seen.get(k)
                if known is None:
                    seen[k] = [v]
                else:
                    known.append(v)
        if upto > self.scanned:
            self.scanned = upto
        for v in seen.get(a, ()):
            if vals[v] is not None:  # (one still held: its storage, this group's, is alive)
                return vid_gid[v]
        for gid, x in self.held.items():
            if _address(x) == a:
                return gid
        return None

    def _slow(self, func, types, args, kwargs):
        cold = self.cold
        if cold is not None:  # a recorded call (logging, or fallen back)
            if self.log is None:
                return cold.__torch_dispatch__(func, types, args, kwargs)
            return self._logged(func, types, args, kwargs)
        if UNRECORDED[0] and _local.__dict__.get("unrecorded"):  # replaying another region's handle
            return func._op(*args, **(kwargs or _NO_KWARGS))
        i = self.i
        if i >= self.n_events:
            return self._other(func, types, args, kwargs)
        e = self.events[i]
        if func is not e.op or (types and has_subclass(types)):
            return self._other(func, types, args, kwargs)
        return self._general(e, func, types, args, kwargs)

    def _general(self, e: OpEvent, func, types, args, kwargs):
        """An event off the fast path: keyword arguments, lists of tensors, first sights,
        writes into outside tensors, random ops, outputs whose geometry is checked."""
        kwargs = kwargs or _NO_KWARGS
        vals = self.vals
        bound = []
        try:
            if len(args) != e.nargs:
                raise _Diverged
            for p, c in e.consts:
                a = args[p]
                if a is not c and (isinstance(a, _Tensor) or a != c):
                    raise _Diverged
            for p, c in e.strict:
                if not same(args[p], c):
                    raise _Diverged
            for f in e.first:
                self._bind(f, at(args, kwargs, f.path), bound)
            for p, v in e.targs:
                if args[p] is not vals[v]:
                    raise _Diverged
            if (e.rest is None and kwargs) or (e.rest is not None and not check_rest(e, args, kwargs, vals)):
                raise _Diverged
        except (_Diverged, IndexError, KeyError, TypeError):
            self._unbind(bound)
            return self._diverge(func, types, args, kwargs)
        self.i += 1
        if e.settle:
            self._settle()
        for path, gid in e.snap:  # an outside storage about to be written for the first time
            with torch._C._DisableTorchDispatch():
                self.snap[gid] = at(args, kwargs, path).untyped_storage().clone()
        rng = None
        if e.seeded:
            gen = _generator(args, kwargs)
            state = gen.get_state()
            last = self.rng_last.get(gen)
            with torch._C._DisableTorchDispatch():
                follows = last[0] if last is not None and torch.equal(last[1], state) else None
            rng = (gen, state, follows)
        try:
            out = e.run(*args, **kwargs)
        except BaseException:
            self._raised(self.i - 1, e)
            raise
        flat = (out,) if isinstance(out, _Tensor) else flatten_outputs(out)
        if len(flat) != len(e.outs) or not self._outputs(e, flat, args):
            return self._after(e, func, args, kwargs, out, rng)
        if rng is not None:
            self.rngs[e.node] = rng
            self.rng_last[rng[0]] = (e.node, rng[0].get_state())
        for v in e.drop:
            vals[v] = None
        if e.holds:
            self._hold(e.holds, args, kwargs, flat, None)
        if e.settles:  # autograd bumps a written tensor's version after this returns
            packs = self.last_packs
            self.settling = [(packs[k][0], packs[k][1], packs[k][1]._version, m) for k, m in e.settles]
        if e.reset:
            self.last_packs = []
        return out

    def _settle(self) -> None:
        """``TracerMode.settle_packed``: a handle takes the state after its op's write unless
        that write bumped the tensor's version counter (then eager's backward would refuse it)."""
        for slot, t, version, after in self.settling:
            if t._version == version:
                slot.meta = after
        self.settling = []

    def _outputs(self, e: OpEvent, flat, args) -> bool:
        """Check the outputs against the event, then register them; False (nothing
        registered) where they differ."""
        vals = self.vals
        created = []
        node_outputs = self.template.nodes[e.node].outputs if e.dynamic and e.node >= 0 else None
        for k, (o, spec) in enumerate(zip(flat, e.outs)):
            if spec is None:
                if isinstance(o, _Tensor):
                    return False
                continue
            if type(o) is not _Tensor:
                return False
            vid, what, gid, store = spec
            if (
                node_outputs is not None
                and node_outputs[k] is not None
                and not _same_geometry(o, node_outputs[k])
            ):
                return False
            if what == CREATED:
                if e.dynamic:  # (outside aten and prims: an op that may hand back a storage it read)
                    a = _address(o)
                    if self._group_at(a, self.i - 1) is not None or a in created:
                        return False
                    created.append(a)
            elif what == ALIAS:
                if not self._alias_of(e, o, gid, args):
                    return False
            elif what == SAME:
                if o is not vals[vid]:
                    return False
        if e.dynamic and e.node < 0:
            return False  # (an op whose outputs depend on values made no node: never in a template)
        for o, spec in zip(flat, e.outs):
            if spec is not None and spec[3]:
                vals[spec[0]] = o
        return True

    def _bind(self, f: FirstSight, t, bound: list) -> None:
        """Check a first sight and bind it (``bound`` collects what to undo on a later failure)."""
        if type(t) is not f.cls and (not isinstance(t, _Tensor) or is_subclass(t)):
            raise _Diverged
        lay = f.layout
        try:
            if lay is not None:  # a layout-only argument: its layout is all the op reads
                if not (
                    t.dtype is lay.dtype
                    and t.size() == lay.size
                    and t.stride() == lay.stride
                    and t.device == lay.device
                ):
                    raise _Diverged
            else:
                m = f.meta
                if not (
                    t.dtype is m.dtype
                    and t.size() == m.size
                    and t.stride() == m.stride
                    and t.storage_offset() == m.offset
                    and t.device == f.device
                ):
                    raise _Diverged
                if m.dtype.is_complex and (t.is_conj() or t.is_neg()):
                    raise _Diverged  # (a lazy bit the recorder refuses: it does, once recording)
                a = _address(t)
                if f.new:
                    if self._group_at(a, self.i) is not None:
                        raise _Diverged  # the template saw a storage new to the region here
                    self.addr[a] = f.gid
                    self.ext[f.gid] = t
                    bound.append((a, f.gid))
                elif self._group_at(a, self.i) != f.gid:
                    raise _Diverged
        except (RuntimeError, NotImplementedError):  # (no strides, no storage: not strided)
            raise _Diverged from None
        if f.store:
            self.vals[f.vid] = t
            bound.append((None, f.vid))

    def _unbind(self, bound: list) -> None:
        for a, x in reversed(bound):
            if a is None:
                self.vals[x] = None
            else:
                del self.addr[a]
                del self.ext[x]

    def _hold(self, holds, args, kwargs, flat, labelled) -> None:
        held, raw = self.held, self.raw
        for (where, k), gid in holds:
            t = flat[k] if where == "out" else labelled if where == "label" else at(args, kwargs, k)
            held[gid] = raw[gid] = t

    def _other(self, func, types, args, kwargs):
        """An op that is not the next event: run bare if it is no event at all, else diverge."""
        if not (types and has_subclass(types)):
            info = _INFO.get(id(func))
            info = info[1] if info is not None else op_info(func)
            if info.bare:  # returns no tensor and writes none (sym_size, item): never an event
                return func._op(*args, **(kwargs or _NO_KWARGS))
        return self._diverge(func, types, args, kwargs)

    # -- warm: leaving it --------------------------------------------------------------------
    def _diverge(self, func, types, args, kwargs):
        """The op has not run and is not the one expected: record from here on."""
        self.fall_back()
        return self.cold.__torch_dispatch__(func, types, args, kwargs)

    def _after(self, e: OpEvent, func, args, kwargs, out, rng):
        """The op ran and its outputs are not the template's (another shape, another storage):
        record from the events before it, then record it with what it returned."""
        from .fallback import record_ran

        self.fall_back(extra=e)
        return record_ran(self.cold, func, args, kwargs or _NO_KWARGS, out, rng)

    def _raised(self, i: int, e: OpEvent | None = None) -> None:
        """Event ``i``'s op raised (the program may catch it and go on): the recorder records
        nothing for an op that raised, so neither does the call, which records from here
        (with the tensors first seen at it: the recorder registers them before the op runs)."""
        self.i = i
        self.fall_back(extra=e if e is not None and e.first else None)

    def fall_back(self, extra: OpEvent | None = None) -> None:
        """Become a recorded call: the recorder's state rebuilt from the events that matched
        (and ``extra``'s first sights, bound before its op ran)."""
        from .fallback import convert

        _count("fell_back")
        entry, (key, name) = self.entry, self.cache_key
        entry.misses += 1
        if name is None:  # the shared template: this region records one of its own next time
            own = (key, self.region.graph.name)
            if TEMPLATES.get(own) is None:
                TEMPLATES.put(own, None)
        else:
            entry.template = None  # its own: the next call records it again
        if entry.misses >= MAX_MISSES:
            entry.cold = True
            entry.template = None
        i = self.i if extra is None else self.i - 1
        convert(self, self.region, i, extra)
        self.cold = self.tracer
        self.log = None
        self.vals = None
        self.events = self.handlers = ()  # (every op and pack takes the slow path to the recorder now)

    def running(self) -> bool:
        """Whether the call still follows its template."""
        return self.cold is None

    # -- warm: what autograd saves, labels ----------------------------------------------------
    def pack(self, t):
        """What autograd saves in a region that may run warm (``saved_tensors_hooks``' pack)."""
        i = self.i
        try:
            e = self.events[i]
        except IndexError:
            return self._pack_slow(t)
        if e.__class__ is not PackEvent or e.vid < 0 or t is not self.vals[e.vid]:
            return self._pack_slow(t)
        if e.outside and (self.owner is not None or e.owned is not None):
            return self._pack_slow(t)
        self.i = i + 1
        slot = self.Slot(self.graph, e.meta) if e.kind == PLAIN else self._kept_slot(e, t)
        for v in e.drop:
            self.vals[v] = None
        self.last_packs.append((slot, t))
        return slot

    def _kept_slot(self, e: PackEvent, t):
        if e.kind == EXACT:  # an input as it came, kept as eager keeps it
            slot = self.Slot(self.graph, e.meta, t, exact=True)
        else:  # a result the policy keeps: a detached alias (``Region._pack``)
            a = _alias(t)
            gid = e.meta.group
            held = self.held
            h = held.get(gid)
            if h is t or h is None:
                held[gid] = a
            slot = self.Slot(self.graph, e.meta, a)
        self.kept.append(slot)
        return slot

    def _packed(self, e: PackEvent, t):
        slot = self.Slot(self.graph, e.meta) if e.kind == PLAIN else self._kept_slot(e, t)
        for v in e.drop:
            self.vals[v] = None
        self.last_packs.append((slot, t))
        return slot

    def _pack_slow(self, t):
        if self.cold is not None:  # a recorded call
            if self.log is not None:
                return self.logged_pack(t)
            return self.region._pack(t)
        i = self.i
        e = self.events[i] if i < self.n_events else None
        if e.__class__ is not PackEvent or (type(t) is not _Tensor and is_subclass(t)):
            self.fall_back()
            return self.region._pack(t)
        bound = []
        try:
            if e.first is not None:
                self._bind(e.first, t, bound)
            elif t is not self.vals[e.vid]:
                raise _Diverged
            if e.outside and (self.owner is not None or e.owned is not None):
                if (self.owner is not None and self.owner(t) is not None) != bool(e.owned):
                    raise _Diverged  # a REBUILDERS owner claims it now and did not then, or the reverse
        except _Diverged:
            self._unbind(bound)
            self.fall_back()
            return self.region._pack(t)
        self.i = i + 1
        return self._packed(e, t)

    def label(self, t: torch.Tensor, label: str) -> bool:
        """``tracedac.name(t, label)`` in a warm call: True if it is the label the template
        expects (and what the recorder held then is held); False after falling back."""
        i = self.i
        e = self.events[i] if i < self.n_events else None
        if (
            e.__class__ is not LabelEvent
            or e.label != label
            or e.first is not None
            or t is not self.vals[e.vid]
        ):
            self.fall_back()
            return False
        self.i = i + 1
        if e.node >= 0:
            self.labels.append((e.node, label))
        if e.holds:
            self._hold(e.holds, (), _NO_KWARGS, (), t)
        for v in e.drop:
            self.vals[v] = None
        return True

    def unpacking(self) -> None:
        """A handle of this region is unpacked while it records (``torch.autograd.grad`` inside
        it): replay needs the recorded graph, so a warm call records from here; a logging
        call's record makes no template."""
        if self.cold is None:
            self.fall_back()
        elif self.log is not None:
            self.unwarmable = "a handle was unpacked while the region recorded"

    def nested(self) -> None:
        """A region starts inside this one: it reads this one's recorded groups
        (``Region.can_rebuild``), so a warm call records from here on."""
        if self.cold is None:
            self.fall_back()
        elif self.log is not None:
            self.unwarmable = "a region ran inside it"

    # -- warm: the end -----------------------------------------------------------------------
    def finish(self, region) -> bool:
        """Build the graph a recorded call would leave (``Region._finish`` then ``_release``)
        from the template and this call's tensors; False (after falling back) where the end is
        not the template's: the region then finishes as a recorded call."""
        if self.cold is not None:
            return False
        t = self.template
        graph = region.graph
        if self.settling:
            self._settle()
        changed = [s for s in region.kept if s.changed]
        # The handles replay is to rebuild: the template's (the same meta objects, handed to
        # this call's handles by its pack events), or the plan would not be the template's.
        wanted = {s.meta for s in graph.slots()}
        wanted.update(s.meta for s in changed)
        if self.i != self.n_events or wanted != t.wanted_metas or not self._owners_agree(t):
            self.fall_back()
            return False
        for s in changed:
            graph.add_slot(s)
        nodes = list(t.released)
        if t.random:
            needed = t.needed
            for i in t.random:
                gen, state, follows = self.rngs[i]
                rng = (gen, None, follows) if follows in needed else (gen, state, None)
                nodes[i] = copy_node(t.nodes[i], rng)
        groups = list(t.shared)
        ext, held = self.ext, self.held
        first = self.first_addresses() if ext else None
        for gid, kind, nbytes, device, creator, mutations in t.own:
            g = Group(gid, nbytes, device)
            if creator is not None:
                g.creator = nodes[creator] if creator.__class__ is int else creator
            if mutations:
                g.mutations = [nodes[m] if m.__class__ is int else m for m in mutations]
            if kind == "external":
                x = g.external = ext[gid]
                g.version = x._version
                g.address = first.get(gid)
            elif kind == "held":
                h = held[gid]
                if h is self.raw.get(gid):
                    h = _alias(h)
                g.held = h
                g.version = h._version
            elif kind == "snapshot":
                g.snapshot = self.snap[gid]
            elif kind == "outer":
                x = ext[gid]
                g.outer = self.owner(x).handle(x)
            groups[gid] = g
        graph.nodes = nodes
        graph.groups = groups
        region.kept = []
        _STATS["warm"] += 1
        self.entry.misses = 0
        self.close()
        return True

    def first_addresses(self) -> dict:
        """Group id -> the storage address its outside tensor had at its first sight in this
        call (what replay checks the tensor's storage against: one swapped in since, even
        within the region, is refused there rather than read)."""
        return {g: a for a, g in self.addr.items()}

    def _owners_agree(self, t) -> bool:
        """Whether ``REBUILDERS`` claim the same outside tensors the template's end saw claimed."""
        if self.owner is None and not t.outer:
            return True
        for gid, kind, *_ in t.own:
            if kind == "outer" or (kind == "external" and self.owner is not None):
                x = self.ext.get(gid)
                owned = x is not None and self.owner is not None and self.owner(x) is not None
                if owned != (kind == "outer"):
                    return False
        return True

    def close(self) -> None:
        """Let go of everything of this call (the region ended or raised). The mode outlives the
        region (autograd keeps the pack hook, ``self.pack``, with every tensor it saved, until
        backward), so nothing of the call stays on it: no tensor, generator state, handle or
        graph, not even its attributes (a recorded region's hook is a small function)."""
        self.__dict__.clear()

    # -- logging: a recorded call writes down its events ---------------------------------------
    def _known(self, t) -> int | None:
        v = self.ids.get(id(t))
        return v if v is not None and self.refs[v]() is t else None

    def _read(self, t) -> int | None:
        """``t``'s vid where an op reads its values, or None: seen so far only where its
        layout was all an op read (``empty_like``'s self), it has no group yet, and the recorder
        makes it one here: a first sight, for the template."""
        v = self._known(t)
        return v if v is None or self.vid_gid[v] is not None else None

    def _new_vid(self, t, gid=None) -> int:
        v = len(self.refs)
        self.ids[id(t)] = v
        self.refs.append(weakref.ref(t))
        self.vid_gid.append(gid)
        return v

    def _first(self, t, path, layout_only: bool) -> FirstSight:
        v = self._new_vid(t)
        if layout_only:
            return FirstSight(v, path, None, False, None, t.device, layout=Layout(t), cls=type(t))
        g = self.tracer.group_of(t)
        if g is None:  # new to the region: the recorder makes its group while recording the op
            return FirstSight(v, path, None, True, _geometry(t, None, 0), t.device, cls=type(t))
        self.vid_gid[v] = g.id
        return FirstSight(v, path, g.id, False, _geometry(t, g.id, len(g.mutations)), t.device, cls=type(t))

    def _resolve_first(self, f: FirstSight, t) -> bool:
        """After the op: the group the recorder made for a storage first seen (False if none)."""
        if f.layout is not None or not f.new:
            return True
        g = self.tracer.group_of(t)
        if g is None or g.creator is not None:
            return False
        m = f.meta
        f.gid = self.vid_gid[f.vid] = g.id
        f.meta = TensorMeta(g.id, 0, m.dtype, m.size, m.stride, m.offset)
        return True

    def _spec(self, a, path, exact: bool, firsts: list, pending: list):
        if isinstance(a, _Tensor):
            v = self._read(a)
            if v is not None:
                return ("T", v)
            f = self._first(a, path, False)
            firsts.append(f)
            pending.append((f, a))
            return ("F",)
        if a.__class__ in _SEQUENCES and any(isinstance(x, _Tensor) for x in a):
            return (
                "L",
                type(a),
                tuple(self._spec(x, (path[0], j), exact, firsts, pending) for j, x in enumerate(a)),
            )
        return ("C", a, exact and not isinstance(a, _Tensor))

    def _logged(self, func, types, args, kwargs):
        tracer = self.tracer
        if _local.__dict__.get("unrecorded"):
            return tracer.__torch_dispatch__(func, types, args, kwargs)
        if types and has_subclass(types):
            self.unwarmable = "an op on a tensor subclass"
            return tracer.__torch_dispatch__(func, types, args, kwargs)
        info = _INFO.get(id(func))
        info = info[1] if info is not None else op_info(func)
        if info.bare:
            return tracer.__torch_dispatch__(func, types, args, kwargs)
        kw = kwargs or _NO_KWARGS
        graph = tracer.graph
        n_nodes, n_groups = len(graph.nodes), len(graph.groups)
        exact_pos, exact_kw = _exact_of(func)
        targs, consts, strict, rest_pos, firsts, pending = [], [], [], [], [], []
        for p, a in enumerate(args):
            if isinstance(a, _Tensor):
                v = self._known(a) if info.layout_only and p == 0 else self._read(a)
                if v is not None:
                    targs.append((p, v))
                else:
                    f = self._first(a, (p, None), info.layout_only and p == 0)
                    firsts.append(f)
                    pending.append((f, a))
            elif a.__class__ in _SEQUENCES and any(isinstance(x, _Tensor) for x in a):
                rest_pos.append((p, self._spec(a, (p, None), False, firsts, pending)))
            elif p < len(exact_pos) and exact_pos[p]:
                consts.append((p, a))
            elif isinstance(a, torch.ScriptObject) and effect(func) is not None:
                strict.append((p, Opaque(a._type().qualified_name())))  # (never replayed: kept)
            else:
                strict.append((p, a))
        keywords = {k: self._spec(a, (k, None), k in exact_kw, firsts, pending) for k, a in kw.items()}
        written = _written_paths(info, args, kw) if (info.writes or info.hidden is not None) else []
        self.pending = []
        out = tracer.__torch_dispatch__(func, types, args, kwargs)
        node = graph.nodes[n_nodes] if len(graph.nodes) > n_nodes else None
        for f, a in pending:
            if not self._resolve_first(f, a):
                self.unwarmable = f"{func} read a tensor the recorder did not register"
        flat = (out,) if isinstance(out, _Tensor) else flatten_outputs(out)
        outs = []
        alias_arg = None
        for o in flat:
            if not isinstance(o, _Tensor):
                outs.append(None)
                continue
            v = self._known(o)
            if v is not None:
                outs.append((v, SAME, None))
                continue
            g = tracer.group_of(o)
            v = self._new_vid(o, None if g is None else g.id)
            if info.view:
                outs.append((v, VIEW, None))
            elif g is None:
                self.unwarmable = f"{func} returned a tensor the recorder did not register"
                outs.append((v, VIEW, None))
            elif node is not None and g.creator is node:
                outs.append((v, CREATED, g.id))
            else:
                outs.append((v, ALIAS, g.id))
                if len(flat) == 1:  # the argument it shares a storage with (``_unsafe_view``'s self)
                    a = _address(o)
                    alias_arg = next(
                        (p for p, x in enumerate(args) if isinstance(x, _Tensor) and _address(x) == a), None
                    )
        snaps = []
        if node is not None:
            for path, t in written:
                g = tracer.group_of(t)
                if g is not None and g.creator is None and len(g.mutations) == 1 and g.mutations[0] is node:
                    if all(s[1] != g.id for s in snaps):
                        snaps.append((path, g.id))
        settles = ()
        if node is not None:
            if tracer._written:  # (this node's: the last node's were settled when it was recorded)
                packs = self.packs_since
                settles = tuple((_index(packs, slot), after) for slot, _, _, after in tracer._written)
                if any(k is None for k, _ in settles):  # (a handle no pack event made: a subclass's)
                    self.unwarmable = f"{func} wrote a tensor saved in a way the template cannot repeat"
                    settles = ()
            self.packs_since = []
        if any(g.grows for g in graph.groups[n_groups:]):
            self.unwarmable = f"{func} grew a storage in place"
        e = OpEvent(
            func,
            info.run if info.view else func._op,
            len(args),
            tuple(targs),
            tuple(consts),
            tuple(strict),
            (tuple(rest_pos), keywords) if rest_pos or keywords else None,
            tuple(firsts),
            tuple(outs),
            -1 if node is None else node.index,
            tuple(snaps),
            info.seeded and node is not None,
            not info.view and _dynamic(func),
        )
        e.holds = self._sources(self.pending, args, kw, flat, None)
        e.n_nodes, e.n_groups = n_nodes, n_groups
        e.settles = settles
        e.alias_arg = alias_arg
        # 0: a tensor; 1: a flat list or tuple (the fast path indexes it); 2: anything else
        # (nested, or no tensor at all: ``_foreach_mul_`` returns None), the slow path
        if isinstance(out, _Tensor):
            e.seq = 0
        else:
            e.seq = 1 if out.__class__ in _SEQUENCES and len(flat) == len(out) else 2
        if info.seeded and node is None:
            self.unwarmable = f"{func} drew random numbers and made no node"
        self.log.append(e)
        return out

    def _sources(self, pending, args, kwargs, flat, labelled) -> tuple:
        """Where each tensor the recorder held during an event came from."""
        holds = []
        for gid, t in pending:
            where = None
            if t is labelled:
                where = ("label", None)
            else:
                for k, o in enumerate(flat):
                    if o is t:
                        where = ("out", k)
                        break
                else:
                    for path, a in _paths(args, kwargs):
                        if a is t:
                            where = ("arg", path)
                            break
            if where is None:
                self.unwarmable = "the recorder held a tensor the event did not see"
                continue
            holds.append((where, gid))
        self.pending = []
        return tuple(holds)

    def held_now(self, group, tensor) -> None:
        """``Region.hold`` while logging: what the recorder holds, and from which tensor."""
        self.pending.append((group.id, tensor))

    def logged_pack(self, t):
        region = self.region
        graph = self.tracer.graph
        n_nodes, n_groups = len(graph.nodes), len(graph.groups)
        plain = type(t) is _Tensor or not is_subclass(t)
        v = self._read(t) if plain else None
        first = self._first(t, None, False) if plain and v is None else None
        slot = region._pack(t)
        if not isinstance(slot, self.Slot) or slot.host is not None:
            self.unwarmable = "autograd saved a tensor subclass, or an offloaded result"
            return slot
        if first is not None and not self._resolve_first(first, t):
            self.unwarmable = "autograd saved a tensor the recorder did not register"
        kind = EXACT if slot.exact else KEPT if slot.tensor is not None else PLAIN
        m = slot.meta
        g = graph.groups[m.group]
        outside = g.creator is None and not g.mutations
        owned = None
        if self.owner is not None and outside:
            owned = self.owner(t) is not None
        e = PackEvent(v, first, kind, m, owned, outside)
        e.n_nodes, e.n_groups = n_nodes, n_groups
        self.log.append(e)
        self.packs_since.append(slot)
        return slot

    def logged_label(self, t, label: str, run) -> None:
        """``tracedac.name`` while logging: ``run()`` labels as the recorder does."""
        graph = self.tracer.graph
        n_nodes, n_groups = len(graph.nodes), len(graph.groups)
        v = self._known(t)
        self.pending = []
        node = run()
        if v is None:
            self.unwarmable = "a label on a tensor no op made or read"
            return
        e = LabelEvent(v, None, label, -1 if node is None else node.index)
        e.holds = self._sources(self.pending, (), _NO_KWARGS, (), t)
        e.n_nodes, e.n_groups = n_nodes, n_groups
        self.log.append(e)

    def keep(self, region, plan, kept_groups: set) -> None:
        """At a logging call's end, before its graph is released: build its template and cache
        it, unless something it did cannot be repeated warm (then its key records in full from
        now on), or its planner planned only now (the next call, deciding from the cached plan
        as every later one will, makes the template)."""
        if self.log is None:
            return
        graph = region.graph
        why = self.unwarmable
        if why is None and region.offloads:
            why = "it offloads"
        if why is None and any(g.grows for g in graph.groups):
            why = "a write grew a storage"
        if why is not None:
            TEMPLATES.put(self.cache_key, None).cold = True
            _count(f"unwarmable: {why}")
            return
        planning = region.planning
        if planning is not None and (planning.planned_now or planning.cached is None):
            return
        metas = [s.meta for s in graph.slots()]  # (the kept ones it modified included: _finish added them)
        t = build(self.log, self.vid_gid, graph, plan.starts, plan.nodes, kept_groups, metas)
        t.plan_entry = planning.cached if planning is not None else None
        t.handlers = make_handlers(t.events)
        TEMPLATES.put(self.cache_key, t)
        _count("templates")
