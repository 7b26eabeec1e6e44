"""A region's template: what a call whose recorded structure repeats must do, and check.

The first call of a region records in full (``tracer.py``) and, beside it, writes down its
*events* (``warm.py``'s log): every op it dispatched, views included, every tensor autograd
saved, every ``tracedac.name`` label. When it ends, ``build`` turns them and the finished
graph into a ``Template``, cached under the region's key (``key``): later calls with that key
run the template (``warm.py``) instead of recording, checking at each event that the program
still does what the template says, and fall back to a full record (``fallback.py``) the
moment it does not.

What an event checks, and why that is enough (docs/design.md, "The warm path"):

- **The op** (identity of the ``OpOverload``) and **its constants** (every non-tensor
  argument, compared as values; floats and Scalars also by type and the sign of zero).
- **The dataflow**: each tensor argument is the very tensor object the template says
  (``vid``, numbered in order of first sight), held by the warm call from the event that made
  it to its last use in the template, never longer: a view is an op like any other, so a
  tensor's geometry follows from the ops and constants that made it, as its storage does.
- **First sights**: a tensor no event made (an input, a parameter, a tensor made without an
  op) is checked for what the recorder would see: its storage new to the region (an outside
  tensor, bound to its group for this call) or the very group the template says, and its
  geometry and device.
- **Outputs** where the ops do not fix them: whether each result is a new storage or an alias
  of a known one (every op), and its geometry where it depends on values (ops tagged
  ``dynamic_output_shape``, and ops outside ``aten``/``prims``).

Events hold no tensor of any call: only ops, constants, numbers, and the ``TensorMeta`` /
``Layout`` the recorder made (shapes and dtypes).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from .graph import Group, Node

__all__ = [
    "FirstSight",
    "LabelEvent",
    "OpEvent",
    "PackEvent",
    "Template",
    "TEMPLATES",
    "same",
]

# What an op's tensor output is, in the event that made it.
VIEW, CREATED, ALIAS, SAME = 0, 1, 2, 3
VIEWS = 4  # (an event's ``what``: several outputs, all views)
# What a saved tensor's handle is (``Region._pack``): the input itself (as eager keeps it), a
# detached alias of a result the policy keeps, or nothing (rebuilt by replay).
EXACT, KEPT, PLAIN = 0, 1, 2

# Schema types whose values reach a dispatch mode normalized (an ``int`` is always a Python
# int, a ``bool`` a bool), so ``==`` compares them exactly. Any other constant (a float, a
# Scalar, which may be an int or a float, a list of them) is compared by ``same``.
_EXACT_KINDS = frozenset(
    [
        torch._C.IntType.get().kind(),
        torch._C.SymIntType.get().kind(),
        torch._C.BoolType.get().kind(),
        torch._C.StringType.get().kind(),
        torch._C.DeviceObjType.get().kind(),
        "ScalarTypeType",
        "LayoutType",
        "MemoryFormatType",
        "GeneratorType",
        "NoneType",
    ]
)


def _exact(t) -> bool:
    """Whether constants of schema type ``t`` compare exactly with ``==``."""
    kind = t.kind()
    if kind in ("ListType", "OptionalType"):
        return _exact(t.getElementType())
    return kind in _EXACT_KINDS


def exact_arguments(op) -> tuple:
    """(positional flags, keyword names) of the arguments of ``op`` compared with ``==``."""
    args = op._schema.arguments
    return tuple(_exact(a.type) for a in args), frozenset(a.name for a in args if _exact(a.type))


class Opaque:
    """A constant a warm call cannot compare, checked by its type only: a TorchScript object
    an op with an effect takes (``c10d::allreduce_``'s process group and ``ReduceOp``, wrapped
    anew at every call, which neither compare nor serialize). Only where the op is never
    replayed (a collective, kept under every policy a warm region may have:
    ``decisions.effect``), so what it computed is kept, never computed again with this."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def matches(self, a) -> bool:
        return isinstance(a, torch.ScriptObject) and a._type().qualified_name() == self.name


