"""ZeRO-3's three collectives as ``torch.library`` custom ops, and the flat groups they move.

- ``tracedac::all_gather(shard, flat, dtype=None) -> full``: cast this rank's fp32 buffer
  into the all-gather input (``pack_cast``, one fused pass), all-gather in the group's travel
  dtype (or ``dtype``: the compiled graph's cast moved into the gather by
  ``compile/gather_cast.py``), and reorder rank-major into parameter after parameter (``layout``). Backward:
  ``reduce_scatter`` the full gradient and add it into the parameters' DTensor ``.grad``
  with ``accumulate_`` (or keep it unsharded while gradient sync is off).
- ``tracedac::reduce_scatter(grad, flat) -> part``: this rank's part of the gradient summed
  over ranks, in the reduce dtype, divided by the world size (ranks average, as DDP and
  FSDP do). Backward: its adjoint, an all-gather divided by the world size.
- ``tracedac::release(full, flat)``: the end of a gathered buffer's forward life: the unit
  forgets the one reference it held, so the storage goes with the last view.
- ``tracedac::reduce_grad(grad, flat)``: the gather's backward, an op so that a compiled
  backward runs it rather than tracing its Python state (held gradients, ``.grad``).
- ``tracedac::all_gather_start(shard, flat, dtype=None)`` / ``all_gather_wait(started, flat)``:
  a gather in two, which ``compile/gather_prefetch.py`` puts in a compiled forward in place
  of ``all_gather`` so that the next unit's all-gather is in flight during this unit's
  compute. Forward only (the joint graph is already differentiated): no autograd of their own.

``release`` and ``reduce_grad`` return nothing and are registered effectful: compilers keep
them, in order (dead-code elimination would drop an op whose result nobody reads).

Ops take the group as a string key (a custom op cannot take a Python object; a string,
unlike an int, stays a constant under dynamic shapes): the ``FlatGroup`` holds the process
group, dtypes and layout. Being ops, they dispatch to
tracedac's ``TracerMode`` as one node each, and to any other mode or tracer.
"""

from __future__ import annotations

import itertools
import weakref
import zlib

import torch
import torch.distributed as dist
from torch._library.effects import EffectType

from ..checkpoint import REBUILDERS
from ..decisions import recompute_by_default
from ..ops import accumulate_, pack_cast
from ..trace import _address
from .errors import ZeroError
from .layout import dtensor, parameter, to_param_major, to_rank_major

__all__ = ["FlatGroup", "Prefetch", "all_gather", "reduce_scatter", "release"]

# torch 2.13 names the tensor collectives *_single and deprecates *_into_tensor / *_tensor.
# gloo implements both on CPU (bf16 included).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_GROUPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> FlatGroup
_KEYS = itertools.count()
_WHAT = {"all-gather": 0, "reduce-scatter": 1, "adjoint all-gather": 2}
_WHAT_NAMES = {v: k for k, v in _WHAT.items()}


def _dtype_code(dtype: torch.dtype) -> int:
    """The same integer on every rank for the same dtype (an order check's column)."""
    return zlib.crc32(str(dtype).encode())


def _dtype_named(code: int) -> str:
    known = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
    return next((str(d) for d in known if _dtype_code(d) == code), "another dtype")


_LIVE: dict = {}  # storage address -> Gathered, for buffers gathered by a forward pre-hook


