"""The region graph: what a checkpointed forward did, recorded op by op.

Values are tracked at the level of storages, because that is where aliasing and mutation
live. Every tensor a recorded op reads or returns belongs to a *group* (one storage). A
group is born either outside the region (an *external*: an input, a parameter, a buffer) or
from the node that allocated it (its *creator*). Nodes that write into a group's storage
(``add_``, ``index_put_``, ``copy_`` into a slice) are its *mutations*, and the group's
*state* is how many of them have run. A tensor is then fully described by its group, the
state it was read in, and its geometry (dtype, size, stride, storage offset): views cost
nothing to rebuild, and replaying a group's creator and then its mutations, in recorded
order, reproduces any state exactly.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import MutableMapping
from typing import Any

import torch

__all__ = [
    "Group",
    "Layout",
    "Node",
    "NodeMeta",
    "RegionGraph",
    "TensorMeta",
    "flatten_outputs",
    "human_bytes",
    "op_flops",
]


class TensorMeta:
    """One tensor as a recorded op saw it: its storage group, that group's state, and layout."""

    __slots__ = ("group", "state", "dtype", "size", "stride", "offset")

    def __init__(self, group: int, state: int, dtype, size: tuple, stride: tuple, offset: int):
        self.group = group
        self.state = state
        self.dtype = dtype
        self.size = size
        self.stride = stride
        self.offset = offset

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.size)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"TensorMeta(group={self.group}, state={self.state}, {self.dtype}, {list(self.size)})"


class Layout:
    """A tensor argument whose data the op never reads, only its layout: ``empty_like``'s,
    ``zeros_like``'s, ``new_zeros``' ``self``. It ties the node to no storage, so replay does
    not rebuild a tensor (a dropout mask's ``empty_like(x)`` does not replay ``x``): it passes
    a fresh, uninitialized tensor laid out the same way."""

    __slots__ = ("dtype", "size", "stride", "device")

    def __init__(self, t: torch.Tensor):
        self.dtype, self.size, self.stride, self.device = t.dtype, t.size(), t.stride(), t.device

    def tensor(self) -> torch.Tensor:
        return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return f"Layout({self.dtype}, {list(self.size)}, stride={list(self.stride)})"


_NO_LABELS: frozenset = frozenset()  # shared: an empty frozenset is a new object each time


class Node:
    """One recorded aten (or custom) op. Also the view a policy receives.

    A policy may read ``op``, ``name``, ``outputs`` (their ``shape``, ``dtype``, ``nbytes``),
    ``nbytes``, ``labels``, ``module_path``, ``flops`` and ``is_random``; after the
    decision, ``decision`` (also as ``meta["recompute"]``, where torch's nodes carry it).
    """

    __slots__ = (
        "index",
        "op",
        "args",
        "kwargs",
        "outputs",
        "writes",
        "creates",
        "rng",
        "labels",
        "module_path",
        "source",
        "decision",
        "_flops",
        "_meta",
    )

    def __init__(self, index, op, args, kwargs, outputs, writes, creates, rng, module_path, source):
        self.index = index
        self.op = op
        # tensors replaced by TensorMeta (lists of tensors by lists of them), or by a Layout
        # where the op reads only that
        self.args = args
        self.kwargs = kwargs
        self.outputs = outputs  # one TensorMeta (or None for a non-tensor) per flattened output
        self.writes = writes  # group ids whose storage this op writes
        self.creates = creates  # output indices whose storage this op allocated
        # random ops: (generator, its state before the op or None, the random node whose
        # replay leaves the generator in that state, or None); in a compiled region's graph
        # (None, "compiled", None): the compiler keeps the state, no predecessor to replay
        self.rng = rng
        self.labels: frozenset[str] = _NO_LABELS
        self.module_path = module_path
        self.source = source
        self.decision = None  # the CheckpointPolicy decided for this node
        self._flops = None
        self._meta = None  # made on first use of ``meta``: most nodes never need one

    @property
    def meta(self) -> NodeMeta:
        """A dict like torch's ``fx.Node.meta``; ``meta["recompute"]`` is ``decision`` (read
        and written through), every other key is stored on the node."""
        if self._meta is None:
            self._meta = NodeMeta(self)
        return self._meta

    @property
    def name(self) -> str:
        return str(self.op)

    @property
    def is_random(self) -> bool:
        return self.rng is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this node allocated (what keeping its result costs)."""
        return sum(self.outputs[i].nbytes for i in self.creates)

    @property
    def replayable(self) -> bool:
        """False once the region ended and decided nothing will replay this node."""
        return self.args is not None

    def forget_arguments(self) -> None:
        self.args = self.kwargs = self.rng = None

    @property
    def tensor_args(self) -> tuple:
        """The TensorMeta of every tensor argument, lists included, in order."""
        metas = []
        # (most nodes have no keyword arguments: no tuple of both made for them)
        for a in (*self.args, *self.kwargs.values()) if self.kwargs else self.args:
            if isinstance(a, TensorMeta):
                metas.append(a)
            elif isinstance(a, (list, tuple)):
                metas.extend([x for x in a if isinstance(x, TensorMeta)])
        return tuple(metas)

    @property
    def flops(self) -> int:
        """FLOPs by torch's own formulas (``torch.utils.flop_counter``); 0 for ops it does not cost."""
        if self._flops is None:
            if self.args is None:
                return 0  # forgotten when the region ended (nothing replays it)
            self._flops = op_flops(self.op, self.args, self.kwargs, self.outputs)
        return self._flops

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.name})"


