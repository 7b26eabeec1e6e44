"""Recording a region: a TorchDispatchMode that writes down what each aten op did.

Every op runs eagerly exactly as it would without tracedac; the mode only records it (see
``graph.py`` for the model): a node for each op that allocates or writes a storage, and a
group for each storage an op touches. It is pushed when a checkpointed region starts and
popped when it ends, so code outside regions runs with no mode and no cost.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._compat import dynamo_off, dynamo_restore
from ..errors import CheckpointError
from .graph import Group, Layout, Node, RegionGraph, TensorMeta, flatten_outputs
from .location import current_module_path, user_source
from .op_info import _INFO, op_info
from .op_info import storage_address as _address
from .subclasses import check_replayable, decline, has_subclass
from .undeclared_writes import writes_now
from .unwaited import wait_issued

__all__ = ["TracerMode", "deciding", "unrecorded"]

_Tensor = torch.Tensor
_local = threading.local()  # ``unrecorded``'s switch
# How many threads are inside ``unrecorded`` now: a warm call (``warm.py``) reads the switch of
# its own thread only when some thread is (one list lookup per op instead of a thread-local's).
UNRECORDED = [0]
_unrecorded_lock = threading.Lock()
_NO_KWARGS: dict = {}  # shared by every node without keyword arguments: never written
_SEQUENCES = (list, tuple)
_FIRST = (0,)  # the ``creates`` of nearly every node: one shared tuple


def _generator(args, kwargs):
    gen = kwargs.get("generator")
    if gen is not None:
        return gen
    device = kwargs.get("device")
    if device is None:
        device = next((a.device for a in args if isinstance(a, _Tensor)), torch.device("cpu"))
    device = torch.device(device)
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise CheckpointError(
        f"a random op ran on device {device} inside a checkpointed region; tracedac records "
        "the generator state of CPU and CUDA generators only, so it could not replay the same "
        "numbers. Pass an explicit generator= to the op, or move it outside the region."
    )


def deciding(node):
    """``(args, kwargs, out)`` of the op ``node`` records while its region decides it (a
    policy asked from the recorder, in this thread), else None. Read by policies that look
    at values, as torch's selective checkpointing's policy functions do (``selective.py``)."""
    call = _local.__dict__.get("call")
    return call[1:] if call is not None and call[0] is node else None


@contextlib.contextmanager
def unrecorded():
    """Ops this thread runs in the block reach no region's recorder: replay's own ops.

    Replay can run while a region records: ``torch.autograd.grad`` inside a checkpointed
    function unpacks what the region (or one finished inside it) saved, and the engine runs
    that backward under the region's dispatch mode. Replay is not the program's computation:
    recorded, its ops would enter the graph as a second copy of what they rebuild (and its
    ``set_`` onto fresh storages would be refused as a storage swap). The value it hands
    autograd reaches the region as an outside tensor. Per thread, as the mode stack is: a
    CUDA backward runs on the engine's device thread, under a copy of the caller's modes."""
    before = _local.__dict__.get("unrecorded", False)
    _local.unrecorded = True
    with _unrecorded_lock:
        UNRECORDED[0] += 1
    try:
        yield
    finally:
        _local.unrecorded = before
        with _unrecorded_lock:
            UNRECORDED[0] -= 1


def _written_tensors(positions, args, kwargs):
    """The tensors at the written ``(position, name)`` arguments, each tensor of a written list
    (``Tensor(a!)[]``: the ``_foreach_*_`` ops, ``_amp_foreach_non_finite_check_and_unscale_``)
    included."""
    for pos, name in positions:
        t = args[pos] if pos < len(args) else kwargs.get(name)
        if isinstance(t, _Tensor):
            yield t
        elif t.__class__ in _SEQUENCES:
            yield from (x for x in t if isinstance(x, _Tensor))


def _timed(func, args, kwargs) -> tuple:
    """Run the op; (its result, nanoseconds it took), waiting for CUDA's queue both sides."""
    sync = torch.cuda.is_available() and torch.cuda.is_initialized()
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter_ns()
    out = func._op(*args, **kwargs)
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter_ns() - start


# --- the mode ------------------------------------------------------------------------------