class Prefetch:
    """Per model: the order of gathers in the last forward and backward, to prefetch by.

    The i-th gather of a forward (or backward) starts the (i+1)-th gather of the previous
    one, if the i-th was the same group then. A group may appear several times (a shared
    parameter's group is gathered by each unit using it): positions, not links between
    groups, so the last gather of a pass never starts one nobody will consume. A gather
    started but not consumed in its pass (the order changed) is waited for and dropped when
    the pass ends (``drain``: the root unit's forward post-hook; an autograd engine callback
    at the end of a backward), or at the latest when the next pass begins: no prefetched
    buffer outlives the pass, so none can predate an optimizer step, a load, or the process
    group's destruction.
    """

    __slots__ = ("enabled", "backward", "current", "learned", "inflight", "queued", "auto")

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.backward = None  # whether the pass being recorded is a backward; None: none yet
        self.current: list = []
        self.learned: dict = {}  # backward: bool -> the order of that kind of pass, last time
        self.inflight: list = []  # groups with a prefetched gather started in this pass
        self.queued = False  # a drain is queued for the end of the running backward
        self.auto = None  # the model's zero.auto.Auto, under MixedPrecision(param_dtype="auto")

    def _pass(self, backward: bool) -> None:
        """A gather of a forward (``backward`` False) or backward: a new pass if the kind changed."""
        if backward != self.backward:
            self.begin(backward)

    def begin(self, backward: bool) -> None:
        if self.backward is not None:
            self.learned[self.backward] = self.current
        self.backward, self.current = backward, []
        self.drain()

    def drain(self) -> None:
        """Wait for and drop every prefetched gather nobody consumed: at the end of a forward
        (the root's post-hook) and of a backward (an engine callback), so none stays in flight
        past its pass (into an optimizer step, a load, or ``destroy_process_group``)."""
        self.queued = False
        inflight, self.inflight = self.inflight, []
        for group in inflight:
            pending, group.pending = group.pending, None
            if pending is not None:
                group.wait(pending.work, "all-gather (prefetched, not used)")

    def together(self, group: FlatGroup, backward: bool, at: int | None = None) -> tuple:
        """The groups of ``group``'s unit that the last pass of this kind gathered right after
        it, from position ``at`` (default: the gather about to be recorded), and not started
        yet: their all-gathers start with ``group``'s, after one order check for all (a unit
        of "auto" groups, say a LayerNorm, a Linear and an MoE group, checks once, not three
        times). The same on every rank: the order is."""
        if not self.enabled:
            return ()
        if at is None:
            self._pass(backward)  # (what ``after`` does; here before anything starts)
            at = len(self.current)
        order = self.learned.get(backward, ())
        if at >= len(order) or order[at] is not group:
            return ()
        run: list = []
        for g in order[at + 1:]:
            if g.owner is not group.owner or g is group or g in run:
                break
            if g.pending is None:
                run.append(g)
        return tuple(run)

    def started(self, group: FlatGroup) -> None:
        """``group``'s all-gather is in flight: drained with its pass if no gather takes it (in
        backward, an engine callback at its end)."""
        self.inflight.append(group)
        if _in_backward() and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.drain)

    def after(self, group: FlatGroup, backward: bool) -> FlatGroup | None:
        """Record a gather of ``group``; return the group to prefetch next, if any."""
        self._pass(backward)
        i = len(self.current)
        self.current.append(group)
        order = self.learned.get(backward, ())
        if self.enabled and i + 1 < len(order) and order[i] is group:
            return order[i + 1]
        return None


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def group_of(key: str) -> FlatGroup:
    group = _GROUPS.get(key)
    if group is None:
        raise ZeroError(
            f"sharded parameter group {key} no longer exists (its model was garbage collected); "
            "a graph recorded on that model cannot be replayed. Keep the model alive until "
            "backward has run."
        )
    return group


class _Pending:
    """An all-gather in flight: its work handle, its output, and its input (alive until done)."""

    __slots__ = ("work", "out", "src")

    def __init__(self, work, out, src):
        self.work, self.out, self.src = work, out, src


def collective_device(backend: str, buffer_device: torch.device) -> torch.device:
    """Where a small tensor for ``backend``'s collectives must live: NCCL moves only CUDA
    tensors (the current device, as torch's own object collectives do); others, the buffer's."""
    if "nccl" in str(backend):
        return torch.device("cuda", torch.cuda.current_device())
    return buffer_device


