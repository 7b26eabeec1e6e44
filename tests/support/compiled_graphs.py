"""The graphs AOTAutograd hands its compilers, read as torch wrote them, and counts of
``tracedac.zero``'s ops in them, for the compiled ZeRO-3 tests (tests/zero/test_compile.py,
tests/zero/test_tp.py, tests/zero/test_auto.py).
"""

from __future__ import annotations

import torch

BACKEND = "aot_eager_decomp_partition"
GATHER = torch.ops.tracedac.all_gather.default
RELEASE = torch.ops.tracedac.release.default
REDUCE = torch.ops.tracedac.reduce_grad.default
WAIT = torch.ops.tracedac.all_gather_wait.default
START = torch.ops.tracedac.all_gather_start.default


def fresh():
    """A fresh dynamo: no graph of an earlier model is reused."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 64  # every block instance is a cache entry of _call_impl


def compiled(m, how: str, backend=BACKEND, dynamic=None):
    """``m`` compiled fullgraph "whole" (what to call), or each of its blocks ("per-block",
    torchtitan's order: shard, checkpoint, then compile each block; call ``m``)."""
    if how == "whole":
        return torch.compile(m, fullgraph=True, backend=backend, dynamic=dynamic)
    for b in m.blocks:
        b.compile(fullgraph=True, backend=backend, dynamic=dynamic)
    return m


class Graphs:
    """``aot_eager_decomp_partition`` (``tracedac.inspect.compiled.partition_backend``), keeping
    the forward and backward graphs of each compile."""

    def __init__(self):
        from tracedac.inspect.compiled import partition_backend

        self.backend, self._made = partition_backend()

    @property
    def forward(self) -> list:
        return [p.fw for p in self._made]

    @property
    def backward(self) -> list:
        return [p.bw for p in self._made]


def count(gms, op) -> int:
    """Nodes of ``op`` in graphs ``gms``: the op itself, or ``with_effects(token, op, ...)``."""
    n = 0
    for gm in gms:
        for node in gm.graph.nodes:
            if node.target is op or (
                node.op == "call_function" and len(node.args) > 1 and node.args[1] is op
            ):
                n += 1
    return n


def gather_dtype(node) -> str:
    """The dtype a gather (or a gather's start) node asks for, as a string ("None": the group's own)."""
    return str(node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None))


def saved_gathered(gm) -> list:
    """Forward outputs (what backward is handed) computed from gathered parameters alone."""
    gathered = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and (
            n.target in (GATHER, START)
            or (n.all_input_nodes and all(a in gathered for a in n.all_input_nodes))
        ):
            gathered.add(n)
    return [n.name for n in gm.graph.output_node().args[0] if n in gathered]


def graph_counts(g: Graphs, m) -> dict:
    """Gathers (one op, or a start and a wait: gather_prefetch), releases and reduce_grads in
    the forward and backward graphs ``g`` kept of sharded model ``m``, what the forward saves
    of gathered parameters, and ``m``'s groups."""
    units = m._tracedac_zero.all_units
    return dict(
        fw_gathers=count(g.forward, GATHER) + count(g.forward, WAIT),
        fw_releases=count(g.forward, RELEASE),
        bw_gathers=count(g.backward, GATHER) + count(g.backward, WAIT),
        bw_reduces=count(g.backward, REDUCE),
        saved_gathered=[s for gm in g.forward for s in saved_gathered(gm)],
        bw_slice_scatters=count(g.backward, torch.ops.aten.slice_scatter.default)
        + count(g.backward, torch.ops.aten.slice_backward.default),
        trainable_groups=sum(1 for u in units for grp in u.groups if grp.requires_grad),
        groups=sum(len(u.groups) for u in units),
        keys=len({grp.key for u in units for grp in u.groups}),
        graphs=(len(g.forward), len(g.backward)),
    )