class RegionMode(TorchDispatchMode):
    """What every mode that sees a region's ops is (``TracerMode``, ``warm.WarmMode``): no
    dynamo-disable frame around each op, and dynamo off while it is on the stack."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps every __torch_dispatch__ in a dynamo-disable frame by default; the first
        # call imports torch._dynamo (seconds, tens of MiB) and each call pays for the frame.
        # The region never compiles inside the mode, so opt out.
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # False: compiled code never runs under the recorder. Inductor's fused kernels write
        # tensors without dispatching an op: an in-place write of a tensor the region made
        # (``m.add_(1)`` in a compiled function) would go unrecorded and replay would rebuild
        # the value before it, silently (tests/test_compile.py). ``__enter__`` turns dynamo
        # off for the region instead, so such a function runs as plain Python there.
        return False

    def __enter__(self):
        self._dynamo = dynamo_off()
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            dynamo_restore(self._dynamo)


class TracerMode(RegionMode):
    """Records one region call into ``graph``.

    ``region`` supplies the policy (``region.policy``, or ``region.constant`` for one that
    never looks at nodes), where kept results go (``region.hold``), the module name table
    and whether to track module paths, and whether to record source lines (reports only:
    that walks the Python stack).
    """

    def __init__(self, graph: RegionGraph, region):
        super().__init__()
        self.graph = graph
        self.region = region
        # storage (its StorageImpl address) -> group. Each address is pinned by a weak
        # reference until close(), so a freed storage's address is never reused meanwhile.
        self.storages: dict[int, Group] = {}
        self._pins: list[int] = []
        self.shapes: dict = {}  # one object per distinct size, stride or storage size: graphs hold many
        self.metas: dict[tuple, TensorMeta] = {}  # one TensorMeta per distinct tensor (see _new_meta)
        # id -> (tensor, meta, group) for the tensors around the op being recorded (the last
        # recorded op's results, and what was read or packed since), shared between nodes
        # and the handles autograd saves. Reset at every recorded op: it pins nothing for long.
        self.recent: dict[int, tuple] = {}
        self.rng_last: dict = {}  # generator -> (index of its last random node, its state after)
        self.devices: dict = {}
        self.sources = region.report
        self.timing = region.timing  # cost="time" planners: each op's duration
        # Handles autograd packed since the last recorded op: the next op's inputs among them.
        # An op that writes one of its own saved inputs without bumping its version counter
        # (rrelu_with_noise's noise; BatchNorm's running statistics, see writes.py) leaves
        # eager's backward reading the value after the write, so the handle must too; an op
        # that bumps it makes eager's backward refuse, and the handle keeps the value it saw.
        self._packed: list = []  # (slot, tensor, its version)
        self._written: list = []  # (slot, tensor, version, meta after the last recorded op's write)

    def close(self) -> None:
        """Release the pinned storage addresses (the region has ended)."""
        free = torch.UntypedStorage._free_weak_ref
        for handle in self._pins:
            free(handle)
        self._pins = []
        self.storages = {}
        self.shapes = {}
        self.metas = {}
        self.recent = {}
        self.rng_last = {}
        self._packed = []
        self._written = []

    def packed(self, slot, t: torch.Tensor):
        """Note a handle autograd just packed for ``t`` (see ``_packed``); returns it."""
        self._packed.append((slot, t, t._version))
        return slot

    def settle_packed(self) -> None:
        """Move the handles of the last write to the state after it, unless the write bumped
        the tensor's version counter (autograd bumps it after the op leaves this mode)."""
        for slot, t, version, meta in self._written:
            if t._version == version:
                slot.meta = meta
        self._written = []

    def _saw_write(self, node: Node) -> None:
        groups = self.graph.groups
        for slot, t, version in self._packed:
            m = slot.meta
            if m.group in node.writes and m.state == len(groups[m.group].mutations) - 1:
                after = TensorMeta(m.group, m.state + 1, m.dtype, m.size, m.stride, m.offset)
                self._written.append((slot, t, version, after))

    def group_of(self, t: torch.Tensor) -> Group | None:
        """The group of ``t``'s storage, or None if no recorded op has touched it."""
        try:
            return self.storages.get(_address(t))
        except (RuntimeError, NotImplementedError):
            check_replayable(t)
            raise

    def external(self, t: torch.Tensor) -> Group:
        """A new group for a storage from outside the region, which ``t`` lives on."""
        check_replayable(t)
        g = self._new_group(t)
        g.external = t
        g.address = _address(t)  # (a storage swapped in later, even in the region, is seen: replay/plan.py)
        return g

    def _new_group(self, t: torch.Tensor) -> Group:
        """A new group for ``t``'s storage (one call: it runs for every op that allocates)."""
        storage = t.untyped_storage()
        device = t.device
        device = self.devices.setdefault(device, device)  # one object per device, not per group
        groups = self.graph.groups
        nbytes = storage.nbytes()
        g = Group(len(groups), self.shapes.setdefault(nbytes, nbytes), device)  # one int object per size
        groups.append(g)
        self.storages[storage._cdata] = g
        self._pins.append(storage._weak_ref())
        return g

    def _meta(self, t: torch.Tensor) -> TensorMeta:
        """``t`` as it is now. Autograd saves the arguments or results of the op being
        recorded, so the metas of the tensors around the current op are cached and shared
        between its node and those handles (a tensor keeps its storage and geometry between
        ops unless an op rebinds it, and such an op clears the cache)."""
        recent = self.recent.get(id(t))
        if recent is not None and recent[0] is t and recent[1].state == len(recent[2].mutations):
            return recent[1]
        return self._new_meta(t, self.group_of(t) or self.external(t))

    def _new_meta(self, t: torch.Tensor, g: Group, new: bool = False) -> TensorMeta:
        """``t``'s meta; ``new``: ``g`` was just made, so no meta of it exists yet."""
        # One meta per distinct tensor seen: the graph and the handles share it (the same
        # weight view read by several ops, an activation read again after other ops).
        size, stride, state, dtype, offset = (
            t.size(),
            t.stride(),
            len(g.mutations),
            t.dtype,
            t.storage_offset(),
        )
        key = (g.id, state, dtype, size, stride, offset)
        m = None if new else self.metas.get(key)
        if m is None:
            shapes = self.shapes
            m = self.metas[key] = TensorMeta(
                g.id, state, dtype, shapes.setdefault(size, size), shapes.setdefault(stride, stride), offset
            )
        self.recent[id(t)] = (t, m, g)
        return m

    def _map(self, x):
        """A list or tuple argument with its tensors replaced by metas (others as they are)."""
        if any(isinstance(y, _Tensor) for y in x):
            return type(x)(self._meta(y) if isinstance(y, _Tensor) else y for y in x)
        return x

    def _arg(self, a):
        if isinstance(a, _Tensor):
            return self._meta(a)
        if a.__class__ in _SEQUENCES:
            return self._map(a)
        return a

    def _writes(self, writes, rebinds, args, kwargs) -> list:
        """(tensor, group, storage address, bytes) of each tensor the op writes or rebinds."""
        written = []
        for t in _written_tensors(writes + rebinds, args, kwargs):
            storage = t.untyped_storage()  # (once per written tensor: the write check needs its size)
            g = self.storages[storage._cdata]
            if any(w[1] is g for w in written):
                continue  # two views of one storage in a list (_foreach_add_): one write of the group
            if g.host is not None:
                g.host.before_write()  # CUDA: the copy to host of the state before it has been read
            if writes and g.creator is None and not g.mutations:
                # The outside tensor's value before this write may be needed to replay what
                # read it, and the write cannot be undone: copy it now (the region's end drops
                # the copy if nothing needs it).
                with torch._C._DisableTorchDispatch():
                    g.snapshot = storage.clone()
            written.append((t, g, storage._cdata, storage.nbytes()))
        return written

    def _random(self, args, kwargs) -> tuple:
        gen = _generator(args, kwargs)
        state = gen.get_state()
        # When nothing drew from the generator since the last random op, replaying that op
        # leaves the generator at this op's state: region exit may drop this copy.
        last = self.rng_last.get(gen)
        with torch._C._DisableTorchDispatch():
            follows = last[0] if last is not None and torch.equal(last[1], state) else None
        return gen, state, follows

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or _NO_KWARGS
        if _local.__dict__.get("unrecorded"):  # replay running inside a region (``unrecorded``)
            return func._op(*args, **kwargs)
        if types and has_subclass(types):  # recorded beneath the subclass (``subclasses.py``)
            return decline(func, types, args, kwargs)
        info = _INFO.get(id(func))
        info = info[1] if info is not None else op_info(func)
        if info.view:
            if info.bare:
                return func._op(*args, **kwargs)
            # Only register an outside storage seen for the first time, so that its group
            # is made from the tensor the program passed (an input, a parameter), not from
            # a view of it; the view's geometry is read off it wherever it is used.
            for a in args:
                if isinstance(a, _Tensor) and self.group_of(a) is None:
                    self.external(a)
            return info.run(*args, **kwargs)  # func._op, or a functional collective's wait (op_info._wait)
        # Arguments first: this registers outside storages before the outputs are looked at
        # (so a view of an input is not taken for a new storage), and records what a writing
        # op read before it writes. Most arguments are the last op's results: cached metas.
        if info.layout_only:  # the first argument's values are no input: it ties the node to no storage
            check_replayable(args[0])
            margs = (Layout(args[0]), *[self._arg(a) for a in args[1:]])
        else:
            # _arg and _meta inline (the recorder's hottest loop): a cached meta for the last
            # op's results and what was packed since, else a new one
            recent = self.recent
            margs = []
            for a in args:
                if isinstance(a, _Tensor):
                    r = recent.get(id(a))
                    if r is not None and r[0] is a and r[1].state == len(r[2].mutations):
                        a = r[1]
                    else:
                        a = self._new_meta(a, self.group_of(a) or self.external(a))
                elif a.__class__ in _SEQUENCES:
                    a = self._map(a)
                margs.append(a)
            margs = tuple(margs)
        mkwargs = {k: self._arg(v) for k, v in kwargs.items()} if kwargs else _NO_KWARGS
        writes = info.writes if info.hidden is None else info.writes + writes_now(info.hidden, args, kwargs)
        written = self._writes(writes, info.rebinds, args, kwargs) if writes or info.rebinds else ()
        rng = self._random(args, kwargs) if info.seeded else None

        if self.timing:
            elapsed = _timed(func, args, kwargs)
            out = elapsed[0]
        else:
            elapsed = None
            out = func._op(*args, **kwargs)  # what OpOverload.__call__ does, one Python frame less
        return self._record(func, info, args, kwargs, margs, mkwargs, written, rng, out, elapsed)

    def _record(self, func, info, args, kwargs, margs, mkwargs, written, rng, out, elapsed) -> object:
        """What an op that has run leaves in the graph: its node (if it allocated or wrote a
        storage), the groups of the storages it made, its decision; returns ``out``. Split
        from ``__torch_dispatch__`` for the warm path (``warm.py``), which ran the op itself
        before finding it was not the one its template expected."""
        storages = self.storages
        for t, g, cdata, nbytes in written:
            storage = t.untyped_storage()
            if storage._cdata != cdata or (storage.nbytes() != nbytes and info.rebinds):
                raise CheckpointError(
                    f"{func} replaced or resized the storage of a tensor inside a checkpointed "
                    "region; tracedac replays ops on storages it can rebuild and cannot replay "
                    "that. Move it outside the region (or allocate the tensor at its final size)."
                )
            if storage.nbytes() != nbytes:
                # A write that grows its output in place (an out= argument of the wrong size,
                # addbmm_ on a broadcastable self): replay grows its private copy the same way.
                g.nbytes = storage.nbytes()
                g.grows = True
        if info.rebinds:
            self.recent = {}  # geometry changed in place: cached metas are stale
            return out  # and nothing to replay: geometry is read off tensors at every use

        try:
            if isinstance(out, _Tensor):  # most ops: one tensor out
                flat = (out,)
                created = () if _address(out) in storages else ((0, self._new_group(out)),)
            else:
                flat = flatten_outputs(out)
                created = [
                    (i, self._new_group(o))
                    for i, o in enumerate(flat)
                    if isinstance(o, _Tensor) and _address(o) not in storages
                ]
        except (RuntimeError, NotImplementedError):
            for o in flatten_outputs(out):
                if isinstance(o, _Tensor):
                    check_replayable(o, func)
            raise
        if not created and not written:
            return out  # a view or a read: nothing to replay, nothing to keep

        graph = self.graph
        region = self.region
        node = Node(
            len(graph.nodes),
            func,
            margs,
            mkwargs,
            (),
            tuple([g.id for _, g, _, _ in written]) if written else (),
            _FIRST if len(created) == 1 and created[0][0] == 0 else tuple([i for i, _ in created]),
            rng,
            current_module_path(region.module_names) if region.tracks_modules else None,
            user_source() if self.sources else None,
        )
        for _, g, _, _ in written:
            g.add_mutation(node)
        for _, g in created:
            g.creator = node
        self.recent = {}  # from here on: this op's results
        if self._written:
            self.settle_packed()
        if self._packed:
            if written:
                self._saw_write(node)
            self._packed = []
        if len(flat) == 1 and created:
            node.outputs = (self._new_meta(out, created[0][1], new=True),)  # its group: just made
        else:
            node.outputs = tuple([self._meta(o) if isinstance(o, _Tensor) else None for o in flat])
        graph.nodes.append(node)
        if self.timing:
            graph.times[node.index] = elapsed[1]
        if rng is not None:
            self.rng_last[rng[0]] = (node.index, rng[0].get_state())
        if region.reads_values:  # a policy that reads the op's values (``deciding``): torch's SAC
            outer = _local.__dict__.get("call")  # (a policy's own ops deciding in another region)
            _local.call = (node, args, kwargs, out)
        try:
            keep = region.decide(node)
        except Exception as e:  # a refusal: the collective the op issued must not outlive it
            wait_issued(func, out, e)
            raise
        finally:
            if region.reads_values:
                _local.call = outer  # holds the op's tensors: never past the decision
        if not keep:
            return out
        # Held as the program's own tensors for now: a detach() down here, below autograd,
        # would not share their version counter (the region makes proper aliases later).
        for i, g in created:
            region.hold(g, flat[i])
        for t, g, _, _ in written:
            region.hold(g, t)
        return out
