"""Compiled replay: a planned replay pass run as one inductor-compiled function.

Op-by-op replay (``replay.run_pass``) dispatches every planned node from Python. When the
same replay *structure* comes back (the same ops on the same layouts, reading the same
kinds of sources: every step of a training loop, every layer of one class), this module
turns the plan into an FX graph of aten ops, compiles it once with inductor
(``torch._inductor.compile``: elementwise chains fuse, matmuls stay ATen's) and runs that
instead. Programs are cached by structure, so one compiled function serves every layer and
every step that replays the same thing.

A pass is compiled only where the result is the op-by-op result computed by other
kernels, never a different *kind* of result; everything else replays op by op:

- no planned node writes a storage (writes, versions and borrowed storages stay the
  op-by-op path's), draws random numbers (inductor's generator is not eager's; attention
  called with ``dropout_p=0`` draws none), takes a ``Layout`` argument,
  returns nested lists or comes from outside ``aten``/``prims`` (collectives, custom ops);
- no dispatch mode is active and nothing is being compiled around us;
- the compiled outputs come back with exactly the recorded geometry, each on a storage of
  its own of the recorded size (otherwise the structure is refused for good and this pass
  runs op by op: compiled functions have no side effects, so nothing is left half done).

Values: matmuls and anything inductor leaves to ATen are bitwise equal; fused elementwise
math and reductions (``gelu``'s erf, ``exp``, a layer norm's mean) may differ in the last
bits, as inductor's generated code evaluates them in another order or with other
vector routines (see docs/design.md, "Compiled replay"). CUDA graph capture is not used:
a captured graph's outputs live in its pool and the next replay overwrites them, while the
handles replay fills outlive the call.

On by default for passes on CUDA devices, off on the CPU (measured: on an H100 a bf16 Llama
step took 0.84x the time of op-by-op replay under ``recompute_all`` and 0.82x under
``save_matmuls``; on a 2-core CPU, where kernels dominate, no gain the noise hid:
docs/results.md). ``tracedac.compiled_replay(True)`` / ``False`` (or
``TRACEDAC_COMPILED_REPLAY=1`` / ``0``) turns it on or off for every device; ``"cuda"`` is
the default.
"""

from __future__ import annotations

import math
import operator
import os
import threading
import warnings
from collections import Counter

import torch

from ..record.graph import Layout, TensorMeta

__all__ = ["compiled_replay", "is_enabled", "stats"]

_SETTINGS = (True, False, "cuda")


def _from_environment():
    value = os.environ.get("TRACEDAC_COMPILED_REPLAY", "").strip().lower()
    for setting, spellings in (
        (True, ("1", "true", "on")),
        (False, ("0", "false", "off")),
        ("cuda", ("", "cuda")),
    ):
        if value in spellings:
            return setting
    raise ValueError(
        f"TRACEDAC_COMPILED_REPLAY={value!r} is not a setting tracedac knows: use 1 (compiled replay "
        "on every device), 0 (off) or cuda (on for CUDA devices, the default), or leave it unset."
    )


_setting = _from_environment()
# A structure is compiled the second time it is replayed: one-off replays (a warm-up, a
# differently shaped last batch) never pay for a compile.
_REPEATS_BEFORE_COMPILE = 2
_MAX_PROGRAMS = 256  # beyond this many structures, new ones replay op by op
_NAMESPACES = frozenset(["aten", "prims"])
# Replay reproduces what the forward computed: in bf16/fp16 keep eager's rounding after each
# op instead of carrying fp32 through a fused chain (which would be closer to exact, and
# further from the values the forward saw and the gradients eager computes).
_OPTIONS = {"emulate_precision_casts": True}

_lock = threading.Lock()
_seen: Counter = Counter()  # structure -> passes seen before it was compiled
_programs: dict = {}  # structure -> _Program, or a str: why it replays op by op
_stats: Counter = Counter()


def compiled_replay(enabled: bool | str | None = None) -> bool | str:
    """Set compiled replay for the process: ``True`` (every device), ``False`` (none) or
    ``"cuda"`` (passes on CUDA devices: the default); ``None`` leaves it. Returns the previous
    setting. Replays already compiled stay cached."""
    global _setting
    before = _setting
    if enabled is not None:
        if not any(enabled is s or (isinstance(enabled, str) and enabled == s) for s in _SETTINGS):
            raise ValueError(
                f"compiled_replay takes True, False or 'cuda' (the default: on for passes on CUDA "
                f"devices), or None to leave the setting; got {enabled!r}."
            )
        _setting = enabled
    return before


def is_enabled(device: torch.device | None = None) -> bool:
    """Whether a replay pass on ``device`` runs compiled when it can (without a device: on
    every device)."""
    if _setting == "cuda":
        return device is not None and device.type == "cuda"
    return _setting


def stats() -> dict:
    """Counts since start: ``compiled`` programs built, ``runs`` of them, ``eager`` passes
    replayed op by op while enabled, and ``refused:<reason>`` per refused structure."""
    return dict(_stats)


