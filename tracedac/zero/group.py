"""A unit's flat groups and their collectives: ``FlatGroup`` owns one group of parameters'
flat fp32 shard buffer, its process group, dtypes and layout, and runs the all-gathers and
reduce-scatters the ``tracedac::`` ops ask for (``tracedac/ops/zero.py``: each op names its
group by a string key, under which the group registers itself), with an order check before
each so that ranks never pair different collectives; and the buffers gathered by a forward
still running (``LIVE``), until ``tracedac::release``.
"""

from __future__ import annotations

import itertools
import weakref
import zlib

import torch
import torch.distributed as dist

from ..agreements import host_group
from ..errors import ZeroError
from ..ops import accumulate_, pack_cast
from ..ops.zero import GROUPS
from ..record.op_info import storage_address
from .inflight import Joint, Pending
from .layout import dtensor, parameter, to_param_major, to_rank_major

__all__ = ["LIVE", "FlatGroup"]

# torch 2.13 names the tensor collectives *_single and deprecates *_into_tensor / *_tensor.
# gloo implements both on CPU (bf16 included).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_KEYS = itertools.count()
_WHAT = {"all-gather": 0, "reduce-scatter": 1, "adjoint all-gather": 2}
_WHAT_NAMES = {v: k for k, v in _WHAT.items()}
# storage address -> ``gathered.Gathered``: buffers gathered by a forward pre-hook, until released
LIVE: dict = {}


def _dtype_code(dtype: torch.dtype) -> int:
    """The same integer on every rank for the same dtype (an order check's column)."""
    return zlib.crc32(str(dtype).encode())


