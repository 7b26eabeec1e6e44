"""Host copies: what a region offloads, copied to host memory in the forward and brought back
in backward.

A policy that answers ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD`` for a node (``policies.offload_ops``,
``offload_names``, ``offload_kept``) has the node's result copied to host memory instead of
held on the device. A ``HostCopy`` is one state of one storage group, copied whole (as a kept
tensor holds its whole storage); every handle autograd saves on that state shares it, and so
does replay, which starts from it (``replay_plan``'s ``"host"`` start) where it would
otherwise rerun the op.

Only what backward reads is copied. The region holds an offloaded result as a kept one until
autograd saves it, which copies it and lets go of it on the device (``Region._pack``); one
nothing saved is copied at the region's end if the replay plan starts from it
(``leave_device``), else let go. Copying every offloaded result when made sent 1.7x the bytes
backward read under ``offload_kept(save_all())`` in the Llama bench.

CUDA: the copy goes into pinned memory on a side stream per device (``_side_stream``), after
that stream waits for the current one (the op that made the value); an event marks its end.
The source's block is marked used by the side stream (``record_stream``), so the caching
allocator does not hand it out again before the copy has read it, whoever frees it. A write
the region records into a storage whose copy may still be running waits for it first
(``before_write``, called by the recorder), so the copy holds the state it is labelled with.
In backward, ``fetch`` makes the current stream wait for the copy's event and copies back
with ``non_blocking=True`` on the current stream (pinned memory: asynchronous, and ordered
before the backward ops that read it).

Brought back once. Several handles often share one copy (a result two backward nodes save, an
op that saves one tensor twice). The first to read it brings the bytes back; the device copy
is then held for the others (``readers``: the handles holding this copy that have not read it)
and let go when the last has, as a kept tensor is held until backward is done with it. A
handle that is never read (a branch backward does not take) leaves the device copy to the
graph's end. Without this every further reader copied the whole storage again, on the
current stream, where no compute hides it.

Prefetch, a region ahead. Each region's copies form a batch, in forward order (``settle``).
Backward runs the regions in reverse, so when it first brings back a copy of one region, the
copies of the region before it (``prefetch_regions(n)``: the ``n`` before it; 1 by default, 0
turns it off) start coming back at once: on CUDA on a side stream, into device memory, with
an event the first ``fetch`` waits for, so the copy overlaps the backward of the region in
between. At most those ``n`` regions' copies are in flight beyond the one being read. On the
CPU there is nothing to copy ahead (the copy is served in place); the schedule is the same and
is what the tests read (``HostCopy.prefetched``).

CPU (and any device that is not CUDA): the copy is a plain synchronous copy to a separate
host tensor; on the CPU host and device are one, so ``fetch`` hands out a view of the copy
itself. What offload buys there is that the program's own tensor is no longer held.

Writes after the forward. A copy is immune to later writes, but a kept tensor is not, and
tracedac treats both alike: a ``token`` (a tensor with no storage sharing the saved tensor's
version counter) shows a write the region did not record, and then the copy is not used
(the value is rebuilt from the graph if what it was computed from was kept, else refused,
naming the op, exactly as for a kept tensor). On CUDA this also keeps a copy that a late
write raced with from ever being read.
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch

from ..record.decisions import is_offload
from .stats import copied, tracked, waiting

__all__ = ["HostCopy", "host_copy", "leave_device", "prefetch_regions", "settle", "tracked"]

_streams: dict = {}
_lock = threading.Lock()
_AHEAD = [1]  # regions whose copies come back ahead of the one backward reads (prefetch_regions)
_batches: list = []  # one _Batch per region, in forward order


class _Batch:
    """A region's host copies (weak references), and whether backward has begun reading them."""

    __slots__ = ("refs", "read")

    def __init__(self, copies: list):
        self.refs = [weakref.ref(c) for c in copies]
        self.read = False