class NodeMeta(MutableMapping):
    """``Node.meta``: ``"recompute"`` is the node's ``decision``; other keys live here."""

    __slots__ = ("node", "extra")

    def __init__(self, node: Node):
        self.node = node
        self.extra: dict[str, Any] = {}

    def __getitem__(self, key: str):
        if key == "recompute":
            if self.node.decision is None:
                raise KeyError(key)
            return self.node.decision
        return self.extra[key]

    def __setitem__(self, key: str, value) -> None:
        if key == "recompute":
            self.node.decision = value
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key == "recompute":
            if self.node.decision is None:
                raise KeyError(key)
            self.node.decision = None
        else:
            del self.extra[key]

    def __iter__(self):
        if self.node.decision is not None:
            yield "recompute"
        yield from self.extra

    def __len__(self) -> int:
        return (self.node.decision is not None) + len(self.extra)


class Group:
    """One storage seen in the region, and everything needed to rebuild any state of it."""

    __slots__ = (
        "id",
        "nbytes",
        "device",
        "creator",
        "mutations",
        "external",
        "snapshot",
        "outer",
        "held",
        "host",
        "version",
        "address",
        "grows",
    )

    def __init__(self, id: int, nbytes: int, device: torch.device):
        self.id = id
        self.nbytes = nbytes
        self.device = device
        self.creator: Node | None = None  # None: the storage came from outside the region
        self.mutations: list[Node] | tuple = ()  # the nodes that wrote it, in order (a list once written)
        self.external: torch.Tensor | None = None  # an outside tensor on this storage, while needed
        self.snapshot = None  # an external's storage copied before the region first wrote it
        self.outer = None  # for a region nested in another: the enclosing region's handle on it
        self.held: torch.Tensor | None = None  # a tensor on this storage kept by the policy
        # its latest copy in host memory (``offload.HostCopy``), for a result the policy offloads
        self.host = None
        # the version counter of ``held`` or ``external`` (one counter: a held alias of an
        # outside tensor shares it) when the region ended; not read while it records
        # (``RegionGraph.recording``)
        self.version = -1
        # an outside tensor's storage (its address) when the region ended: a storage swapped in
        # under the same tensor since (``p.data = other``, ``set_``) keeps the version counter
        self.address = None
        self.grows = False  # a write grew the storage in place (replay forgets its views after writes)

    def add_mutation(self, node: Node) -> None:
        if self.mutations:
            self.mutations.append(node)
        else:
            self.mutations = [node]

    @property
    def node(self) -> Node | None:
        """The node that produced the current state (the last write, else the creator)."""
        return self.mutations[-1] if self.mutations else self.creator

    def __repr__(self) -> str:
        origin = "external" if self.creator is None else self.creator.name
        return f"Group({self.id}, {origin}, {len(self.mutations)} writes, {self.nbytes} B)"


class RegionGraph:
    """Everything one call of a checkpointed region recorded, shared by the handles autograd saved."""

    def __init__(self, name: str, policy):
        self.name = name
        self.policy = policy
        self.nodes: list[Node] = []
        self.groups: list[Group] = []
        self._slots: list = []  # weak references to the handles autograd holds
        self.lock = threading.Lock()
        self.passes = 0  # replay passes run, for tests and reports
        self.replayed_ops = 0
        self.namer = _shape_name  # outside tensor -> a name for error messages
        self.times: dict[int, int] = {}  # node index -> ns the op took, if the region timed ops
        self.plan = None  # the last replay plan, reused while it still answers what is wanted
        # None, or what gives the context entered around each replay pass (a context_fn's
        # recompute context: ``selective.Contexts``)
        self.recompute_context = None
        # True until the region ends. Meanwhile every write to a storage it saw is recorded
        # as it runs, so a held or outside tensor is in its group's latest recorded state,
        # whatever its version counter says; afterwards only the counter can tell whether
        # something changed it (``Group.version``, read when the region ended).
        self.recording = True

    def add_slot(self, slot) -> None:
        self._slots.append(weakref.ref(slot))

    def slots(self) -> list:
        """The handles autograd still holds (dropping the references to released ones)."""
        alive = [s for s in (r() for r in self._slots) if s is not None]
        if len(alive) < len(self._slots):
            self._slots = [weakref.ref(s) for s in alive]
        return alive

    def __repr__(self) -> str:
        return f"RegionGraph({self.name!r}, {len(self.nodes)} nodes, {len(self.groups)} storages)"


