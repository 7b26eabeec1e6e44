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
  returns nested lists, has a shape read from the data (``nonzero``) or comes from outside
  ``aten``/``prims`` (collectives, custom ops);
- no dispatch mode is active and nothing is being compiled around us;
- the compiled outputs come back with exactly the recorded geometry, each on a storage of
  its own of the recorded size (otherwise the structure is refused for good and this pass
  runs op by op: compiled functions have no side effects, so nothing is left half done).

Values: by default (``fusion="exact"``) a compiled replay gives op-by-op replay's bits, which
are the forward's. Inductor generates code only for the ops whose generated code computes
what eager's kernel computes, rounding for rounding (views, ``cat``, casts, ``neg``, ``where``,
``add``/``sub``/``mul``, ``div`` by a tensor, ``pow(x, 2)``: one correctly rounded operation
each, under settings that keep eager's rounding: no FMA contraction, bf16/fp16 rounded after
every op, correctly rounded division); every other op (matmuls, attention, reductions, norms,
softmax, ``exp``/``erf``/``tanh``/``sigmoid`` and the activations built on them) runs eager's
own kernel inside the compiled function (inductor's lite mode). The first run of every
program is checked against an eager run of the same graph on the same inputs, bit for bit;
a program that differs is refused and its structure replays op by op (``stats()``:
``refused:inexact``). ``fusion="all"`` (``TRACEDAC_COMPILED_REPLAY_FUSION=all``) lets inductor
fuse and decompose everything: faster where elementwise math and reductions dominate, and
within rounding of eager only (a layer norm's mean, GELU's ``erf``, ``exp`` differ in the
last bits: docs/design.md, "Compiled replay: bits"). CUDA graph capture is not used:
a captured graph's outputs live in its pool and the next replay overwrites them, while the
handles replay fills outlive the call.

On by default for passes on CUDA devices, off on the CPU (measured with ``fusion="all"``, before
"exact" was the default: on an H100 a bf16 Llama step took 0.84x the time of op-by-op replay
under ``recompute_all`` and 0.82x under ``save_matmuls``; on a 2-core CPU, where kernels
dominate, no gain the noise hid: docs/results.md). ``tracedac.compiled_replay(True)`` / ``False`` (or
``TRACEDAC_COMPILED_REPLAY=1`` / ``0``) turns it on or off for every device; ``"cuda"`` is
the default. ``compiled_replay(fusion="exact" | "all")`` (or
``TRACEDAC_COMPILED_REPLAY_FUSION``) chooses what inductor may fuse; ``"exact"`` is the default.
"""

from __future__ import annotations

import hashlib
import math
import operator
import os
import threading
import warnings
from collections import Counter

import torch

from .. import _compat
from ..record.graph import Layout, TensorMeta

__all__ = ["compiled_replay", "fusion", "is_enabled", "stats"]

_SETTINGS = (True, False, "cuda")
_FUSIONS = ("exact", "all")


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


def _fusion_from_environment():
    value = os.environ.get("TRACEDAC_COMPILED_REPLAY_FUSION", "").strip().lower() or "exact"
    if value not in _FUSIONS:
        raise ValueError(
            f"TRACEDAC_COMPILED_REPLAY_FUSION={value!r} is not a setting tracedac knows: use exact "
            "(inductor fuses only what gives eager's bits: gradients equal op-by-op replay's, the "
            "default) or all (inductor fuses everything: faster, within rounding), or leave it unset."
        )
    return value


_setting = _from_environment()
_fusion = _fusion_from_environment()
# A structure is compiled the second time it is replayed: one-off replays (a warm-up, a
# differently shaped last batch) never pay for a compile.
_REPEATS_BEFORE_COMPILE = 2
_MAX_PROGRAMS = 256  # beyond this many structures, new ones replay op by op
_NAMESPACES = frozenset(["aten", "prims"])
# fusion="all": replay reproduces what the forward computed as closely as a full fusion can:
# in bf16/fp16 keep eager's rounding after each op instead of carrying fp32 through a fused
# chain (which would be closer to exact, and further from the values the forward saw).
_OPTIONS_ALL = {"emulate_precision_casts": True}
# Marks a node inductor generates code for under fusion="exact" (lite mode's annotation).
_MARK = {"compile_with_inductor": "tracedac exact replay"}
# Names this version's choice of exact ops in inductor's cache keys (see _compat.inductor_cache_tag).
_EXACT_VERSION = "1"

_lock = threading.Lock()
_seen: Counter = Counter()  # structure -> passes seen before it was compiled
_programs: dict = {}  # structure -> _Program, or a str: why it replays op by op
_stats: Counter = Counter()


def compiled_replay(enabled: bool | str | None = None, *, fusion: str | None = None) -> bool | str:
    """Set compiled replay for the process: ``True`` (every device), ``False`` (none) or
    ``"cuda"`` (passes on CUDA devices: the default); ``None`` leaves it. ``fusion``: what
    inductor may fuse, ``"exact"`` (the default: only ops whose generated code gives eager's
    bits, so gradients equal op-by-op replay's and no checkpointing's) or ``"all"`` (everything:
    faster, within rounding of eager); ``None`` leaves it (``fusion()`` reads it). Returns the
    previous ``enabled`` setting. Replays already compiled stay cached, each for its fusion."""
    global _setting, _fusion
    before = _setting
    if enabled is not None and not any(
        enabled is s or (isinstance(enabled, str) and enabled == s) for s in _SETTINGS
    ):
        raise ValueError(
            f"compiled_replay takes True, False or 'cuda' (the default: on for passes on CUDA "
            f"devices), or None to leave the setting; got {enabled!r}."
        )
    if fusion is not None and not (isinstance(fusion, str) and fusion in _FUSIONS):
        raise ValueError(
            f"compiled_replay's fusion takes 'exact' (the default: only what gives eager's bits) or "
            f"'all' (inductor fuses everything, within rounding), or None to leave it; got {fusion!r}."
        )
    if enabled is not None:
        _setting = enabled
    if fusion is not None:
        _fusion = fusion
    return before


def fusion() -> str:
    """What compiled replay lets inductor fuse: ``"exact"`` or ``"all"`` (see ``compiled_replay``)."""
    return _fusion


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
            if torch.Tag.dynamic_output_shape in op.tags:
                # (nonzero, unique: a shape from the data, which inductor's tracing cannot
                # give a program; refused before seconds of a compile that fails)
                raise _Refused("data-dependent shape")
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


def _is_tensor(a) -> bool:
    return isinstance(a, tuple) and bool(a) and a[0] in ("i", "n")


def _is_number(a, *values) -> bool:
    return isinstance(a, tuple) and bool(a) and a[0] == "num" and (not values or a[2] in values)


def _dtype(ref):
    return ref[2] if ref[0] == "i" else ref[3]


def _ndim(ref) -> int:
    return len(ref[3] if ref[0] == "i" else ref[4])


def _arg(args, kwargs, i: int, name: str):
    """Argument ``name`` (position ``i``) of a structure part, or None where it was left out."""
    if i < len(args):
        return args[i]
    return dict(kwargs).get(name)


_WIDE = (torch.float32, torch.float64)


def _operands_exact(operands) -> bool:
    """Tensors of one dtype, and numbers only beside float32/float64 ones. Mixed dtypes promote,
    and eager and inductor do not promote alike (eager casts a 0-dim float32 tensor to a bf16
    operand's dtype before the op). A number beside a bf16/fp16 tensor is rounded to that dtype
    by some of eager's kernels (CPU ``add``: bf16 x + 0.1 adds bf16(0.1)) and not by others
    (``mul``), while inductor keeps it in float32: seen on the CPU, x + 0.1 differed."""
    tensors = [a for a in operands if _is_tensor(a)]
    if not tensors or len({_dtype(t) for t in tensors}) != 1:
        return False
    numbers = [a for a in operands if not _is_tensor(a)]
    return all(_is_number(a) for a in numbers) and (not numbers or _dtype(tensors[0]) in _WIDE)


def _arithmetic(args, kwargs) -> bool:
    return len(args) >= 2 and _operands_exact(args[:2])


def _alpha_one(args, kwargs) -> bool:
    # eager computes a + alpha * b in one kernel (an FMA on CUDA, where nvcc contracts it);
    # with alpha 1 that is a + b, one rounding whichever way it is computed
    alpha = _arg(args, kwargs, 2, "alpha")
    return _arithmetic(args, kwargs) and (alpha is None or _is_number(alpha, 1))


def _divides_by_a_tensor(args, kwargs) -> bool:
    # eager's CUDA kernel divides by a number (or a 0-dim CPU tensor) as a multiplication by
    # its reciprocal, computed in float; inductor's reciprocal is computed in double: another
    # rounding. A tensor with dimensions is divided by in both, correctly rounded.
    return _arithmetic(args, kwargs) and _is_tensor(args[1]) and _ndim(args[1]) > 0


def _squares(args, kwargs) -> bool:
    # eager's pow kernels compute x ** 2 as x * x, as inductor does; other exponents differ
    return len(args) > 1 and _is_number(args[1], 2)


def _float_cast(args, kwargs) -> bool:
    # float to float rounds to nearest even in both; to an integer, NaN and infinities have
    # no value and each kernel makes its own
    dtype = dict(kwargs).get("dtype")
    return (
        set(dict(kwargs)) <= {"dtype"}
        and len(args) == 1
        and isinstance(dtype, torch.dtype)
        and dtype.is_floating_point
        and _dtype(args[0]).is_floating_point
    )


def _one_dtype(tensors) -> bool:
    return all(_is_tensor(t) for t in tensors) and len({_dtype(t) for t in tensors}) == 1


def _where_one_dtype(args, kwargs) -> bool:
    return len(args) == 3 and _one_dtype(args[1:])


def _cat_one_dtype(args, kwargs) -> bool:
    return bool(args) and args[0][0] == "list" and _one_dtype(args[0][1:])


def _only(*names):
    def check(args, kwargs) -> bool:
        return all(k in names for k, _ in kwargs)

    return check


def _always(args, kwargs) -> bool:
    return True


def _exact_ops() -> dict:
    """op -> check(args, kwargs): the ops inductor may generate code for under fusion="exact",
    each where its generated code computes eager's kernel's bits. Each is data movement or one
    correctly rounded IEEE operation on operands of one dtype (no FMA contraction; bf16/fp16
    rounded after every op: ``_compat.inductor_exact_options``). Not here, so run by eager's
    kernel: reductions (their order is the kernel's), norms and softmax (eager's fused
    kernels), exp/log/erf/tanh/sigmoid and what is built on them (eager's vector routines are
    not inductor's), ``relu``/``clamp``/``maximum`` (NaN and signed-zero rules), sqrt/rsqrt,
    matmuls, attention. docs/design.md, "Compiled replay: bits", says why for each."""
    aten = torch.ops.aten
    views = [
        aten.as_strided.default,
        aten.view.default,
        aten._unsafe_view.default,
        aten.alias.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.expand.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
    ]
    table = dict.fromkeys(views, _always)
    table.update(
        {
            aten.cat.default: _cat_one_dtype,
            aten.clone.default: _only(),  # (a memory_format would choose another layout)
            aten._to_copy.default: _float_cast,
            aten.where.self: _where_one_dtype,
            aten.neg.default: _always,
            aten.mul.Tensor: _arithmetic,
            aten.add.Tensor: _alpha_one,
            aten.sub.Tensor: _alpha_one,
            aten.div.Tensor: _divides_by_a_tensor,
            aten.pow.Tensor_Scalar: _squares,
        }
    )
    return table


_EXACT = _exact_ops()


def _exact(op, args, kwargs) -> bool:
    check = _EXACT.get(op)
    return check is not None and check(args, kwargs)


class _Writer:
    """FX nodes for structure parts (a class, not self-calling closures: see ``_Reader``).
    ``exact``: mark the nodes of ops in ``_EXACT`` (and the views it adds) for inductor to
    generate code for; every other node runs eager's kernel (fusion="exact")."""

    __slots__ = ("g", "nodes", "plan_nodes", "placeholders", "results", "exact", "marked")

    def __init__(self, g, nodes, plan_nodes, n_inputs: int, exact: bool):
        self.g, self.nodes, self.plan_nodes = g, nodes, plan_nodes
        self.placeholders = [g.placeholder(f"in{i}") for i in range(n_inputs)]
        self.results: list = []  # per planned node: its fx node
        self.exact = exact
        self.marked: list[int] = []  # positions of the planned nodes marked (the cache tag's)

    def mark(self, node):
        if self.exact:
            node.meta["custom"] = dict(_MARK)
        return node

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
            return self.mark(
                self.g.call_function(
                    torch.ops.aten.as_strided.default, (out, list(size), list(stride), offset)
                )
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


def _build(graph, p, key, n_inputs: int, outputs, exact: bool):
    """An FX graph of the plan's ops returning the node outputs ``outputs`` ((position, index)),
    and the positions of the nodes marked for inductor (``exact``; else none)."""
    import torch.fx as fx

    g = fx.Graph()
    w = _Writer(g, graph.nodes, p.nodes, n_inputs, exact)
    for pos, (op, args, kwargs) in enumerate(key):
        node = g.call_function(op, tuple(w.arg(a) for a in args), {k: w.arg(v) for k, v in kwargs})
        if exact and _exact(op, args, kwargs):
            w.mark(node)
            w.marked.append(pos)
        w.results.append(node)
    g.output(tuple(w.output(pos, k) for pos, k in outputs))
    return fx.GraphModule(torch.nn.Module(), g), w.marked


def _compile(gm, inputs, exact: bool, marked):
    if not exact:
        return torch._inductor.compile(gm, inputs, options=_OPTIONS_ALL)
    options = _compat.inductor_exact_options()
    if options is None:
        raise _Refused("no inductor lite mode in this torch")
    tag = hashlib.sha256(repr((_EXACT_VERSION, marked)).encode()).hexdigest()[:16]
    with _compat.inductor_cache_tag(f"tracedac-exact-replay-{tag}"):
        return torch._inductor.compile(gm, inputs, options=options)


def _same_bits(a, b) -> bool:
    """``a`` and ``b`` hold the same bits, NaN payloads aside (eager and inductor may return
    different NaNs where both return one; which elements are NaN is compared)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    a, b = a.contiguous().view(ints), b.contiguous().view(ints)
    return torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


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
    key = (structure, outputs, _fusion)  # one program per fusion: "all"'s is not exact
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
    fresh = prog is None
    with torch.no_grad(), torch._C._DisableAutocast():
        if fresh:
            exact = key[2] == "exact"
            try:
                gm, marked = _build(graph, p, structure, len(inputs), outputs, exact)
                prog = _Program(_compile(gm, inputs, exact, marked))
            except _Refused as e:
                return _refuse(key, str(e))
            except Exception as e:  # inductor could not compile it: op by op is always right
                warnings.warn(
                    f"tracedac: compiled replay failed to compile a replay of {len(p.nodes)} ops "
                    f"({type(e).__name__}: {e}); it replays op by op",
                    stacklevel=2,
                )
                return _refuse(key, f"compile error {type(e).__name__}")
            _stats["compiled"] += 1
        outs = prog.fn(*inputs)
        if fresh and exact:
            # The proof that the marked ops compute eager's bits is an argument about kernels
            # (see _exact_ops); its check is this: the program's first results against eager's
            # kernels run on the same inputs. A difference (a device whose generated code
            # rounds otherwise, a layout that changes a fallback kernel's order) refuses it.
            expected = gm(*inputs)
            if not all(_same_bits(o, e) for o, e in zip(outs, expected, strict=True)):
                return _refuse(key, "inexact")
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
    if fresh:  # checked: other passes may run it
        with _lock:
            _programs[key] = prog
            _seen.pop(key, None)
    _stats["runs"] += 1
    return result


def _refuse(key, reason: str) -> None:
    with _lock:
        _programs[key] = reason
        _seen.pop(key, None)
    _stats[f"refused:{reason}"] += 1
    return None
