"""Writes an op's schema does not declare.

The recorder learns what an op writes from its schema (``Tensor(a!)``). A few aten kernels
write an argument the schema leaves unannotated; replaying such an op as a pure function
would write a live tensor a second time (BatchNorm's running statistics updated again in
backward). This module is the one place that knows those ops, torch.distributed's in-place
collectives included (``_C10D_WRITES``).

Most of the list is torch's own: ``torch._C._SchemaInfo`` (what ``SchemaCheckMode`` and
the JIT's alias analysis use) special-cases the "training ops" whose arguments are mutable
exactly when a ``training`` / ``train`` / ``use_input_stats`` flag is true: ``batch_norm``,
``instance_norm``, ``_batch_norm_impl_index``, ``native_batch_norm`` (and ``.out``),
``cudnn_batch_norm``, ``miopen_batch_norm``. ``_EXTRA`` adds the kernels that list misses,
each with its reason; ``tests/test_effects.py`` checks every entry against the kernels
(on CPU: that the argument really changes) and that torch's list is found.

An op that names an unannotated tensor argument as written here is recorded as writing it
when the flag (if any) is true at the call; otherwise it is recorded as the schema says.
"""

from __future__ import annotations

import torch

__all__ = ["EXTRA", "hidden_writes", "writes_now"]

# The flags torch's SchemaInfo reads to decide whether a training op mutates its stats.
_FLAGS = ("training", "train", "use_input_stats")

# op name -> (written argument names, reason). Unconditional: no flag governs the write.
EXTRA: dict[str, tuple[tuple[str, ...], str]] = {
    "aten::batch_norm_update_stats": (
        ("running_mean", "running_var"),
        "its CPU and CUDA kernels update the running statistics in place (the channels-last "
        "and mixed-dtype batch-norm paths call it); torch's SchemaInfo does not list it",
    ),
    "aten::batch_norm_gather_stats": (
        ("running_mean", "running_var"),
        "SyncBatchNorm's CUDA kernel folds the gathered statistics into the running ones in place",
    ),
    "aten::batch_norm_gather_stats_with_counts": (
        ("running_mean", "running_var"),
        "SyncBatchNorm's CUDA kernel folds the gathered statistics into the running ones in place",
    ),
}

# torch.distributed's in-place collectives (``dist.all_reduce(t)`` dispatches
# ``c10d::allreduce_``): c10d's schemas annotate no write. Recorded, the write is kept and never
# replayed (``decisions.effect``); unrecorded, replay rebuilt the tensor from before the
# collective (a silently wrong gradient on more than one rank). Not covered: the list-of-lists
# outputs of ``allgather_``, ``gather_`` and ``allgather_coalesced_`` (``dist.all_gather`` into
# a list; ``dist.all_gather_into_tensor`` is ``_allgather_base_``).
_C10D_WRITES = {
    "allreduce_": "tensors",
    "allreduce_coalesced_": "tensors",
    "broadcast_": "tensors",
    "reduce_": "tensors",
    "_allgather_base_": "output_tensor",
    "allgather_into_tensor_coalesced_": "outputs",
    "_reduce_scatter_base_": "output_tensor",
    "reduce_scatter_tensor_coalesced_": "outputs",
    "reduce_scatter_": "output_tensors",
    "alltoall_base_": "output",
    "alltoall_": "output_tensors",
    "scatter_": "output_tensors",
    "recv_": "tensors",
    "recv_any_source_": "tensors",
}
EXTRA.update(
    {
        f"c10d::{op}": (
            (arg,),
            "a torch.distributed collective writes its result into this argument, "
            "which c10d's schema does not annotate",
        )
        for op, arg in _C10D_WRITES.items()
    }
)


def hidden_writes(func):
    """``(flag position, flag name, ((position, name), ...))`` for an op that writes
    arguments its schema leaves unannotated, or None. ``flag`` is None when the write is
    unconditional; otherwise the write happens only when that boolean argument is true."""
    schema = func._schema
    arguments = schema.arguments
    extra = EXTRA.get(schema.name)
    if extra is not None:
        written = tuple((i, a.name) for i, a in enumerate(arguments) if a.name in extra[0])
        return (None, None, written) if written else None
    flag = next(
        ((i, a.name) for i, a in enumerate(arguments) if a.name in _FLAGS and str(a.type) == "bool"), None
    )
    if flag is None:
        return None  # not a training op: SchemaInfo adds nothing to the annotations
    from torch._C import _SchemaArgType, _SchemaArgument, _SchemaInfo

    info = _SchemaInfo(schema)
    info.add_argument_values({flag[1]: True})
    written = tuple(
        (i, a.name)
        for i, a in enumerate(arguments)
        if a.type.isSubtypeOf(torch._C.OptionalType.ofTensor())
        and not (a.alias_info is not None and a.alias_info.is_write)
        and info.is_mutable(_SchemaArgument(_SchemaArgType.input, i))
    )
    return (flag[0], flag[1], written) if written else None


def writes_now(hidden, args, kwargs) -> tuple:
    """The ``(position, name)`` pairs ``hidden`` (from ``hidden_writes``) writes in this call."""
    pos, name, written = hidden
    if pos is None:
        return written
    on = args[pos] if pos < len(args) else kwargs.get(name, False)
    return written if on else ()
