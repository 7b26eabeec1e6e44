"""Rebuilding what backward needs from a region graph.

Autograd stores a *handle* for each tensor it saves in a region. When backward first asks
for one that was not kept, a *pass* rebuilds every handle of the graph still waiting:

1. **Plan.** Walk back from the wanted (storage group, state) pairs. A group starts from a
   live tensor when all that is wanted of it is its final state and that tensor has not
   changed since the region ended (something the policy kept, an outside input, an
   enclosing region's handle); an outside tensor the region wrote starts from the copy
   taken before the write; anything else starts by replaying its creator. Then come the
   group's writes up to the latest state wanted. Each replayed node wants its own inputs in
   the states it read them in.
2. **Run.** The planned nodes run in recorded order under ``no_grad`` (random ops with
   their recorded generator state), each on views built from its inputs' geometry. Writes
   never land on a tensor someone else holds: a borrowed storage is copied first. A
   handle's value is captured the moment its group reaches the state it was saved in, and
   a storage is dropped as soon as no later planned node reads it.

Replay never runs Python from the region and never writes a tensor the program can see.
A handle unpacked while its region still records (``torch.autograd.grad`` inside the
region) is rebuilt alone, by a pass no region records (``trace.unrecorded``).
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..errors import CheckpointError
from ..record.decisions import needs_wait
from ..record.graph import Group, Layout, RegionGraph, TensorMeta, flatten_outputs
from ..record.tracer import unrecorded
from . import compiled as compiled
from .plan import Plan, changed_error, plan

__all__ = ["Slot", "fill_fresh_with_nan", "run_pass"]

_Tensor = torch.Tensor
_NOT_STARTED = ("",)
_aten = torch.ops.aten
# Ops whose result is uninitialized memory: a replay must write it before anything reads it.
_UNINITIALIZED = frozenset(
    [
        _aten.empty.memory_format,
        _aten.empty_like.default,
        _aten.empty_strided.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
        _aten.empty_permuted.default,
    ]
)
# Debugging: fill every allocation replay makes without initializing it (an ``empty_like``,
# a ``Layout`` argument) with NaN (integers: their largest value), so that a replay handing
# autograd memory nobody wrote shows as NaN gradients instead of whatever was there.
_fill_nan = os.environ.get("TRACEDAC_FILL_NAN", "") not in ("", "0")


@contextlib.contextmanager
def fill_fresh_with_nan(enabled: bool = True):
    """Within this block, replay fills the uninitialized tensors it allocates with NaN
    (the environment variable ``TRACEDAC_FILL_NAN=1`` does it for a whole run). A debugging
    aid: correct replays never read such memory before writing it."""
    global _fill_nan
    before, _fill_nan = _fill_nan, enabled
    try:
        yield
    finally:
        _fill_nan = before


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype is torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)


class Slot:
    """A handle on one saved tensor: its group, the state it was saved in, its geometry.

    ``tensor`` is set when the tensor itself is kept: an input as autograd gave it
    (``exact``), or a result the policy kept (detached, to break the reference cycle
    through its grad_fn). It is returned while its version is unchanged; otherwise, and
    when nothing was kept, the value is rebuilt from the graph. ``host`` is set instead for
    a result the policy offloaded (``offload.HostCopy``): brought back to the device while no
    write the region did not record has touched the tensor since, else rebuilt (or refused)
    as a changed kept tensor is.

    ``unpack`` supplies a value only, in any grad mode: autograd's history never comes from
    what an unpack hook returns. ``SavedVariable::unpack`` wraps that data with the history
    it noted when the tensor was saved (the grad_fn and output number, for a leaf its grad
    accumulator), just as torch's own checkpoint hands back detached recomputed tensors. So
    a saved tensor read with grad mode on (``grad_fn._saved_result``, ``ctx.saved_tensors``
    under ``enable_grad`` in a custom backward, a ``create_graph=True`` backward) gets the
    same history as in eager, and gradients through it reach the region's forward graph.
    """

    __slots__ = ("graph", "meta", "tensor", "version", "exact", "value", "host", "__weakref__")

    def __init__(self, graph: RegionGraph, meta: TensorMeta, tensor=None, exact=False, host=None):
        self.graph = graph
        self.meta = meta
        self.tensor = tensor
        self.version = tensor._version if tensor is not None else -1
        self.exact = exact
        self.value = None
        self.host = host
        if host is not None:
            host.hold(self)
        if tensor is None and host is None:
            graph.add_slot(self)  # kept (and offloaded) handles join a pass only when they change

    def release(self) -> None:
        """Stop holding the tensor (or its host copy): from now on the value is rebuilt (a
        planner dropped it, or the copy is not of the state saved)."""
        if self.host is not None:
            self.host.read(self)
        self.tensor = None
        self.host = None
        self.version = -1
        self.graph.add_slot(self)

    def offload(self, host) -> None:
        """Hold ``host``, a copy of the kept tensor, instead of the tensor."""
        host.watch(self.tensor)
        host.hold(self)
        self.host = host
        self.tensor = None
        self.version = -1

    @property
    def changed(self) -> bool:
        """Kept (or offloaded), but modified in place since it was saved."""
        if self.host is not None:
            return not self.host.serves(self.meta)
        return self.tensor is not None and self.tensor._version != self.version

    @property
    def wanted(self) -> bool:
        return self.value is None and ((self.tensor is None and self.host is None) or self.changed)

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t is not None and t._version == self.version:
            return t
        host = self.host
        if host is not None and host.serves(self.meta):
            with unrecorded():
                t = host.fetch(self.meta, self)
            host.read(self)  # (the others holding the copy read the same bytes back)
            return t
        graph = self.graph
        with graph.lock:
            if self.value is None:
                run_pass(graph, self)
            value, self.value = self.value, None
        return value


# --- running -----------------------------------------------------------------------------


def _wait_tensor(t: torch.Tensor) -> None:
    torch.ops._c10d_functional.wait_tensor.default._op(t)


def _source(g: Group, kind: str) -> torch.Tensor:
    """A tensor on the storage a group starts from."""
    if kind == "held":
        return g.held
    if kind == "external":
        return g.external
    if kind == "snapshot":
        return torch.empty(0, dtype=torch.uint8, device=g.device).set_(g.snapshot)
    if kind == "outer":
        with torch.no_grad():  # as backward unpacks it (replay runs in grad mode)
            return g.outer.unpack()
    if kind == "host":
        return g.host.source()
    raise AssertionError(kind)


class _Env:
    """Storages of the groups a pass has built, and the state each is in."""

    def __init__(self, groups):
        self.groups = groups
        self.storage: dict[int, object] = {}
        self.state: dict[int, int] = {}
        self.borrowed: set[int] = set()
        self.views: dict[int, dict] = {}  # group -> layout -> a tensor with it on the storage

    def view(self, m: TensorMeta) -> torch.Tensor:
        gid = m.group
        if self.state[gid] != m.state:
            raise AssertionError(
                f"internal error: replay wanted storage {gid} in state {m.state} but it is "
                f"in state {self.state[gid]}; please report this with the region's code"
            )
        views = self.views.get(gid)
        if views is None:
            views = self.views[gid] = {}
        key = (m.dtype, m.size, m.stride, m.offset)
        t = views.get(key)
        if t is None:
            t = torch.empty(0, dtype=m.dtype, device=self.groups[gid].device)
            t.set_(self.storage[gid], m.offset, m.size, m.stride)
            views[key] = t
        return t

    def put(self, gid: int, storage, state: int, borrowed: bool):
        self.storage[gid] = storage
        self.state[gid] = state
        if borrowed:
            self.borrowed.add(gid)
        else:
            self.borrowed.discard(gid)
        self._forget_views(gid)

    def own(self, gid: int):
        """Copy a storage someone else holds before writing it."""
        if gid in self.borrowed:
            self.put(gid, self.storage[gid].clone(), self.state[gid], borrowed=False)

    def drop(self, gid: int):
        self.storage.pop(gid, None)
        self._forget_views(gid)

    def _forget_views(self, gid: int):
        self.views.pop(gid, None)


def _arg(env: _Env, a):
    if isinstance(a, TensorMeta):
        return env.view(a)
    if a.__class__ is Layout:
        return _poison(a.tensor()) if _fill_nan else a.tensor()
    if isinstance(a, (list, tuple)):
        return type(a)(env.view(x) if isinstance(x, TensorMeta) else x for x in a)
    return a


def _on(t: torch.Tensor, m: TensorMeta) -> torch.Tensor:
    """A tensor laid out as ``m`` on ``t``'s storage (``t`` itself when it already is)."""
    if (
        t.size() == m.size
        and t.stride() == m.stride
        and t.storage_offset() == m.offset
        and t.dtype == m.dtype
    ):
        return t
    return torch.empty(0, dtype=m.dtype, device=t.device).set_(
        t.untyped_storage(), m.offset, m.size, m.stride
    )