def same(a, b) -> bool:
    """Whether two constants mean the same to an op: equal, of the same type (``2`` and ``2.0``
    are different Scalars), floats with the same sign of zero (``x * -0.0`` and ``x * 0.0``
    differ), any two NaNs alike; lists and tuples element by element."""
    if a is b:
        return True
    t = type(a)
    if t is not type(b):
        return type(b) is Opaque and b.matches(a)
    if t is float:
        if a != a:
            return b != b
        return a == b and (a != 0.0 or math.copysign(1.0, a) == math.copysign(1.0, b))
    if t is complex:
        return same(a.real, b.real) and same(a.imag, b.imag)
    if t is list or t is tuple:
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return False  # a tensor is never a constant: the event checks it by identity
    try:
        return bool(a == b)
    except Exception:  # (an object that cannot say: a process group's option, say) differs
        return False


class FirstSight:
    """A tensor no earlier event made, seen at this event: ``gid`` is the group of its storage,
    ``new`` whether that storage is new to the region (an outside tensor, bound to ``gid`` for
    the call) or one the template knows (a tensor made without an op, such as ``t.data``);
    ``meta`` its geometry; ``layout`` instead for an argument whose values the op never reads
    (``empty_like``'s self), of which only the layout counts."""

    __slots__ = ("vid", "path", "gid", "new", "meta", "device", "layout", "store", "cls")

    def __init__(self, vid, path, gid, new, meta, device, layout=None, cls=torch.Tensor):
        self.vid = vid
        self.path = path  # (position or keyword, index in a list or None)
        self.gid = gid
        self.new = new
        self.meta = meta  # TensorMeta (group, state, dtype, size, stride, offset), or None
        self.device = device
        self.layout = layout  # a Layout, for a layout-only argument (gid None)
        self.store = False  # whether a later event uses it (set by ``build``)
        self.cls = cls  # its class (a plain tensor, a Parameter): another one is checked again


class OpEvent:
    """One dispatched op. ``targs``/``consts``/``strict``: the positional arguments checked on
    the fast path (tensors by identity, constants by ``==`` or ``same``); ``rest``: what else
    there is (keyword arguments, lists holding tensors), checked by ``check_rest``; ``first``:
    tensors first seen here; ``outs``: per flattened output, ``None`` (not a tensor) or
    ``(vid, what, gid)`` with ``what`` one of VIEW, CREATED (a new storage: group ``gid``),
    ALIAS (on group ``gid``'s storage), SAME (the object ``vid`` already is); ``node``: the
    index of the node it recorded, or -1; ``snap``: ``(path, gid)`` of outside storages to copy
    before their first write; ``holds``: ``(where, gid)`` of the tensors the recorder held for
    backward after it (``("out", k)`` or ``("arg", path)``); ``drop``: vids whose last use this
    is; ``n_nodes``/``n_groups``: the graph's size before it (what a fallback rebuilds);
    ``settles``/``settle``: see ``TracerMode.settle_packed``."""

    __slots__ = (
        "op",
        "run",
        "nargs",
        "targs",
        "consts",
        "strict",
        "rest",
        "first",
        "outs",
        "vid",
        "what",
        "gid",
        "store",
        "node",
        "snap",
        "seeded",
        "dynamic",
        "holds",
        "drop",
        "n_nodes",
        "n_groups",
        "settles",
        "settle",
        "reset",
        "alias_arg",
        "vids",
        "seq",
        "simple",
    )

    def __init__(self, op, run, nargs, targs, consts, strict, rest, first, outs, node, snap, seeded, dynamic):
        self.op = op
        self.run = run
        self.nargs = nargs
        self.targs = targs
        self.consts = consts
        self.strict = strict
        self.rest = rest
        self.first = first
        self.outs = outs
        # the common single-tensor result, for the fast path (``build``): outs[0]'s fields
        self.vid, self.what, self.gid, self.store = -1, -1, None, False
        self.node = node
        self.snap = snap
        self.seeded = seeded
        self.dynamic = dynamic
        self.holds = ()
        self.drop = ()
        self.n_nodes = 0
        self.n_groups = 0
        # (index among the packs since the last node, meta after the write): tensors autograd
        # saved for this op that it then wrote without bumping their version counter (rrelu's
        # noise, batch norm's running statistics): their handles take the state after the
        # write (``TracerMode._saw_write``), checked at the next node (``settle``)
        self.settles = ()
        self.settle = False
        self.reset = False  # a node after packs: they are no longer the last ones (``build``)
        self.alias_arg = None  # for an ALIAS result: the position of the argument it shares a storage with
        self.vids = 0  # how many vids earlier events registered (``build``)
        self.seq = 0  # what the op returned: 0 a tensor, 1 a flat list or tuple, 2 a nested one
        self.simple = False