def prefetch_regions(n: int) -> None:
    """Bring back the host copies of the ``n`` regions before the one backward is reading
    (default 1; 0: each copy comes back when it is unpacked)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"prefetch_regions() takes a number of regions >= 0, got {n!r}")
    _AHEAD[0] = n


def _side_stream(device: torch.device, kind: str = "out"):
    """The stream device-to-host copies (``"out"``) or prefetches (``"in"``) run on, one per
    CUDA device each."""
    with _lock:
        s = _streams.get((device, kind))
        if s is None:
            s = _streams[(device, kind)] = torch.cuda.Stream(device)
        return s


def _register(copies: list) -> None:
    """A region's copies, at its end: the next batch (batches whose copies are all gone pruned)."""
    with _lock:
        _batches[:] = [b for b in _batches if any(r() is not None for r in b.refs)]
        batch = _Batch(copies)
        for c in copies:
            c.batch = batch
        _batches.append(batch)


def _prefetch_before(batch: list) -> None:
    """``batch`` is being read: start the copies of the regions before it (``_AHEAD``), once."""
    ahead = _AHEAD[0]
    if not ahead or batch.read:
        return
    batch.read = True
    with _lock:
        try:
            i = next(k for k, b in enumerate(_batches) if b is batch)
        except StopIteration:
            return
        earlier = _batches[max(0, i - ahead) : i]
    for b in earlier:
        for r in b.refs:
            c = r()
            if c is not None:
                c.prefetch()


_WARNED_CPU: list = []


def _warn_cpu() -> None:
    """Once per process: an offload asked for on the CPU is done, and saves no memory."""
    if _WARNED_CPU:
        return
    _WARNED_CPU.append(True)
    warnings.warn(
        "tracedac: a region offloads on the CPU, where host memory is the device's memory: the copy "
        "holds the same bytes as the tensor it replaces, so it saves no memory (it runs as on a GPU, "
        "which tests the offload path). Offload is for CUDA devices; on the CPU, replay saves memory "
        "(recompute_all(), memory_budget(...)).",
        stacklevel=3,
    )