def _run_compiled(graph: RegionGraph, p: Plan, slots: list) -> bool:
    """Fill ``slots`` from plan ``p`` run as one compiled function (``replay_compiled.py``); False
    where that path does not take the plan (then it replays op by op)."""
    groups, starts = graph.groups, p.starts
    sources: dict[int, torch.Tensor] = {}

    def source(m: TensorMeta) -> torch.Tensor:
        t = sources.get(m.group)
        if t is None:
            t = sources[m.group] = _source(groups[m.group], starts[m.group][0])
        return _on(t, m)

    with torch.no_grad():
        made = compiled.run(graph, p, source, {s.meta.group for s in slots})
        if made is None:
            return False
        for s in slots:
            o = made.get(s.meta.group)
            s.value = _on(o, s.meta) if o is not None else source(s.meta)
    return True


def run_pass(graph: RegionGraph, caller: Slot) -> None:
    """Rebuild ``caller``'s value and that of every handle of ``graph`` backward still waits for."""
    if torch.autograd._profiler_enabled():  # one event per pass, for `python -m benchmarks --profile`
        with torch.autograd.profiler.record_function("tracedac::replay"):
            return _run_pass(graph, caller)
    return _run_pass(graph, caller)


def _run_pass(graph: RegionGraph, caller: Slot) -> None:
    with unrecorded():  # replay inside a region that records: its ops are not the program's
        if graph.recompute_context is None:
            _replay(graph, caller)
            return
        with graph.recompute_context():  # a context_fn's, entered per pass as torch does per recompute
            _replay(graph, caller)