def clear() -> None:
    """Forget every compiled program and count (tests, or to free their memory)."""
    with _lock:
        _seen.clear()
        _programs.clear()
        _stats.clear()


class _Refused(Exception):
    """This structure cannot be compiled: the message says why."""


class _Program:
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


def _draws_nothing(node) -> bool:
    """A random op called with ``dropout_p=0`` (attention without dropout: SDPA's kernels are
    tagged random for their dropout) draws no random numbers: it is an ordinary op."""
    for i, a in enumerate(node.op._schema.arguments):
        if a.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            return p == 0
    return False


class _Reader:
    """A plan's node arguments as structure parts. A class rather than closures: a closure
    that calls itself is a function-cell cycle, and it held each pass's graph (its groups'
    tensors with it) until Python's cyclic GC ran (measured on an H100: 2.4 GiB of a
    save_matmuls Llama's kept tensors alive after backward)."""

    __slots__ = ("groups", "starts", "inputs", "input_metas", "created")

    def __init__(self, groups, starts):
        self.groups, self.starts = groups, starts
        self.inputs: dict[tuple, int] = {}  # (group, dtype, size, stride, offset) -> input position
        self.input_metas: list[TensorMeta] = []
        self.created: dict[int, tuple] = {}  # group -> (node position, output index)

    def ref(self, m: TensorMeta):
        gid = m.group
        where = self.created.get(gid)
        if where is not None:
            return ("n", *where, m.dtype, m.size, m.stride, m.offset)
        if self.starts[gid][0] == "create":
            raise AssertionError(f"replay reads group {gid} before its creator")
        key = (gid, m.dtype, m.size, m.stride, m.offset)
        i = self.inputs.get(key)
        if i is None:
            i = self.inputs[key] = len(self.input_metas)
            self.input_metas.append(m)
        return ("i", i, m.dtype, m.size, m.stride, m.offset, self.groups[gid].device)

    def arg(self, a):
        if a.__class__ is TensorMeta:
            return self.ref(a)
        if a.__class__ is Layout:
            raise _Refused("layout argument")
        if isinstance(a, (list, tuple)):  # (a torch.Size is a tuple)
            return ("list" if isinstance(a, list) else "tuple", *(self.arg(x) for x in a))
        if a.__class__ in (float, int, bool, complex):
            return _number(a)
        hash(a)  # TypeError for what a structure cannot hold
        return a


def _structure(graph, p):
    """The plan's structure (hashable), the metas of its inputs in order, and the created
    groups whose values are returned; raises _Refused for what is not compiled."""
    nodes, starts = graph.nodes, p.starts
    r = _Reader(graph.groups, starts)
    parts = []
    try:
        for pos, i in enumerate(p.nodes):
            node = nodes[i]
            op = node.op
            if node.writes:
                raise _Refused("writes")
            if node.rng is not None and not _draws_nothing(node):
                raise _Refused("random")
            if getattr(op, "namespace", None) not in _NAMESPACES:
                raise _Refused(f"op {op}")
            if len(op._schema.returns) != len(node.outputs):
                raise _Refused("nested outputs")
            kwargs = tuple((k, r.arg(v)) for k, v in node.kwargs.items()) if node.kwargs else ()
            parts.append((op, tuple(r.arg(a) for a in node.args), kwargs))
            for k in node.creates:
                m = node.outputs[k]
                if m is not None and starts.get(m.group, ("",))[0] == "create":
                    r.created[m.group] = (pos, k)
    except TypeError:
        raise _Refused("unhashable argument") from None
    return tuple(parts), r.input_metas, r.created


def _number(a):
    """A Python number as a key holds it: its type and, for a float, its sign, since
    ``0.0 == -0.0`` and ``True == 1`` would let one compiled program serve both (measured:
    ``w / x.mul(-0.0)`` replayed with the program made for ``0.0`` gave ``+inf`` gradients
    where eager gives ``-inf``). NaN never equals itself, so its structure never compiles."""
    sign = math.copysign(1.0, a) if a.__class__ is float else None
    return ("num", a.__class__, a, sign)


def _end(size, stride, offset: int) -> int:
    """One past the last storage element a tensor laid out so reaches (0 if it is empty)."""
    if 0 in size:
        return 0
    return offset + sum((n - 1) * st for n, st in zip(size, stride)) + 1