def walk(graph: RegionGraph, wanted, start_of, visit=None) -> tuple[dict, list, dict]:
    """The nodes replay runs to produce every (group id, state) in ``wanted``: one walk for
    the replay plan (``replay_plan.plan``) and the planners' hypothetical ones (``planners.closure``),
    so the two cannot disagree on what a replay runs.

    ``start_of(group, lowest)`` says where a group's replay starts, given the lowest state
    asked of it: ``(kind, state)``, ``("create", 0)`` to run its creator (or raises). From
    there its writes run up to the highest state asked. A chosen node asks for its tensor
    arguments, and a random node whose generator state is its predecessor's (``rng[1]`` is
    None) for that predecessor. ``visit(node)`` sees each node before it is chosen (it may
    raise). Returns (group -> start, the chosen node indices in order, node -> its tensor
    arguments)."""
    groups, nodes = graph.groups, graph.nodes
    needs: dict[int, set] = {}
    starts: dict[int, tuple] = {}
    chosen: set[int] = set()
    work = list(wanted)  # (group id, state) still to provide
    to_run: list = []  # nodes chosen whose inputs are still to be asked for
    reads: dict[int, tuple] = {}
    while work or to_run:
        while to_run:
            node = to_run.pop()
            if node.index in chosen:
                continue
            if visit is not None:
                visit(node)
            chosen.add(node.index)
            args = reads[node.index] = node.tensor_args
            work.extend([(m.group, m.state) for m in args])
            rng = node.rng
            if rng is not None and rng[1] is None:
                to_run.append(nodes[rng[2]])  # its replay leaves the generator where this one starts
        if not work:
            break
        gid, state = work.pop()
        states = needs.get(gid)
        if states is None:
            states = needs[gid] = {state}
            lowest = highest = state
        elif state in states:
            continue
        else:
            states.add(state)
            lowest, highest = min(states), max(states)
        g = groups[gid]
        start = start_of(g, lowest)
        if starts.get(gid) != start:
            starts[gid] = start
            if start[0] == "create":
                to_run.append(g.creator)
        if highest > start[1]:
            to_run.extend(g.mutations[start[1] : highest])
    return starts, sorted(chosen), reads


def _shape_name(t) -> str:
    return f"a tensor of shape {list(t.shape)} ({t.dtype})"


def human_bytes(n: int) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def op_flops(op, args, kwargs, outputs) -> int:
    """FLOPs of one recorded op from its shapes, by ``torch.utils.flop_counter``'s formulas."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(op, "overloadpacket", None)
    if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        # torch has no formula for the CPU kernel; it does the same work as the others: torch
        # 2.13's ``sdpa_flop_count``, written here since 2.11's refuses grouped-query attention
        # (fewer key/value heads than query heads: Llama's)
        (b, h, s_q, d_q), (_, _, s_k, _), (_, _, _, d_v) = (a.shape for a in args[:3])
        return 2 * b * h * s_q * s_k * (d_q + d_v)
    formula = flop_registry.get(packet)
    if formula is None:
        return 0

    def shape(x):
        if isinstance(x, TensorMeta):
            return x.shape
        if isinstance(x, (list, tuple)):
            return type(x)(shape(y) for y in x)
        return x

    out = [o.shape if o is not None else None for o in outputs]
    kw = {k: shape(v) for k, v in kwargs.items()}
    return int(formula(*shape(args), out_val=out[0] if len(out) == 1 else tuple(out), **kw))


def flatten_outputs(out) -> tuple:
    """An op's result as a flat tuple: a tensor, a tuple of them, or tuples holding lists."""
    flat = out if isinstance(out, (tuple, list)) else (out,)
    if any(isinstance(o, (tuple, list)) for o in flat):
        flat = [y for o in flat for y in (o if isinstance(o, (tuple, list)) else (o,))]
    return tuple(flat)