class PackEvent:
    """Autograd saved a tensor: ``vid`` (or ``first``), handled as ``kind`` with ``meta``;
    ``owned``: for an outside tensor saved before any write (``outside``), whether a
    ``REBUILDERS`` owner claimed it (None: none was asked)."""

    __slots__ = ("vid", "first", "kind", "meta", "owned", "outside", "drop", "n_nodes", "n_groups", "vids")
    op = None  # never an op: an op dispatched where a pack was expected is a divergence

    def __init__(self, vid, first, kind, meta, owned, outside):
        self.vid = -1 if vid is None else vid  # (-1: a first sight)
        self.first = first
        self.kind = kind
        self.meta = meta
        self.owned = owned
        self.outside = outside  # an outside tensor before any write: where REBUILDERS are asked
        self.vids = 0
        self.drop = ()
        self.n_nodes = 0
        self.n_groups = 0


class LabelEvent:
    """``tracedac.name(t, label)``: ``node`` (its index, or -1) got the label; ``holds`` as an
    op event's, with ``("label", None)`` for ``t`` itself."""

    __slots__ = ("vid", "first", "label", "node", "holds", "drop", "n_nodes", "n_groups", "vids")
    op = None

    def __init__(self, vid, first, label, node):
        self.vid = vid
        self.first = first
        self.label = label
        self.node = node
        self.holds = ()
        self.drop = ()
        self.n_nodes = 0
        self.n_groups = 0
        self.vids = 0


def at(args, kwargs, path):
    """The value at ``path`` (position or keyword, list index or None) of a call's arguments."""
    where, index = path
    a = args[where] if where.__class__ is int else kwargs[where]
    return a if index is None else a[index]


def check_rest(e: OpEvent, args, kwargs, vals) -> bool:
    """The slow part of an event's check: keyword arguments and lists holding tensors.
    ``e.rest`` is ``(positional, keywords)``: ``positional`` a tuple of ``(position, spec)``,
    ``keywords`` a dict of name -> spec; a spec is ``("T", vid)`` (the tensor ``vid``), ``("F",)``
    (a first sight, checked by the caller), ``("C", value, exact)``, or ``("L", type, specs)``."""
    positional, keywords = e.rest
    for pos, spec in positional:
        if not _matches(args[pos], spec, vals):
            return False
    if kwargs.keys() != keywords.keys():
        return False
    for name, spec in keywords.items():
        if not _matches(kwargs[name], spec, vals):
            return False
    return True


def _matches(a, spec, vals) -> bool:
    kind = spec[0]
    if kind == "T":
        return a is vals[spec[1]]
    if kind == "F":
        return isinstance(a, torch.Tensor)
    if kind == "C":
        return (
            (a is spec[1] or a == spec[1])
            if spec[2] and not isinstance(a, torch.Tensor)
            else same(a, spec[1])
        )
    # a list or tuple holding tensors
    return (
        type(a) is spec[1]
        and len(a) == len(spec[2])
        and all(_matches(x, s, vals) for x, s in zip(a, spec[2]))
    )


class Template:
    """What a warm call needs: the events, the recorded graph's structure (``nodes``: every
    node, decided, for a fallback to copy; ``groups``: per group id ``(nbytes, device,
    creator index or None, mutation indices)``), and the graph a finished call leaves, as the
    region's end would release it (``released``: the node list; ``shared``: the groups no call
    gives a tensor, shared by every call; ``own``: ``(gid, source kind, nbytes, device, creator,
    mutations)`` of the groups each call makes for itself, holding its tensors (a node, or the
    index of a random node copied per call); ``random``: the indices of the replayed random
    nodes, copied per call with its generator states; ``needed``: the nodes replay may run).
    ``wanted_metas``: the metas of the handles replay was to rebuild at the end; ``plan_entry``:
    the plan cache's entry it was decided by (a planner's), to notice when that changed."""

    __slots__ = (
        "events",
        "nodes",
        "groups",
        "released",
        "forgotten",
        "shared",
        "own",
        "random",
        "needed",
        "plan_entry",
        "n_vids",
        "handlers",
        "vid_gid",
        "wanted_metas",
        "outer",
    )

    def __init__(self):
        self.events: list = []
        self.nodes: list[Node] = []
        self.groups: list[tuple] = []
        self.released: list = []  # node index -> the shared node (replay runs it) or None
        self.forgotten: dict[int, Node] = {}  # index -> an argument-less copy (a reachable group's writer)
        self.shared: list = []  # group id -> a shared Group, None (released), or ... (made per call)
        self.own: tuple = ()
        self.random: tuple = ()
        self.needed: frozenset = frozenset()
        self.plan_entry = None
        self.n_vids = 0
        self.handlers: tuple = ()  # per event, the function that checks it (``handlers.make``)
        self.vid_gid: tuple = ()  # per vid, the group of its storage (None: a layout-only argument)
        self.wanted_metas: frozenset = frozenset()  # the metas of the handles wanted at the end
        self.outer = False  # whether an outside tensor's group starts from a REBUILDERS owner's handle


