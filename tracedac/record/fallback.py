"""Leaving the warm path: a warm call that stops following its template becomes a recorded one.

The ops before the divergence have run and cannot run again, so the recorder starts from
what they did: ``convert`` builds the recorder's state as it would be had the call been
recorded from its start. Nodes and groups are copied from the template up to the event that
differed (they are what the recorder made for those same ops), bound to this call's tensors
(the outside tensors, the copies taken before writes, the held results, the generator
states, the storages' addresses and pins); each node is decided again, in order, with the
labels given so far, as the recorder decides it (a planner's decisions and signatures
included). ``record_ran`` then records the op that diverged after it ran (its outputs were
not the template's), as ``TracerMode.__torch_dispatch__`` would have.
"""

from __future__ import annotations

from .graph import Group, Layout
from .op_info import op_info
from .template import LabelEvent, OpEvent, copy_node
from .tracer import _NO_KWARGS, _written_tensors
from .undeclared_writes import writes_now

__all__ = ["convert", "record_ran"]


def convert(warm, region, i: int, extra: OpEvent | None = None) -> None:
    """Give ``region``'s recorder the state of a record of events ``[0, i)`` of ``warm``'s
    template, and of ``extra``'s first sights (the event whose op ran but whose outputs
    differ)."""
    t = warm.template
    events = t.events
    if i < len(events):
        n_nodes, n_groups = events[i].n_nodes, events[i].n_groups
    else:
        n_nodes, n_groups = len(t.nodes), len(t.groups)
    if extra is not None:
        for f in extra.first:
            if f.new:
                n_groups = max(n_groups, f.gid + 1)
    graph, tracer = region.graph, region.tracer
    rngs = warm.rngs
    nodes = []
    for k in range(n_nodes):
        n = copy_node(t.nodes[k], rngs.get(k))
        n.decision = None  # decided again below, as the recorder decides
        n.labels = frozenset()
        nodes.append(n)
    groups = []
    first = warm.first_addresses()
    for gid in range(n_groups):
        nbytes, device, creator, mutations = t.groups[gid]
        g = Group(gid, nbytes, device)
        x = warm.ext.get(gid)
        if x is not None:
            g.external = x
            g.address = first.get(gid)
            g.nbytes = x.untyped_storage().nbytes()  # (its storage, as this call's recorder would see it)
        if creator is not None:
            g.creator = nodes[creator]
        written = [nodes[m] for m in mutations if m < n_nodes]
        if written:
            g.mutations = written
        g.snapshot = warm.snap.get(gid)
        g.held = warm.held.get(gid)
        groups.append(g)
    graph.nodes = nodes
    graph.groups = groups
    # The storages the recorder must know from now on: those of the tensors this call still
    # holds (outside tensors, tensors a later event of the template reads, held results, kept
    # handles, the last packed). A storage of the region that none of them is on can be reached
    # only through tensors the template never reads again: to the recorder, from here, a new
    # outside storage, the same one at every use (the group of its earlier states replays on
    # its own copy), as a storage first seen is.
    storages, pins = tracer.storages, tracer._pins
    vid_gid = t.vid_gid
    live = [(x, gid) for gid, x in warm.ext.items()]
    live += [
        (x, vid_gid[v]) for v, x in enumerate(warm.vals or ()) if x is not None and vid_gid[v] is not None
    ]
    live += [(x, gid) for gid, x in warm.held.items()]
    live += [(s.tensor, s.meta.group) for s in region.kept if s.tensor is not None]
    live += [(x, s.meta.group) for s, x in warm.last_packs]
    for x, gid in live:
        if gid < n_groups:
            storage = x.untyped_storage()
            if storage._cdata not in storages:
                storages[storage._cdata] = groups[gid]
                pins.append(storage._weak_ref())
    tracer.rng_last = {gen: last for gen, last in warm.rng_last.items() if last[0] < n_nodes}
    tracer._packed = [(slot, x, x._version) for slot, x in warm.last_packs]
    tracer._written = warm.settling
    region.raw_held = {gid: (groups[gid], x) for gid, x in warm.raw.items() if gid < n_groups}
    # The decisions, in the order the recorder made them. What was held stays held: the
    # template held what a recorded call with this policy (and this plan) holds.
    for e in events[:i]:
        if e.__class__ is OpEvent:
            if e.node >= 0:
                region.decide(nodes[e.node])
        elif e.__class__ is LabelEvent and e.node >= 0:
            node = nodes[e.node]
            node.labels = node.labels | {e.label}
            region.decide(node)


def record_ran(tracer, func, args, kwargs, out, rng):
    """Record ``func(*args, **kwargs)``, which returned ``out`` (``rng``: the generator state
    taken before it ran, for a random op), on a recorder ``convert`` set up; returns ``out``."""
    info = op_info(func)
    if info.layout_only:
        margs = (Layout(args[0]), *[tracer._arg(a) for a in args[1:]])
    else:
        margs = tuple(tracer._arg(a) for a in args)
    mkwargs = {k: tracer._arg(v) for k, v in kwargs.items()} if kwargs else _NO_KWARGS
    writes = info.writes if info.hidden is None else info.writes + writes_now(info.hidden, args, kwargs)
    written = []
    for x in _written_tensors(writes + info.rebinds, args, kwargs):
        storage = x.untyped_storage()
        g = tracer.storages[storage._cdata]
        if all(w[1] is not g for w in written):
            written.append((x, g, storage._cdata, g.nbytes))
    return tracer._record(func, info, args, kwargs, margs, mkwargs, written, rng, out, None)
