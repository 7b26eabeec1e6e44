"""The joint-graph pass that moves autocast's downcast of gathered parameters into the gather.

Under ``torch.autocast`` a sharded unit gathers its fp32 parameters and autocast casts each
one to bf16 before the matmul that reads it: the wire carries fp32 and a full fp32 copy of
the unit exists for nothing. DeepSpeed's DeepCompile fuses the two ("fuse allgather and
downcast"); here the gather is one op whose ``dtype`` argument already casts while packing
the all-gather input (``pack_cast``), so the fusion is a rewrite of the graph.

Requires: a joint graph before partitioning, the first of ``passes.PASSES``: its gathers
whole (``tracedac::all_gather``; ``gather_prefetch`` splits them later) and its casts still
nodes of their own, untagged (``tag_regions`` runs after, on the graph without them). A
graph with no gather is returned as it is.

Provides: ``fuse_gather_casts(gm) -> gm``, on the forward nodes of a joint graph, for each
``tracedac::all_gather(shard, key)`` whose every use is, through views only (``slice``,
``view``, an expert's ``select``: any op torch marks ``is_view``), a cast to one
lower-precision dtype (``prims.convert_element_type`` or ``aten._to_copy``), ignoring the
unit's ``release``:

- the gather node gets ``dtype`` (``all_gather(shard, key, dtype=...)``): same node, new dtype;
- its views keep their arguments; their ``meta["val"]`` takes the new dtype;
- every cast node is removed, its users reading the view directly.

Nothing else is added or removed. A gather with any other use (a LayerNorm weight read in
fp32, a parameter used both ways) is left as it is: its group travels in its own dtype.
Values are bit-identical (a cast moves before a copy), and backward is unchanged: the joint
graph's backward already receives the gradient through the removed cast's own backward (a
cast back to fp32) and reduce-scatters it in the group's reduce dtype. The recomputed gather
in backward (``zero_tags``) is this node, so backward gathers bf16 too.
"""

from __future__ import annotations

import operator

import torch

from ...record.op_info import LOW_DTYPES, cast_dtype
from ..vocab import backward_nodes, zero_op

__all__ = ["fuse_gather_casts"]


def _is_view(user, node) -> bool:
    """Whether ``user`` is a view of ``node`` (``slice``, ``view``, an expert's ``select``...), or
    an item of a multi-result view (``split``, ``unbind``)."""
    target = user.target
    if target is operator.getitem:
        return (
            node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and node.target.is_view
        )
    return isinstance(target, torch._ops.OpOverload) and target.is_view and user.args[0] is node


def _is_release(node) -> bool:
    release = zero_op("release")
    return node.target is release or (
        node.target is torch.ops.higher_order.with_effects and len(node.args) > 1 and node.args[1] is release
    )


def _uses(gather, backward) -> tuple[list, list] | None:
    """(views, casts) reached from ``gather`` through views, or None if anything else reads it."""
    views, casts, todo = [], [], [gather]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in backward:
                return None  # backward reads the gathered value itself, not a cast of it
            if node is gather and _is_release(user):
                continue
            if _is_view(user, node):
                views.append(user)
                todo.append(user)
            elif cast_dtype(user.target, user.args, user.kwargs) is not None:
                casts.append(user)
            else:
                return None
    return views, casts


def _retyped(node, dtype) -> None:
    """``node``'s fake value (a tensor, or the list a ``split`` returns) in ``dtype``."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    def retype(v):
        return v.new_empty_strided(v.size(), v.stride(), dtype=dtype) if isinstance(v, torch.Tensor) else v

    val = node.meta.get("val")
    node.meta["val"] = type(val)(retype(v) for v in val) if isinstance(val, (list, tuple)) else retype(val)
    if isinstance(node.meta["val"], torch.Tensor) and "tensor_meta" in node.meta:
        node.meta["tensor_meta"] = _extract_tensor_metadata(node.meta["val"])


def fuse_gather_casts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    gather = zero_op("all_gather")
    gathers = gm.graph.find_nodes(op="call_function", target=gather) if gather is not None else []
    if not gathers:
        return gm
    backward = backward_nodes(gm.graph)
    changed = False
    for node in gathers:
        if node in backward:
            continue  # a gather backward recomputes
        found = _uses(node, backward)
        if found is None:
            continue
        views, casts = found
        dtypes = {cast_dtype(c.target, c.args, c.kwargs) for c in casts}
        if len(dtypes) != 1 or next(iter(dtypes)) not in LOW_DTYPES:
            continue
        dtype = dtypes.pop()
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
            continue  # the group travels in a low dtype already (MixedPrecision)
        # in the form the node has it: inductor's lowering checks the arguments against
        # those it was traced with (their number, which are keywords)
        if len(node.args) > 2:
            node.args = (*node.args[:2], dtype)
        else:
            node.kwargs = {**node.kwargs, "dtype": dtype}
        for n in (node, *views):
            _retyped(n, dtype)
        for c in casts:
            c.replace_all_uses_with(c.args[0])
            gm.graph.erase_node(c)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