def _dtype_named(code: int) -> str:
    known = (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
    return next((str(d) for d in known if _dtype_code(d) == code), "another dtype")


def _graph_task() -> int:
    """The autograd engine's id of the backward running on this thread; -1 outside one."""
    return torch._C._current_graph_task_id()


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return _graph_task() != -1


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
        GROUPS[self.key] = self
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
        self.pending: Pending | None = None
        self.travel = dtype  # the dtype the last gather asked for: what a prefetch gathers in
        self.sync = True  # reduce-scatter gradients in backward (False: accumulate them unsharded)
        self.held: torch.Tensor | None = None  # the unsharded gradient accumulated while sync is off
        # Weak references: the flat fp32 gradient the .grad DTensors view, and those DTensors.
        # Held strongly, they kept every gradient after ``zero_grad(set_to_none=True)``, to the
        # next backward's reduction: a rank's whole gradient shard held for nothing, into its peak.
        self.grad_buffer: weakref.ref | None = None
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
        if work is None:  # one rank: nothing was sent (``_issue``)
            return
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
        group, device = host_group(self.group, self.local.device)  # NCCL: its gloo twin, rows on the CPU
        run = ((self, dtype), *together)
        numel = sum(g.shard_numel for g, _ in run)
        every = zlib.crc32(" ".join(f"{g.name}:{d}" for g, d in run).encode())
        mine = torch.tensor(
            [_WHAT[what], numel, self.crc, _dtype_code(dtype), len(run), every],
            dtype=torch.int64,
            device=device,
        )
        rows = torch.empty(self.world, mine.numel(), dtype=torch.int64, device=device)
        self.wait(_all_gather(rows.view(-1), mine, group=group, async_op=True), f"{what} (order check)")
        if bool((rows == mine).all()):
            return
        r = next(r for r in range(self.world) if not bool((rows[r] == mine).all()))
        kind, _, crc, code, count, _ = rows[r].tolist()
        more = f" (and {len(run) - 1} more of its unit's groups)" if len(run) > 1 else ""
        if (
            kind == _WHAT[what] and crc == self.crc and count == len(run)
        ):  # the same collective: dtypes differ
            theirs = f" in {_dtype_named(code)}" if code != _dtype_code(dtype) else " in other dtypes"
            raise ZeroError(
                f"rank {self.rank} is at the {what} of {self.name}{more} in {dtype} but rank {r} is at "
                f"the same {what}{theirs}: the ranks gather or reduce this group in "
                "different dtypes (a forward under torch.autocast on some ranks only, with "
                'MixedPrecision("auto") or a fused cast). Run every rank\'s forward under the same '
                "autocast; nothing was exchanged."
            )
        if kind == _WHAT[what] and crc == self.crc:  # the same gather, started with other groups
            raise ZeroError(
                f"rank {self.rank} is at the {what} of {self.name} with {len(run) - 1} more of its unit's "
                f"groups, as the last pass ran them, but rank {r} is at it with {count - 1}: one of them "
                "left the last pass's order, so the ranks run different units (a branch taken on some "
                "ranks only, a unit skipped, a parameter that gets a gradient on some ranks only, a "
                "different number of forwards). Every rank must run the same units in the same order; "
                "nothing was exchanged."
            )
        theirs = next(
            (g.name for g in list(GROUPS.values()) if g.crc == crc), "a group this rank does not know"
        )
        raise ZeroError(
            f"rank {self.rank} is at the {what} of {self.name}{more} but rank {r} is at the "
            f"{_WHAT_NAMES.get(kind, 'unknown collective')} of {theirs}"
            f"{f' (and {count - 1} more)' if count > 1 else ''}: the ranks run different "
            "units (a branch taken on some ranks only, a unit skipped, a parameter that gets a "
            "gradient on some ranks only, a different number of forwards). Every rank must run the "
            "same units in the same order; nothing was exchanged."
        )

    def start(self, shard: torch.Tensor, dtype: torch.dtype | None = None, together: tuple = ()) -> Pending:
        """Start the all-gather of ``shard`` in the travel dtype (or ``dtype``), asynchronously,
        and then those of ``together``'s groups (each from its own buffer in its travel dtype,
        pending until its own gather takes it), after one order check for all."""
        dtype = self.travel if dtype is None else dtype
        self.agree("all-gather", dtype, tuple((g, g.travel) for g in together))
        if together and self.world > 1:
            joint = Joint(self.world, [(self, shard, dtype), *((g, g.leaf, g.travel) for g in together)])
            joint.work = _all_gather(joint.out, joint.src, group=self.group, async_op=True)
            pending, *rest = joint.parts()
        else:  # alone, or one rank: a collective is a local copy there, and one per group copies least
            pending, rest = self._issue(shard, dtype), [g._issue(g.leaf, g.travel) for g in together]
        for g, p in zip(together, rest):
            g.pending = p
            self.state.started(g)
        return pending

    def _issue(self, shard: torch.Tensor, dtype: torch.dtype) -> Pending:
        if self.world == 1:  # nothing to exchange: the cast (or a copy) is the whole gather
            out = torch.empty(self.shard_numel, dtype=dtype, device=shard.device)
            pack_cast([shard.detach()], out)
            return Pending(None, out, None)
        if dtype == shard.dtype:
            src = shard.detach()  # no cast: gather straight from the shard
        else:
            src = torch.empty(self.shard_numel, dtype=dtype, device=shard.device)
            pack_cast([shard.detach()], src)  # cast while writing the all-gather input
        out = torch.empty(self.world * self.shard_numel, dtype=dtype, device=shard.device)
        work = _all_gather(out, src, group=self.group, async_op=True)
        return Pending(work, out, src)

    def gather(self, shard: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full parameters, parameter after parameter (``layout``), in the travel dtype (or
        ``dtype``, and later prefetches with it): prefetched if started in that dtype."""
        return self._finish(self.begin_gather(shard, self.dtype if dtype is None else dtype))

    def begin_gather(self, shard: torch.Tensor, dtype: torch.dtype) -> Pending:
        """The pending gather in ``dtype`` (one in another dtype is waited for and dropped),
        started now unless it is; later prefetches gather in ``dtype``. ``all_gather_start``."""
        self.travel = dtype
        pending = self.pending
        if pending is not None and pending.dtype != dtype:  # started before the dtype changed
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
        if pending is None or not pending.wrote(started):
            # Not the gather ``started`` names: it was drained at a pass's end (its forward
            # and this wait fell in two passes) or replaced. Its data may predate an optimizer
            # step: gather again now rather than read it.
            return self.gather(self.leaf, started.dtype)
        return self._finish(pending)

    def _finish(self, pending: Pending) -> torch.Tensor:
        """Wait for ``pending``, the group's, start the next gather, reorder parameter after parameter."""
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
        # One rank: a gather is a cast on the compute stream, so one started early overlaps
        # nothing and only holds the next unit sooner (FSDP2 copies at the wait there too).
        if nxt is not None and nxt.pending is None and self.world > 1:
            nxt.pending = nxt.start(nxt.leaf, together=state.together(nxt, backward, len(state.current)))
            state.started(nxt)

    def reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        if self.world == 1:  # nothing to sum: the gradient in the reduce dtype, a buffer of its own
            return grad.to(self.reduce_dtype, memory_format=torch.contiguous_format, copy=True)
        self.agree("reduce-scatter", self.reduce_dtype)
        full = to_rank_major(grad.to(self.reduce_dtype), self.slices, self.world)
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=grad.device)
        self.wait(_reduce_scatter(out, full, group=self.group, async_op=True), "reduce-scatter")
        return out.div_(self.world)

    def reduce_scatter_with(self, grad: torch.Tensor, together: list) -> list[torch.Tensor]:
        """``reduce_scatter`` of ``grad`` and of ``together``'s ``(group, grad)`` pairs (the rest
        of its unit's groups, one reduce dtype) in one collective, after one order check: every
        group's rank-major columns side by side (one ``cat``), reduce-scattered once, this
        rank's part cut back into each group's own buffer. Returns the parts, in order."""
        run = [(self, grad), *together]
        self.agree("reduce-scatter", self.reduce_dtype, tuple((g, g.reduce_dtype) for g, _ in together))
        world, columns = self.world, []
        for g, full in run:
            sizes = [s.chunk for s in g.slices]
            pieces = full.split_with_sizes([world * n for n in sizes])
            columns += [p.view(world, n) for p, n in zip(pieces, sizes)]
        numel = sum(g.shard_numel for g, _ in run)
        sent = torch.empty(world, numel, dtype=self.reduce_dtype, device=grad.device)
        torch.cat(columns, dim=1, out=sent)  # cast to the reduce dtype on the way
        out = sent.new_empty(numel)
        self.wait(_reduce_scatter(out, sent.view(-1), group=self.group, async_op=True), "reduce-scatter")
        out.div_(world)
        # Each group's part in its own buffer: add_grad keeps a part as its .grad storage.
        return [part.clone() for part in out.split([g.shard_numel for g, _ in run])]

    def adjoint_all_gather(self, grad: torch.Tensor) -> torch.Tensor:
        """The adjoint of ``reduce_scatter`` (sum-then-divide): every rank's part, all-gathered,
        divided by world, parameter after parameter."""
        if self.world == 1:
            return grad.clone()
        self.agree("adjoint all-gather", grad.dtype)
        out = grad.new_empty(self.world * self.shard_numel)
        self.wait(
            _all_gather(out, grad.contiguous(), group=self.group, async_op=True),
            "all-gather (reduce-scatter backward)",
        )
        return to_param_major(out.div_(self.world), self.slices, self.world)

    def release(self, full: torch.Tensor) -> None:
        """``tracedac::release``: forget the unit's reference to a buffer it gathered in forward,
        so its storage goes with its last view."""
        entry = LIVE.pop(storage_address(full), None)
        if entry is not None:
            entry.full = None

    # -- gradients --
    def reduce_grad(self, grad: torch.Tensor) -> None:
        """``tracedac::reduce_grad``, a gather's backward: reduce-scatter ``grad`` and add this
        rank's part into the parameters' ``.grad`` (with the unit's other groups once the order is
        learned: ``Prefetch.reduce``), or, while gradient sync is off, hold it unsharded."""
        if not self.sync:
            self.hold(grad)
            return
        self.state.reduce(self, grad)

    def hold(self, grad: torch.Tensor) -> None:
        """``set_requires_gradient_sync(False)``: add the full gradient here, reduce nothing."""
        if self.held is None:
            self.held = grad.to(torch.float32, copy=True)
        else:
            accumulate_(self.held, grad)

    def take_held(self, grad: torch.Tensor) -> torch.Tensor:
        held, self.held = self.held, None
        return grad if held is None else accumulate_(held, grad)

    def add_grad(self, part: torch.Tensor, owned: bool = True) -> None:
        """Add this rank's reduced gradient into the parameters' ``.grad`` (DTensors).
        ``owned``: ``part`` is a buffer nobody else holds, which may become the ``.grad``s'."""
        current = [s.param.grad for s in self.slices]
        buf = self.grad_buffer() if self.grad_buffer is not None else None
        if buf is not None and all(g is not None and g is mine() for g, mine in zip(current, self.grads)):
            accumulate_(buf, part)  # every .grad is still a view of ours (keeping it alive): one fused pass
            return
        if all(g is None for g in current):
            if owned and part.dtype == torch.float32:
                buf = part  # ours: no copy
            else:
                buf = part.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            grads = [dtensor(s.local(buf), s.spec) for s in self.slices]
            for s, g in zip(self.slices, grads):
                s.param.grad = g
            self.grad_buffer, self.grads = weakref.ref(buf), [weakref.ref(g) for g in grads]
            return
        self.grad_buffer, self.grads = None, []  # someone set or dropped some: one at a time
        for s, g in zip(self.slices, current):
            piece = s.local(part)
            if g is None:
                s.param.grad = dtensor(piece.float().clone(), s.spec)
            else:
                g._local_tensor.add_(piece)