class _Writer:
    """FX nodes for structure parts (a class, not self-calling closures: see ``_Reader``)."""

    __slots__ = ("g", "nodes", "plan_nodes", "placeholders", "results")

    def __init__(self, g, nodes, plan_nodes, n_inputs: int):
        self.g, self.nodes, self.plan_nodes = g, nodes, plan_nodes
        self.placeholders = [g.placeholder(f"in{i}") for i in range(n_inputs)]
        self.results: list = []  # per planned node: its fx node

    def output(self, pos: int, k: int):
        node = self.nodes[self.plan_nodes[pos]]
        out = self.results[pos]
        return out if len(node.outputs) == 1 else self.g.call_function(operator.getitem, (out, k))

    def value(self, r):
        if r[0] == "i":
            return self.placeholders[r[1]]
        if r[0] == "n":
            _, pos, k, dtype, size, stride, offset = r
            out = self.output(pos, k)
            base = self.nodes[self.plan_nodes[pos]].outputs[k]
            if (dtype, size, stride, offset) == (base.dtype, base.size, base.stride, base.offset):
                return out
            if dtype != base.dtype:
                raise _Refused("dtype view")
            # as_strided's offset counts from the start of the storage, and inductor's buffer
            # for ``out`` starts where ``out`` does and ends at its last element (laid out
            # with eager's strides, since an as_strided reads it)
            if base.offset != 0 or _end(size, stride, offset) > _end(base.size, base.stride, 0):
                raise _Refused("view outside its base")
            return self.g.call_function(
                torch.ops.aten.as_strided.default, (out, list(size), list(stride), offset)
            )
        return _sequence(r[0])(self.value(x) for x in r[1:])

    def arg(self, a):
        if isinstance(a, tuple) and a and a[0] == "num":
            return a[2]
        if isinstance(a, tuple) and a and a[0] in ("i", "n"):
            return self.value(a)
        if isinstance(a, tuple) and a and a[0] in ("list", "tuple"):
            return _sequence(a[0])(self.arg(x) for x in a[1:])
        return a


def _sequence(name: str) -> type:
    return list if name == "list" else tuple


def _build(graph, p, key, n_inputs: int, outputs):
    """An FX graph of the plan's ops returning the node outputs ``outputs`` ((position, index))."""
    import torch.fx as fx

    g = fx.Graph()
    w = _Writer(g, graph.nodes, p.nodes, n_inputs)
    for op, args, kwargs in key:
        w.results.append(g.call_function(op, tuple(w.arg(a) for a in args), {k: w.arg(v) for k, v in kwargs}))
    g.output(tuple(w.output(pos, k) for pos, k in outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def _runnable() -> bool:
    return torch._C._len_torch_dispatch_stack() == 0 and not torch.compiler.is_compiling()


def run(graph, p, source, wanted_groups) -> dict | None:
    """Run plan ``p`` compiled, if it may be: returns {group: tensor on its storage, laid out
    as its creator returned it} for every group in ``wanted_groups`` the plan creates, or
    None (replay op by op). ``source(meta)`` gives an input laid out as ``meta``."""
    if not _runnable():
        _stats["eager"] += 1
        return None
    try:
        structure, input_metas, created = _structure(graph, p)
    except _Refused as e:
        _stats[f"refused:{e}"] += 1
        return None
    wanted = sorted((where, gid) for gid, where in created.items() if gid in wanted_groups)
    outputs = tuple(where for where, _ in wanted)
    key = (structure, outputs)
    with _lock:
        prog = _programs.get(key)
        if prog is None:
            if len(_seen) > 16 * _MAX_PROGRAMS:
                _seen.clear()  # structures seen once each, again and again: forget them
            _seen[key] += 1
            if _seen[key] < _REPEATS_BEFORE_COMPILE or len(_programs) >= _MAX_PROGRAMS:
                prog = "not yet"
    if isinstance(prog, str):
        _stats["eager"] += 1
        return None
    inputs = [source(m).detach() for m in input_metas]
    with torch.no_grad(), torch._C._DisableAutocast():
        if prog is None:
            try:
                gm = _build(graph, p, structure, len(inputs), outputs)
                prog = _Program(torch._inductor.compile(gm, inputs, options=_OPTIONS))
            except _Refused as e:
                return _refuse(key, str(e))
            except Exception as e:  # inductor could not compile it: op by op is always right
                warnings.warn(
                    f"tracedac: compiled replay failed to compile a replay of {len(p.nodes)} ops "
                    f"({type(e).__name__}: {e}); it replays op by op",
                    stacklevel=2,
                )
                return _refuse(key, f"compile error {type(e).__name__}")
            with _lock:
                _programs[key] = prog
                _seen.pop(key, None)
            _stats["compiled"] += 1
        outs = prog.fn(*inputs)
    result = {}
    storages = {t.untyped_storage()._cdata for t in inputs}
    for ((pos, k), gid), o in zip(wanted, outs):
        m = graph.nodes[p.nodes[pos]].outputs[k]
        s = o.untyped_storage() if isinstance(o, torch.Tensor) else None
        if (
            s is None
            or o.size() != m.size
            or o.stride() != m.stride
            or o.storage_offset() != m.offset
            or o.dtype != m.dtype
            or s.nbytes() != graph.groups[gid].nbytes
            or s._cdata in storages
        ):
            # inductor's outputs are not laid out as the recorded ones (or share a storage):
            # this structure replays op by op from now on
            return _refuse(key, "layout")
        storages.add(s._cdata)
        result[gid] = o
    _stats["runs"] += 1
    return result


def _refuse(key, reason: str) -> None:
    with _lock:
        _programs[key] = reason
        _seen.pop(key, None)
    _stats[f"refused:{reason}"] += 1
    return None
