"""ZeRO-3's collectives as ``torch.library`` custom ops: their schemas, fakes, autograd and
effects. What they run is the flat group's (``tracedac/zero/group.py``): each op names its
group by a string key, and ``group_of(key)`` finds the group ``FlatGroup`` registered under it
(``GROUPS``).

- ``tracedac::all_gather(shard, flat, dtype=None) -> full``: cast this rank's fp32 buffer
  into the all-gather input (``pack_cast``, one fused pass), all-gather in the group's travel
  dtype (or ``dtype``: the compiled graph's cast moved into the gather by
  ``compile/passes/gather_cast.py``), and reorder rank-major into parameter after parameter
  (``layout``); with one rank, the cast alone. Backward:
  ``reduce_scatter`` the full gradient (with two ranks or more, once the order is learned,
  in one collective with the rest of its unit's groups: ``Prefetch.reduce``; with one rank,
  none) and add it into the parameters' DTensor ``.grad`` with ``accumulate_`` (or keep it
  unsharded while gradient sync is off).
- ``tracedac::reduce_scatter(grad, flat) -> part``: this rank's part of the gradient summed
  over ranks, in the reduce dtype, divided by the world size (ranks average, as DDP and
  FSDP do). Backward: its adjoint, an all-gather divided by the world size.
- ``tracedac::release(full, flat)``: the end of a gathered buffer's forward life: the group
  forgets the one reference its unit held, so the storage goes with the last view.
- ``tracedac::reduce_grad(grad, flat)``: the gather's backward, an op so that a compiled
  backward runs it rather than tracing its Python state (held gradients, ``.grad``).
- ``tracedac::all_gather_start(shard, flat, dtype=None)`` / ``all_gather_wait(started, flat)``:
  a gather in two, which ``compile/passes/gather_prefetch.py`` puts in a compiled forward in place
  of ``all_gather`` so that the next unit's all-gather is in flight during this unit's
  compute. Forward only (the joint graph is already differentiated): no autograd of their own.

``release`` and ``reduce_grad`` return nothing and are registered effectful: compilers keep
them, in order (dead-code elimination would drop an op whose result nobody reads).

Ops take the group as a string key (a custom op cannot take a Python object; a string,
unlike an int, stays a constant under dynamic shapes): the ``FlatGroup`` holds the process
group, dtypes and layout. Being ops, they dispatch to tracedac's ``TracerMode`` as one node
each, and to any other mode or tracer. A region replays a gather rather than keeping it:
``tracedac.zero`` registers that (``record.decisions.recompute_by_default``).
"""

from __future__ import annotations

import weakref

import torch
from torch._library.effects import EffectType

from ..errors import ZeroError

__all__ = [
    "GROUPS",
    "all_gather",
    "all_gather_start",
    "all_gather_wait",
    "group_of",
    "reduce_grad",
    "reduce_scatter",
    "release",
]

# key -> the flat group (``tracedac.zero.group.FlatGroup``) that registered itself under it.
# A group provides: ``gather(shard, dtype)``, ``begin_gather(shard, dtype).out``,
# ``end_gather(started)``, ``reduce_grad(grad)``, ``reduce_scatter(grad)``,
# ``adjoint_all_gather(grad)``, ``release(full)``, and ``world``, ``shard_numel``, ``dtype``,
# ``reduce_dtype`` for the fakes.
GROUPS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def group_of(key: str):
    group = GROUPS.get(key)
    if group is None:
        raise ZeroError(
            f"sharded parameter group {key} no longer exists (its model was garbage collected); "
            "a graph recorded on that model cannot be replayed. Keep the model alive until "
            "backward has run."
        )
    return group


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


# --- gather, split in two (compiled graphs: compile/passes/gather_prefetch.py) ----------------------


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
    group_of(flat).reduce_grad(grad)


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
    return group_of(ctx.flat).adjoint_all_gather(grad).to(ctx.dtype), None


reduce_scatter.register_autograd(_reduce_scatter_backward, setup_context=_reduce_scatter_setup)


# --- release ----------------------------------------------------------------------------------


@torch.library.custom_op("tracedac::release", mutates_args=())
def release(full: torch.Tensor, flat: str) -> None:
    """Forget the unit's reference to a gathered buffer: its storage goes with its last view."""
    group_of(flat).release(full)


@release.register_fake
def _release_fake(full, flat):
    return None


# Effectful ops return nothing and are kept in order: a compiler's dead-code elimination
# would otherwise drop them (a release nobody reads; a backward whose result is .grad).
for _op in (release, reduce_grad):
    _op.register_effect(EffectType.ORDERED)