def _in_place(device: torch.device) -> bool:
    """Whether a copy on ``device`` is read where it is: on the CPU, host and device are one."""
    return device.type == "cpu"


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over the whole of ``t``'s storage."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class HostCopy:
    """One state (``state``) of a storage group, copied to host memory during the forward."""

    __slots__ = (
        "host",
        "device",
        "state",
        "event",
        "token",
        "version",
        "ref",
        "batch",
        "prefetched",
        "readers",
        "back",
        "__weakref__",
    )

    def __init__(self, t: torch.Tensor, state: int):
        self.device = t.device
        self.state = state
        self.event = None  # CUDA: recorded on the side stream when the copy is done
        self.token = None  # a storage-less tensor sharing the saved tensor's version counter
        self.version = None  # the token's version when the region ended (None: still recording)
        self.ref = weakref.ref(t)  # the program's tensor, to make the token from later (see watch)
        self.batch = None  # its region's copies (``_register``)
        self.prefetched = None  # False: asked for; else (CUDA) the device buffer and its event
        self.readers: set = set()  # ids of the handles holding this copy that have not read it
        self.back = None  # the bytes back on the device, while readers are left to read them
        with torch._C._DisableTorchDispatch(), torch.no_grad():
            src = _flat(t)
            if t.device.type == "cuda":
                main = torch.cuda.current_stream(t.device)
                side = _side_stream(t.device)
                side.wait_stream(main)  # the op that made the value has run
                host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
                with torch.cuda.stream(side):
                    host.copy_(src, non_blocking=True)
                    self.event = torch.cuda.Event()
                    self.event.record(side)
                src.record_stream(side)  # not reused before the copy has read it
            elif t.device.type == "cpu":
                _warn_cpu()
                host = src.clone()
            else:
                host = src.to("cpu")
        self.host = host
        copied("out", host.numel())

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    # -- versions --
    def watch(self, t: torch.Tensor) -> None:
        """Follow ``t``'s version counter (called above autograd: a ``detach()`` there shares
        it; below, in the recorder, it would not)."""
        if self.token is not None:
            return
        with torch._C._DisableTorchDispatch():
            token = t.detach()
            token.data = torch.empty(0, dtype=t.dtype, device=t.device)  # keeps the counter, not the storage
        self.token = token
        self.ref = None

    def settle(self) -> None:
        """The region ended: from now on a version that moves is a write it did not record.
        Without a token, the tensor made in the recorder is followed if still alive; if it
        is not, nothing can write that storage any more."""
        if self.token is None and self.ref is not None:
            t = self.ref()
            if t is not None:
                self.watch(t)
        self.ref = None
        self.version = self.token._version if self.token is not None else None

    @property
    def unchanged(self) -> bool:
        """No write the region did not record since the copy (always, while it records)."""
        return self.version is None or self.token._version == self.version

    def versions(self) -> tuple[int, int]:
        """(version now, version when the region ended), for messages."""
        return self.token._version, self.version

    def serves(self, meta) -> bool:
        """Whether this copy is the value of a handle saved as ``meta``."""
        return self.state == meta.state and self.unchanged

    # -- CUDA ordering --
    def before_write(self) -> None:
        """A write into the copied storage is about to run: on CUDA it waits for the copy."""
        if self.event is not None:
            main = torch.cuda.current_stream(self.device)
            with waiting(main):
                main.wait_event(self.event)

    # -- back to the device --
    def prefetch(self) -> None:
        """Start bringing the copy back now (CUDA: on a side stream), once."""
        if self.prefetched is not None:
            return
        self.prefetched = False
        if self.device.type != "cuda" or not self.unchanged:
            return
        with torch.no_grad():
            side = _side_stream(self.device, "in")
            with torch.cuda.stream(side):
                side.wait_event(self.event)
                out = torch.empty(self.host.numel(), dtype=torch.uint8, device=self.device)
                out.copy_(self.host, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
        copied("back", out.numel())
        self.prefetched = (out, done)

    def hold(self, handle) -> None:
        """``handle`` holds this copy and will read it (in the backward that needs it)."""
        self.readers.add(id(handle))

    def read(self, handle) -> None:
        """``handle`` has read this copy, or let go of it: when no holder is left to read it,
        the device copy goes (the tensors handed out keep its storage while they are used)."""
        self.readers.discard(id(handle))
        if not self.readers:
            self.back = None

    def source(self, reader=None) -> torch.Tensor:
        """A uint8 tensor on the device holding the copied bytes (on the CPU: the copy itself),
        for ``reader`` (a handle holding the copy; None: a replay pass starting from it).
        Brought back once while a holder is left to read it after this one."""
        if self.batch is not None:
            _prefetch_before(self.batch)
        if _in_place(self.device):
            return self.host
        out = self.back
        if out is None:
            out = self._bring_back()
            if len(self.readers) > (id(reader) in self.readers):  # others will read it: held
                self.back = out  # (``read`` lets it go)
        return out

    def _bring_back(self) -> torch.Tensor:
        """The bytes on the device: the prefetched buffer (handed out once), else copied now."""
        ahead = self.prefetched
        if ahead:
            self.prefetched = False
            out, done = ahead
            main = torch.cuda.current_stream(self.device)
            with waiting(main):
                main.wait_event(done)
            out.record_stream(main)  # allocated on the side stream, read and freed on this one
            return out
        copied("back", self.host.numel())
        with torch.no_grad():
            if self.device.type == "cuda":
                main = torch.cuda.current_stream(self.device)
                with waiting(main):  # on the compute stream itself: all of it a wait
                    main.wait_event(self.event)
                    out = torch.empty(self.host.numel(), dtype=torch.uint8, device=self.device)
                    out.copy_(self.host, non_blocking=True)
                return out
            return self.host.to(self.device)

    def fetch(self, meta, reader=None) -> torch.Tensor:
        """The saved tensor (laid out as ``meta``) back on its device, for ``reader``."""
        flat = self.source(reader)
        with torch.no_grad():
            return torch.empty(0, dtype=meta.dtype, device=self.device).set_(
                flat.untyped_storage(), meta.offset, meta.size, meta.stride
            )

    def __repr__(self) -> str:
        return f"HostCopy({self.nbytes} B of {self.device}, state {self.state})"


def host_copy(group, t: torch.Tensor) -> HostCopy:
    """The copy of ``group``'s storage in host memory in its current state (``t`` is on it),
    made now unless there is one: the handles autograd saves on that state share it, and
    replay starts from it instead of rerunning the op (``replay_plan``)."""
    state = len(group.mutations)
    h = group.host
    if h is None or h.state != state:
        h = group.host = HostCopy(t, state)
    return h


def settle(groups, kept: list, inputs: bool = False) -> list:
    """At a region's end, before its replay is planned: move to host what the policy offloads
    but a handle held on the device (a result kept before ``tracedac.name`` labelled it for
    ``offload_names``, or what a plan made at the region's end keeps under ``offload_kept``),
    and with ``inputs`` the inputs autograd saved that an op with a gradient made
    (``policies.offload_inputs``; replay then starts from the copy too; an input an enclosing
    region or a ``REBUILDERS`` owner rebuilds is that one's handle, not kept here); let go of
    the copies that are not of the state a handle saved (an op that wrote its own saved input
    without bumping the version counter: the handle wants the state after the write, which
    replay rebuilds); then start watching for writes. An offloaded result whose final state
    has a copy is no longer held (the copy serves replay); what else is held of one waits for
    the plan (``leave_device``). Returns the handles still holding something (of ``kept``)."""
    if inputs:
        for slot in kept:
            t = slot.tensor
            if not slot.exact or t is None:
                continue
            g = groups[slot.meta.group]
            # (a second handle on an input already copied: g.external is gone, g.host is its copy)
            if not g.mutations and (g.host is not None or (g.external is t and t.grad_fn is not None)):
                slot.offload(host_copy(g, t))
                g.external = None  # replay starts from the copy (``replay_plan``'s "host")
    for slot in kept:
        if slot.exact:
            continue
        g = groups[slot.meta.group]
        if slot.tensor is not None and is_offload(g.node.decision):
            if slot.changed or slot.meta.state != len(g.mutations):
                slot.release()  # modified since it was saved: replayed, as a kept one would be
            else:
                slot.offload(host_copy(g, slot.tensor))
        elif slot.host is not None and slot.host.state != slot.meta.state:
            slot.release()
    kept = [s for s in kept if s.tensor is not None or s.host is not None]
    for g in groups:
        if g.host is not None:
            if g.held is not None and g.host.state == len(g.mutations) and _offloaded(g):
                g.held = None
            g.host.settle()
    for slot in kept:
        if slot.host is not None:
            slot.host.settle()
    return kept


def leave_device(groups, kept: list) -> None:
    """After the region's replay is planned (and what it does not start from let go): an
    offloaded result still held on the device is one nothing saved that replay starts from,
    copied to host memory now; then the region's copies become its batch (``_register``).
    A result the policy offloads but backward never reads is never copied."""
    for g in groups:
        if g is not None and g.held is not None and _offloaded(g):
            h = host_copy(g, g.held)
            h.watch(g.held)
            h.settle()
            g.held = None
    copies = {id(g.host): g.host for g in groups if g is not None and g.host is not None}
    copies.update((id(s.host), s.host) for s in kept if s.host is not None)
    if copies:
        _register(list(copies.values()))


def _offloaded(g) -> bool:
    return g.node is not None and is_offload(g.node.decision)
