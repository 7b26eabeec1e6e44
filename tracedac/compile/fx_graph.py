"""A region of a joint graph as the graph policies and planners read (``tracedac.graph``).

The forward nodes of one compiled region become ``Node``s of a ``RegionGraph``: the same
``op``, ``outputs`` (shape, dtype, bytes from the node's fake value, symbolic sizes at their
hints), ``flops``, ``labels``, ``module_path`` and ``is_random`` a recorded node has, so every
policy and planner decides on it unchanged. The joint graph is functional: each op result
is a new storage (a group born at state 0, never written), views and ``getitem`` share their
base's group, and a value from outside the region is an external group (free to read, as a
region input is in eager). Nodes that compute nothing replayable (symbolic ints, effects)
are left out.
"""

from __future__ import annotations

import operator

import torch

from .._compat import optimization_hint
from ..record.graph import Group, Node, RegionGraph, TensorMeta
from .names import module_path

__all__ = ["RegionView", "build"]


def _int(x) -> int:
    return optimization_hint(x, fallback=4096) if isinstance(x, torch.SymInt) else int(x)


class RegionView:
    """One compiled region: its ``RegionGraph`` and the map between its nodes and FX nodes."""

    def __init__(self, name: str, policy):
        self.graph = RegionGraph(name, policy)
        self.values: dict = {}  # fx node -> TensorMeta (or a tuple of them for a multi-output op)
        self.fx_of: dict[int, torch.fx.Node] = {}  # Node.index -> fx node
        self.group_fx: dict[int, torch.fx.Node] = {}  # group id -> fx node that created it

    def _group(self, val, creator) -> Group:
        g = Group(len(self.graph.groups), _int(val.numel()) * val.dtype.itemsize, val.device)
        g.creator = creator
        self.graph.groups.append(g)
        return g

    def _meta(self, val, g: Group) -> TensorMeta:
        return TensorMeta(
            g.id,
            0,
            val.dtype,
            tuple(_int(s) for s in val.shape),
            tuple(_int(s) for s in val.stride()),
            _int(val.storage_offset()),
        )

    def value(self, n):
        """The TensorMeta of fx value ``n`` (an outside value becomes an external group)."""
        m = self.values.get(n)
        if m is None:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return None
            m = self.values[n] = self._meta(val, self._group(val, None))
        return m

    def _arg(self, a):
        if isinstance(a, torch.fx.Node):
            m = self.value(a)
            if m is not None:
                return m
            val = a.meta.get("val")
            return _int(val) if isinstance(val, torch.SymInt) else val
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        return _int(a) if isinstance(a, torch.SymInt) else a

    def _label(self, m: TensorMeta, labels: frozenset) -> None:
        """A label on a view or on one result of several names the storage's producer, as
        ``tracedac.name`` does eagerly."""
        creator = self.graph.groups[m.group].creator if labels else None
        if creator is not None:
            creator.labels = creator.labels | labels

    def add(self, n: torch.fx.Node, labels: frozenset) -> None:
        """Add forward node ``n`` of the region (in graph order)."""
        val = n.meta.get("val")
        if n.target is operator.getitem:
            base = self.values.get(n.args[0])
            if isinstance(base, tuple) and base[n.args[1]] is not None:
                self.values[n] = base[n.args[1]]
                self._label(self.values[n], labels)
            return
        op = n.target
        if not isinstance(op, torch._ops.OpOverload):
            return  # symbolic arithmetic, effects: nothing a policy decides on
        tensors = val if isinstance(val, (list, tuple)) else (val,)
        if not any(isinstance(t, torch.Tensor) for t in tensors):
            return
        if getattr(op, "is_view", False) and all(isinstance(t, torch.Tensor) for t in tensors):
            base = next(
                (
                    self.value(a)
                    for a in n.args
                    if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
                ),
                None,
            )
            if base is not None:  # a view of a value in the region's graph: same storage, no node
                # (``split``/``unbind`` return several views of it: each shares its storage too)
                views = tuple(
                    TensorMeta(
                        base.group,
                        0,
                        t.dtype,
                        tuple(_int(s) for s in t.shape),
                        tuple(_int(s) for s in t.stride()),
                        _int(t.storage_offset()),
                    )
                    for t in tensors
                )
                self.values[n] = views[0] if isinstance(val, torch.Tensor) else views
                self._label(base, labels)
                return
        args = tuple(self._arg(a) for a in n.args)
        kwargs = {k: self._arg(v) for k, v in n.kwargs.items()}
        random = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
        node = Node(
            len(self.graph.nodes),
            op,
            args,
            kwargs,
            (),
            (),
            (),
            _COMPILED_RNG if random else None,
            module_path(n),
            n.meta.get("stack_trace"),
        )
        node.labels = labels
        outputs, creates = [], []
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor):
                g = self._group(t, node)
                self.group_fx[g.id] = n
                outputs.append(self._meta(t, g))
                creates.append(i)
            else:
                outputs.append(None)
        node.outputs, node.creates = tuple(outputs), tuple(creates)
        self.values[n] = node.outputs[0] if isinstance(val, torch.Tensor) else node.outputs
        self.graph.nodes.append(node)
        self.fx_of[node.index] = n


_COMPILED_RNG = (None, "compiled", None)  # graph.Node.rng's shape: the compiler keeps the state


def build(name: str, policy, nodes, labels) -> RegionView:
    """The region of ``nodes`` (one region's forward FX nodes, in graph order); ``labels``
    maps an fx node to the ``tracedac.name`` labels of its value."""
    view = RegionView(name, policy)
    for n in nodes:
        view.add(n, labels.get(n, frozenset()))
    return view