def _replay(graph: RegionGraph, caller: Slot) -> None:
    if graph.recording:
        # Unpacked while the region still records (torch.autograd.grad inside it): rebuild
        # this handle only. The others wait for backward; rebuilt now, their values would
        # be held until then, which is what the region was not to keep.
        slots = [caller]
    else:
        slots = [s for s in graph.slots() if s.wanted and s is not caller]
        slots.append(caller)
    wanted = frozenset([(s.meta.group, s.meta.state) for s in slots])
    p = graph.plan
    if p is None or not p.still_valid(graph, wanted):
        try:
            p = graph.plan = plan(graph, wanted)
        except (CheckpointError, AssertionError):  # a source modified after the forward explains both
            changed = [s for s in slots if s.changed]
            if not changed:
                raise
            raise changed_error(graph, changed[0]) from None
    graph.passes += 1
    graph.replayed_ops += len(p.nodes)
    # (a plan that replays a collective is refused by compiled replay: aten and prims ops only)
    on = not _fill_nan and compiled.is_enabled(graph.groups[caller.meta.group].device)
    if on and _run_compiled(graph, p, slots):
        return
    reads, last_use = p.reads, p.last_use()
    nodes, groups, starts = graph.nodes, graph.groups, p.starts

    captures: dict[int, list] = {}  # group -> handles waiting for a state of it
    for s in slots:
        captures.setdefault(s.meta.group, []).append(s)
    env = _Env(groups)
    view = env.view

    def capture(gid):
        state = env.state[gid]
        waiting = captures[gid]
        keep = [s for s in waiting if s.meta.state != state]
        if len(keep) < len(waiting):
            for s in waiting:
                if s.meta.state == state:
                    s.value = view(s.meta)
            env.borrowed.add(gid)  # a later write must not change what was handed out
        if keep:
            captures[gid] = keep
        else:
            del captures[gid]

    generators = {}
    try:
        # Below autograd (no graph is built) but in grad mode as the forward was: some kernels
        # make what only their backward reads when grad mode is on (mkldnn_rnn_layer's
        # workspace, under nn.LSTM on CPU) and return an undefined tensor without it.
        with torch._C._AutoDispatchBelowADInplaceOrView(), torch.enable_grad(), torch._C._DisableAutocast():
            for gid, (kind, state) in starts.items():
                if kind != "create":
                    source = _source(groups[gid], kind)
                    env.put(gid, source.untyped_storage(), state, borrowed=True)
                    # the source itself serves the arguments laid out as it is, with no set_
                    env.views[gid] = {
                        (source.dtype, source.size(), source.stride(), source.storage_offset()): source
                    }
                    if gid in captures:
                        capture(gid)
            for i in p.nodes:
                node = nodes[i]
                for gid in node.writes:
                    env.own(gid)
                args = [view(a) if a.__class__ is TensorMeta else _arg(env, a) for a in node.args]
                kwargs = {k: _arg(env, v) for k, v in node.kwargs.items()} if node.kwargs else {}
                if node.rng is not None:
                    gen, state, _ = node.rng
                    if gen not in generators:
                        generators[gen] = gen.get_state()
                    if state is not None:
                        gen.set_state(state)
                out = node.op._op(*args, **kwargs)
                flat = (out,) if isinstance(out, _Tensor) else flatten_outputs(out)
                if needs_wait(node.op):  # a collective replay_collectives let replay issue again
                    for o in flat:
                        if o is not None:
                            _wait_tensor(o)
                if _fill_nan and node.op in _UNINITIALIZED:
                    _poison(flat[0])
                for k in node.creates:
                    o, m = flat[k], node.outputs[k]
                    gid = m.group
                    if starts.get(gid, _NOT_STARTED)[0] != "create":
                        continue  # an output nobody wants, or one a live tensor provides
                    if o is None:
                        raise CheckpointError(
                            f"replaying {node.name} (node {node.index} of region {graph.name!r}) "
                            f"left its output {k} undefined, but the forward's was a tensor that "
                            "backward needs; the kernel decides from state tracedac does not "
                            "record. Keep its result with a policy (save_ops) instead."
                        )
                    if o.size() != m.size or o.stride() != m.stride or o.storage_offset() != m.offset:
                        raise CheckpointError(
                            f"replaying {node.name} gave a tensor laid out as size "
                            f"{list(o.size())} stride {list(o.stride())}, but the forward's was "
                            f"size {list(m.size)} stride {list(m.stride)}; the op is not "
                            "deterministic in layout, so tracedac cannot replay it. Keep its "
                            "result with a policy (save_ops) instead."
                        )
                    env.put(gid, o.untyped_storage(), 0, borrowed=False)
                    env.views[gid] = {(m.dtype, m.size, m.stride, m.offset): o}
                    if gid in captures:
                        capture(gid)
                    if last_use.get(gid, -1) <= i and gid not in captures:
                        env.drop(gid)  # nothing later reads it: it lives on in what was captured
                for gid in node.writes:
                    env.state[gid] += 1
                    if groups[gid].grows:
                        env._forget_views(gid)  # the written view may have been resized
                    if gid in captures:
                        capture(gid)
                for m in reads[i]:
                    if last_use[m.group] == i and m.group not in captures:
                        env.drop(m.group)
    finally:
        for gen, state in generators.items():
            gen.set_state(state)
    missing = [s for s in slots if s.value is None]
    if missing:
        m = missing[0].meta
        raise AssertionError(
            f"internal error: replay did not rebuild storage {m.group} in state {m.state} "
            f"for region {graph.name!r}; please report this with the region's code"
        )