class FlatGroup:
    """One flat group of a unit: parameters of one travel dtype and one ``requires_grad``.

    Every rank keeps ``local``: its ``Shard(0)`` chunk of every parameter, padded, one after
    another (``layout``), fp32, ``shard_numel`` elements. The parameters the model shows are
    ``DTensor`` views of it (``slices[i].param``); ``leaf`` is the same storage as the autograd
    input of the gather. ``state`` (one per model) prefetches in the order gathers ran in the
    previous forward or backward: the same on every rank, so every rank issues the same
    collectives in the same order.
    """

    def __init__(self, name, slices, shard_numel, requires_grad, dtype, reduce_dtype, group, timeout, state):
        self.key = f"tracedac_zero_{next(_KEYS)}"  # a str: stays a constant when a compiler traces the op
        _GROUPS[self.key] = self
        self.name = name  # "unit 'layers.0' (trainable bfloat16 parameters)", for messages
        self.crc = zlib.crc32(name.encode())  # the same on every rank: names the group in order checks
        self.slices = slices
        self.shard_numel = shard_numel
        self.requires_grad = requires_grad
        self.dtype = dtype  # travel and compute dtype
        self.reduce_dtype = reduce_dtype
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout = timeout
        self.state = state  # the model's Prefetch
        self.pending: _Pending | None = None
        self.travel = dtype  # the dtype the last gather asked for: what a prefetch gathers in
        self.sync = True  # reduce-scatter gradients in backward (False: accumulate them unsharded)
        self.held: torch.Tensor | None = None  # the unsharded gradient accumulated while sync is off
        self.grad_buffer: torch.Tensor | None = None  # flat fp32 gradient that the .grad DTensors view
        self.grads: list = []
        self.summoned = False  # inside full_parameters(): the DTensors are swapped out
        self.local = self.leaf = None
        self.auto = False  # MixedPrecision("auto"): dtype decided from the first forward (zero/auto.py)
        self.owner = None  # the unit whose shards these are (its groups start together: Prefetch.together)

    def dtype_now(self) -> torch.dtype:
        """The dtype to gather in now: the travel dtype, except that an ``"auto"`` group
        decided low travels fp32 in a forward outside the autocast it was decided under (an
        eval pass without autocast would otherwise meet bf16 weights with fp32 inputs)."""
        if self.auto and self.dtype != torch.float32:
            device = self.local.device.type
            if not (torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == self.dtype):
                return torch.float32
        return self.dtype

    def bind(self, local: torch.Tensor) -> None:
        """Make ``local`` the rank's buffer: new DTensor parameters over it, set on every module."""
        self.local = local
        self.leaf = local.detach().requires_grad_(self.requires_grad)
        self.grad_buffer, self.grads, self.pending, self.held = None, [], None, None
        for s in self.slices:
            s.param = parameter(s, local, self.requires_grad)
            s.param._tracedac_group, s.param._tracedac_slice = self, s
            for module, attr in s.uses:
                module._parameters[attr] = s.param

    # -- collectives --
    def wait(self, work, what: str) -> None:
        try:
            done = work.wait(self.timeout) if self.timeout is not None else work.wait()
        except RuntimeError as e:
            raise self._failed(what, e) from e
        if done is False:
            raise self._failed(what, None)

    def _failed(self, what, cause) -> ZeroError:
        limit = f" within {self.timeout.total_seconds():g} s" if self.timeout is not None else ""
        return ZeroError(
            f"the {what} of {self.name} failed on rank {self.rank} of {self.world}{limit} "
            f"({cause or 'timed out'}). Another rank probably died or never reached this step "
            "(an exception, a different number of steps, a model that runs different units). "
            "Look at the other ranks' errors first; the timeout is shard(..., timeout=...)."
        )

    def agree(self, what: str, dtype: torch.dtype, together: tuple = ()) -> None:
        """Check, before a collective, that every rank is about to run this one.

        Ranks that took different branches would otherwise pair different collectives:
        silently wrong values when their sizes match, a gloo abort when they do not. A
        fixed-size all-gather of (collective, size, group name, dtype, how many groups, all of
        them) cannot abort; every rank sees every row, so every rank raises at the same point.
        The dtype is part of it: the same group gathered in bf16 on one rank (a forward under
        autocast, "auto" having decided bf16) and fp32 on another would pair buffers of
        different byte sizes. ``together``: ``(group, dtype)`` pairs whose all-gathers start
        right after this one (the rest of its unit, ``Prefetch.together``): one check for all.
        """
        if self.world == 1:
            return
        device = collective_device(dist.get_backend(self.group), self.local.device)
        run = ((self, dtype), *together)
        numel = sum(g.shard_numel for g, _ in run)
        every = zlib.crc32(" ".join(f"{g.name}:{d}" for g, d in run).encode())
        mine = torch.tensor([_WHAT[what], numel, self.crc, _dtype_code(dtype), len(run), every], dtype=torch.int64,
                            device=device)
        rows = torch.empty(self.world, mine.numel(), dtype=torch.int64, device=device)
        self.wait(_all_gather(rows.view(-1), mine, group=self.group, async_op=True), f"{what} (order check)")
        if bool((rows == mine).all()):
            return
        r = next(r for r in range(self.world) if not bool((rows[r] == mine).all()))
        kind, _, crc, code, count, _ = rows[r].tolist()
        more = f" (and {len(run) - 1} more of its unit's groups)" if len(run) > 1 else ""
        if kind == _WHAT[what] and crc == self.crc and count == len(run):  # the same collective: dtypes differ
            theirs = f" in {_dtype_named(code)}" if code != _dtype_code(dtype) else " in other dtypes"
            raise ZeroError(
                f"rank {self.rank} is at the {what} of {self.name}{more} in {dtype} but rank {r} is at "
                f"the same {what}{theirs}: the ranks gather or reduce this group in "
                "different dtypes (a forward under torch.autocast on some ranks only, with "
                "MixedPrecision(\"auto\") or a fused cast). Run every rank's forward under the same "
                "autocast; nothing was exchanged."
            )
        if kind == _WHAT[what] and crc == self.crc:  # the same gather, started with other groups
            raise ZeroError(
                f"rank {self.rank} is at the {what} of {self.name} with {len(run) - 1} more of its unit's "
                f"groups, as the last pass ran them, but rank {r} is at it with {count - 1}: one of them "
                "left the last pass's order of gathers, so the ranks run different units (a branch "
                "taken on some ranks only, a unit skipped, a different number of forwards). Every rank "
                "must run the same units in the same order; nothing was exchanged."
            )
        theirs = next((g.name for g in list(_GROUPS.values()) if g.crc == crc), "a group this rank does not know")
        raise ZeroError(
            f"rank {self.rank} is at the {what} of {self.name}{more} but rank {r} is at the "
            f"{_WHAT_NAMES.get(kind, 'unknown collective')} of {theirs}"
            f"{f' (and {count - 1} more)' if count > 1 else ''}: the ranks run different "
            "units (a branch taken on some ranks only, a unit skipped, a different number of "
            "forwards). Every rank must run the same units in the same order; nothing was exchanged."
        )

    def start(self, shard: torch.Tensor, dtype: torch.dtype | None = None, together: tuple = ()) -> _Pending:
        """Start the all-gather of ``shard`` in the travel dtype (or ``dtype``), asynchronously,
        and then those of ``together``'s groups (each from its own buffer in its travel dtype,
        pending until its own gather takes it), after one order check for all."""
        dtype = self.travel if dtype is None else dtype
        self.agree("all-gather", dtype, tuple((g, g.travel) for g in together))
        pending = self._issue(shard, dtype)
        for g in together:
            g.pending = g._issue(g.leaf, g.travel)
            self.state.started(g)
        return pending

    def _issue(self, shard: torch.Tensor, dtype: torch.dtype) -> _Pending:
        if dtype == shard.dtype:
            src = shard.detach()  # no cast: gather straight from the shard
        else:
            src = torch.empty(self.shard_numel, dtype=dtype, device=shard.device)
            pack_cast([shard.detach()], src)  # cast while writing the all-gather input
        out = torch.empty(self.world * self.shard_numel, dtype=dtype, device=shard.device)
        work = _all_gather(out, src, group=self.group, async_op=True)
        return _Pending(work, out, src)

    def gather(self, shard: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full parameters, parameter after parameter (``layout``), in the travel dtype (or
        ``dtype``, and later prefetches with it): prefetched if started in that dtype."""
        started = self.begin_gather(shard, self.dtype if dtype is None else dtype)
        return self.end_gather(started.out)

    def begin_gather(self, shard: torch.Tensor, dtype: torch.dtype) -> _Pending:
        """The pending gather in ``dtype`` (one in another dtype is waited for and dropped),
        started now unless it is; later prefetches gather in ``dtype``. ``all_gather_start``."""
        self.travel = dtype
        pending = self.pending
        if pending is not None and pending.out.dtype != dtype:  # started before the dtype changed
            self.wait(pending.work, "all-gather (prefetched)")
            pending = None
        if pending is None:
            pending = self.pending = self.start(shard, dtype, self.state.together(self, _in_backward()))
            self.state.started(self)
        return pending

    def end_gather(self, started: torch.Tensor) -> torch.Tensor:
        """Finish the pending gather whose output is ``started``, start the next one in the
        last pass's order, and reorder into parameter after parameter. ``all_gather_wait``."""
        pending = self.pending
        if pending is None or pending.out.data_ptr() != started.data_ptr():
            # Not the gather ``started`` names: it was drained at a pass's end (its forward
            # and this wait fell in two passes) or replaced. Its data may predate an optimizer
            # step: gather again now rather than read it.
            return self.gather(self.leaf, started.dtype)
        self.pending = None
        self.wait(pending.work, "all-gather")
        self._prefetch_next()
        return to_param_major(pending.out, self.slices, self.world)

    def gather_fp32(self) -> torch.Tensor:
        """The full fp32 parameters, outside any pass (state dicts, ``full_parameters``)."""
        pending = self.start(self.local, torch.float32)
        self.wait(pending.work, "all-gather (full parameters)")
        return to_param_major(pending.out, self.slices, self.world)

    def _prefetch_next(self) -> None:
        backward = _in_backward()
        state = self.state
        nxt = state.after(self, backward)
        if nxt is not None and nxt.pending is None:
            nxt.pending = nxt.start(nxt.leaf, together=state.together(nxt, backward, len(state.current)))
            state.started(nxt)

    def reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        self.agree("reduce-scatter", self.reduce_dtype)
        full = to_rank_major(grad.to(self.reduce_dtype), self.slices, self.world)
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=grad.device)
        self.wait(_reduce_scatter(out, full, group=self.group, async_op=True), "reduce-scatter")
        return out.div_(self.world)

    # -- gradients --
    def hold(self, grad: torch.Tensor) -> None:
        """``set_requires_gradient_sync(False)``: add the full gradient here, reduce nothing."""
        if self.held is None:
            self.held = grad.to(torch.float32, copy=True)
        else:
            accumulate_(self.held, grad)

    def take_held(self, grad: torch.Tensor) -> torch.Tensor:
        held, self.held = self.held, None
        return grad if held is None else accumulate_(held, grad)

    def add_grad(self, part: torch.Tensor) -> None:
        """Add this rank's reduced gradient into the parameters' ``.grad`` (DTensors)."""
        current = [s.param.grad for s in self.slices]
        if self.grad_buffer is not None and all(g is mine for g, mine in zip(current, self.grads)):
            accumulate_(self.grad_buffer, part)  # every .grad is still a view of ours: one fused pass
            return
        if all(g is None for g in current):
            buf = part if part.dtype == torch.float32 else part.float()  # part is ours: no copy
            self.grad_buffer = buf
            self.grads = [dtensor(s.local(buf), s.spec) for s in self.slices]
            for s, g in zip(self.slices, self.grads):
                s.param.grad = g
            return
        self.grad_buffer, self.grads = None, []  # someone set or dropped some: one at a time
        for s, g in zip(self.slices, current):
            piece = s.local(part)
            if g is None:
                s.param.grad = dtensor(piece.float().clone(), s.spec)
            else:
                g._local_tensor.add_(piece)