def copy_node(node: Node, rng=None, forget=False) -> Node:
    """A new node with ``node``'s structure and decision; ``forget``: without arguments (a
    node the region's end decided nothing replays)."""
    n = Node(
        node.index,
        node.op,
        None if forget else node.args,
        None if forget else node.kwargs,
        node.outputs,
        node.writes,
        node.creates,
        rng,
        node.module_path,
        node.source,
    )
    n.decision = node.decision
    n.labels = node.labels
    return n


def build(
    events: list, vid_gid: list, graph, starts: dict, needed, kept_groups: set, wanted_metas
) -> Template:
    """The template of a call that recorded ``graph`` (not yet released) and logged ``events``;
    ``starts``/``needed``: its end's replay plan (group -> (source kind, state); the nodes it
    runs), ``kept_groups``: the groups of the handles kept, ``wanted_metas``: the metas of the
    handles replay is to rebuild (the very objects the pack events hand a warm call's handles)."""
    t = Template()
    t.n_vids = len(vid_gid)
    t.vid_gid = tuple(vid_gid)
    # The last event that reads each tensor: a warm call holds it from its first sight (or the
    # op that made it) until then, and no longer, so it never outlives the program's own use.
    last: dict[int, int] = {}
    for i, e in enumerate(events):
        for v in _reads(e):
            last[v] = i
    drops: dict[int, list] = {}
    for v, i in last.items():
        drops.setdefault(i, []).append(v)
    born = 0
    for i, e in enumerate(events):
        e.vids = born  # vids are numbered in the order events register them
        for f in _firsts(e):
            born = max(born, f.vid + 1)
        if isinstance(e, OpEvent):
            born = max([born] + [o[0] + 1 for o in e.outs if o is not None])
        e.drop = tuple(drops.get(i, ()))
        for f in _firsts(e):
            f.store = f.vid in last
        if isinstance(e, OpEvent):
            outs = tuple(
                None if o is None else (o[0], o[1], o[2], o[1] != SAME and o[0] in last) for o in e.outs
            )
            e.outs = outs
            if len(outs) == 1 and outs[0] is not None and not e.seq:
                e.vid, e.what, e.gid, e.store = outs[0]
            elif e.seq == 1 and outs and all(o is not None and o[1] == VIEW for o in outs):
                e.what = VIEWS  # (split, chunk, unbind: views, stored by position)
                e.vid = tuple((k, o[0]) for k, o in enumerate(outs) if o[3])
            e.simple = (
                not e.settles
                and not e.settle
                and e.rest is None
                and not e.snap
                and not e.seeded
                and not e.dynamic
                and e.what >= 0
            )
    pending = packed = False
    for e in events:
        if isinstance(e, PackEvent):
            packed = True
        elif isinstance(e, OpEvent) and e.node >= 0:
            e.settle = pending  # the node after one that wrote what it saved settles the handles
            e.simple = e.simple and not pending
            pending = bool(e.settles)
            e.reset, packed = packed, False
    t.events = events
    nodes = graph.nodes
    t.nodes = [copy_node(n) for n in nodes]
    t.groups = [
        (
            g.nbytes,
            g.device,
            None if g.creator is None else g.creator.index,
            tuple(m.index for m in g.mutations),
        )
        for g in graph.groups
    ]
    # The graph a call leaves behind, as ``Region._release`` leaves the recorded one.
    needed = frozenset(needed)
    t.needed = needed
    t.random = tuple(i for i in sorted(needed) if nodes[i].rng is not None)
    released = [None] * len(nodes)
    for i in needed:
        released[i] = t.nodes[i]
    t.released = released
    per_call_nodes = set(t.random)
    shared: list = [None] * len(graph.groups)
    own = []
    for gid in sorted(set(starts) | set(kept_groups)):
        g = graph.groups[gid]
        kind = starts.get(gid, (None,))[0]
        writers = ([g.creator] if g.creator is not None else []) + list(g.mutations)
        if kind not in (None, "create") or any(n.index in per_call_nodes for n in writers):
            # made per call: it holds a tensor of the call, or refers to its random nodes (an
            # index here, for the call's copy); the nodes it refers to are made once
            def ref(n):
                return n.index if n.index in per_call_nodes else _released_node(t, n)

            creator = None if g.creator is None else ref(g.creator)
            kind = None if kind == "create" else kind
            own.append((gid, kind, g.nbytes, g.device, creator, tuple(map(ref, g.mutations))))
            shared[gid] = ...
            continue
        s = Group(gid, g.nbytes, g.device)
        s.creator = _released_node(t, g.creator)
        s.mutations = [_released_node(t, m) for m in g.mutations] if g.mutations else ()
        s.grows = g.grows
        shared[gid] = s
    t.shared = shared
    t.own = tuple(own)
    t.outer = any(o[1] == "outer" for o in own)
    t.wanted_metas = frozenset(wanted_metas)
    return t