# --- gather ---------------------------------------------------------------------------------


@torch.library.custom_op("tracedac::all_gather", mutates_args=())
def all_gather(shard: torch.Tensor, flat: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full parameters of group ``flat``, parameter after parameter, in its travel dtype
    (or ``dtype``)."""
    return group_of(flat).gather(shard, dtype)


def _gathered_fake(shard, flat, dtype=None):
    """``all_gather``'s and ``all_gather_start``'s result: a full unit, rank- or param-major."""
    g = group_of(flat)
    return shard.new_empty(g.world * g.shard_numel, dtype=g.dtype if dtype is None else dtype)


all_gather.register_fake(_gathered_fake)


def _all_gather_setup(ctx, inputs, output):
    ctx.flat = inputs[1]


def _all_gather_backward(ctx, grad):
    """Reduce-scatter the full gradient into the parameters' .grad: one op (``reduce_grad``),
    so a compiled backward calls it at run time instead of tracing its Python."""
    torch.ops.tracedac.reduce_grad(grad, ctx.flat)
    # None: the gradient is in the parameters' .grad already (DTensors; the op's input is a
    # plain leaf over the same storage, which never gets a .grad).
    return None, None, None


all_gather.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)


# --- gather, split in two (compiled graphs: compile/gather_prefetch.py) ----------------------


@torch.library.custom_op("tracedac::all_gather_start", mutates_args=())
def all_gather_start(shard: torch.Tensor, flat: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Start the all-gather ``all_gather(shard, flat, dtype)`` would run and return its
    rank-major output buffer, still being written; ``all_gather_wait`` finishes it. A gather
    already started in that dtype (by the runtime prefetch) is the one returned."""
    g = group_of(flat)
    return g.begin_gather(shard, g.dtype if dtype is None else dtype).out


all_gather_start.register_fake(_gathered_fake)


@torch.library.custom_op("tracedac::all_gather_wait", mutates_args=())
def all_gather_wait(started: torch.Tensor, flat: str) -> torch.Tensor:
    """Wait for the all-gather ``all_gather_start`` returned ``started`` for; the full
    parameters, parameter after parameter, as ``all_gather`` returns them."""
    full = group_of(flat).end_gather(started)
    return full.clone() if full is started else full  # an op's result may not alias its input


@all_gather_wait.register_fake
def _all_gather_wait_fake(started, flat):
    return torch.empty_like(started)


@torch.library.custom_op("tracedac::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, flat: str) -> None:
    """The backward of a gather: reduce-scatter ``grad`` and add this rank's part into the
    parameters' ``.grad`` (or, while gradient sync is off, add it to the held full gradient).
    Registered effectful: it returns nothing, and a compiler must neither drop nor move it."""
    group = group_of(flat)
    if not group.sync:
        group.hold(grad)
        return
    group.add_grad(torch.ops.tracedac.reduce_scatter(group.take_held(grad), flat))


@reduce_grad.register_fake
def _reduce_grad_fake(grad, flat):
    return None


# --- reduce-scatter ---------------------------------------------------------------------------


@torch.library.custom_op("tracedac::reduce_scatter", mutates_args=())
def reduce_scatter(grad: torch.Tensor, flat: str) -> torch.Tensor:
    """This rank's part of ``grad`` summed over ranks / world, in the reduce dtype."""
    return group_of(flat).reduce_scatter(grad)


@reduce_scatter.register_fake
def _reduce_scatter_fake(grad, flat):
    g = group_of(flat)
    return grad.new_empty(g.shard_numel, dtype=g.reduce_dtype)


def _reduce_scatter_setup(ctx, inputs, output):
    ctx.flat, ctx.dtype = inputs[1], inputs[0].dtype


def _reduce_scatter_backward(ctx, grad):
    """The adjoint of sum-then-divide: every rank's part, all-gathered, divided by world."""
    g = group_of(ctx.flat)
    g.agree("adjoint all-gather", grad.dtype)
    out = grad.new_empty(g.world * g.shard_numel)
    g.wait(_all_gather(out, grad.contiguous(), group=g.group, async_op=True), "all-gather (reduce-scatter backward)")
    return to_param_major(out.div_(g.world), g.slices, g.world).to(ctx.dtype), None


reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_reduce_scatter_setup)


# --- release ----------------------------------------------------------------------------------


@torch.library.custom_op("tracedac::release", mutates_args=())
def release(full: torch.Tensor, flat: str) -> None:
    """Forget the unit's reference to a gathered buffer: its storage goes with its last view."""
    entry = _LIVE.pop(_address(full), None)
    if entry is not None:
        entry.full = None


@release.register_fake
def _release_fake(full, flat):
    return None


# Effectful ops return nothing and are kept in order: a compiler's dead-code elimination
# would otherwise drop them (a release nobody reads; a backward whose result is .grad).
for _op in (release, reduce_grad):
    _op.register_effect(EffectType.ORDERED)


class Gathered:
    """One gather done by a unit's forward, and the handles autograd saved on its buffer.

    In backward the first handle unpacked gathers the group again; the buffer is cached
    until every live handle has been unpacked in this backward (or dropped), then let go:
    each unit is gathered once per backward and freed after its last use. A later backward
    of the same graph (``retain_graph=True``) starts a new round and does the same.
    """

    __slots__ = ("flat", "dtype", "full", "alive", "remaining", "round", "cached", "__weakref__")

    def __init__(self, flat: FlatGroup, full: torch.Tensor):
        self.flat = flat
        self.dtype = full.dtype  # backward gathers in it again, whatever the group travels in by then
        self.full = full  # until release
        self.alive = 0  # handles not yet garbage collected
        self.remaining = 0  # of those, how many this round has not unpacked yet
        self.round = 0
        self.cached = None  # the buffer gathered again in backward
        _LIVE[_address(full)] = self

    def handle(self, t: torch.Tensor) -> Handle:
        self.alive += 1
        self.remaining += 1
        return Handle(self, t.size(), t.stride(), t.storage_offset())

    def regather(self) -> torch.Tensor:
        if self.cached is None:
            with torch.no_grad():
                self.cached = torch.ops.tracedac.all_gather(self.flat.leaf, self.flat.key, self.dtype)
        return self.cached

    def done(self, handle: Handle, dropped: bool) -> None:
        """``handle`` was unpacked or garbage collected: after the round's last, free the buffer."""
        if dropped:
            self.alive -= 1
        if handle.round != self.round:
            return  # already unpacked in this round
        handle.round += 1  # wanted again in the next round
        self.remaining -= 1
        if self.remaining <= 0:
            self.cached = None
            self.round += 1
            self.remaining = self.alive


class Handle:
    """What autograd (or a checkpoint region) holds for a tensor on a gathered buffer."""

    __slots__ = ("entry", "size", "stride", "offset", "round")

    def __init__(self, entry: Gathered, size, stride, offset):
        self.entry = entry
        self.size, self.stride, self.offset = size, stride, offset
        self.round = entry.round  # the first round (backward) it has not been unpacked in

    def unpack(self) -> torch.Tensor:
        entry = self.entry
        if entry.full is not None:  # the forward is still running: nothing was released
            return entry.full.as_strided(self.size, self.stride, self.offset)
        view = entry.regather().as_strided(self.size, self.stride, self.offset)
        entry.done(self, dropped=False)
        return view

    def __del__(self):
        self.entry.done(self, dropped=True)


def handle_for(t: torch.Tensor) -> Handle | None:
    """A handle if ``t`` lives on a buffer gathered by a forward still running, else None."""
    entry = _LIVE.get(_address(t))
    if entry is None or t.dtype != entry.dtype:
        return None
    return entry.handle(t)



class _GatheredOwner:
    """Lets a checkpoint region that reads a gathered parameter from outside hold a Handle."""

    def owns(self, t: torch.Tensor) -> bool:
        entry = _LIVE.get(_address(t))
        return entry is not None and t.dtype == entry.dtype

    def handle(self, t: torch.Tensor) -> Handle | None:
        return handle_for(t)


REBUILDERS.append(_GatheredOwner())
recompute_by_default(
    torch.ops.tracedac.all_gather.default,
    "keeping a gathered parameter pins the full unit after forward; ZeRO-3 gathers it again",
)