def _reads(e) -> list:
    """The vids event ``e`` reads (by identity) in a warm call."""
    if isinstance(e, OpEvent):
        read = [v for _, v in e.targs]
        if e.rest is not None:
            read += _rest_vids(e.rest)
        read += [o[0] for o in e.outs if o is not None and o[1] == SAME]
        return read
    if isinstance(e, PackEvent):
        return [] if e.vid < 0 else [e.vid]
    return [] if e.vid is None else [e.vid]


def _released_node(t: Template, node):
    """The node a released group refers to: shared if replay runs it, else an argument-less copy."""
    if node is None:
        return None
    i = node.index
    if i in t.needed:
        return t.nodes[i]
    n = t.forgotten.get(i)
    if n is None:
        n = t.forgotten[i] = copy_node(t.nodes[i], forget=True)
    return n


def _firsts(e):
    if isinstance(e, OpEvent):
        return e.first
    return (e.first,) if e.first is not None else ()


def _rest_vids(rest) -> list:
    positional, keywords = rest
    out = []

    def walk(spec):
        if spec[0] == "T":
            out.append(spec[1])
        elif spec[0] == "L":
            for s in spec[2]:
                walk(s)

    for _, spec in positional:
        walk(spec)
    for spec in keywords.values():
        walk(spec)
    return out


# --- the cache ---------------------------------------------------------------------------------


class Entry:
    """A cache entry: its template (None: the next call records one) and how its calls went.
    After ``MAX_MISSES`` calls in a row that fell back to a full record (a structure that
    changes from call to call: an MoE's routing, a shape read from values), or one record that
    cannot be repeated warm (it offloads, nests a region, saves a tensor subclass...), the key
    records in full for good (``cold``)."""

    __slots__ = ("template", "misses", "cold")

    def __init__(self, template):
        self.template = template
        self.misses = 0
        self.cold = False


MAX_MISSES = 3


class TemplateCache:
    """Templates by (region key, region name or None), least recently used out. One template is
    shared by every region of a key (the layers of one class) under ``(key, None)``; a region
    whose call fell back from it gets its own under its name, so one layer that differs does
    not make the others record again."""

    def __init__(self, size: int = 256):
        self.size = size
        self.entries: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def find(self, key, name):
        """(the entry for a region, its cache key): its own, else the shared one; (None, the
        shared key) if there is neither."""
        with self.lock:
            for k in ((key, name), (key, None)):
                entry = self.entries.get(k)
                if entry is not None:
                    self.entries.move_to_end(k)
                    return entry, k
        return None, (key, None)

    def get(self, k):
        with self.lock:
            return self.entries.get(k)

    def put(self, k, template) -> Entry:
        """Set the template at ``k`` (making the entry if there is none)."""
        with self.lock:
            entry = self.entries.get(k)
            if entry is None:
                entry = self.entries[k] = Entry(template)
            else:
                entry.template = template
            self.entries.move_to_end(k)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
            return entry

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


TEMPLATES = TemplateCache()
