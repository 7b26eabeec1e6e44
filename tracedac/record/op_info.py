"""What an aten op does, as tracedac needs to know it.

- ``op_info(op)``: what it does to its arguments, read once from its schema and tags: which it
  writes, whether it is a pure view, draws random numbers, or reads only a layout. The
  recorder (``tracer.py``) asks for every op it sees; the answer is cached by op.
- ``MATMUL_OPS``: the ops worth their bytes (``save_matmuls()`` keeps them, ``min_cut()`` does
  not replay them), each with why.
- ``LOW_DTYPES``, ``cast_dtype``: what an autocast cast computes in (ZeRO-3's travel dtypes).
"""

from __future__ import annotations

import torch
from torch._ops import OpOverloadPacket

from .undeclared_writes import hidden_writes

__all__ = ["LOW_DTYPES", "MATMUL_OPS", "cast_dtype", "op_info", "storage_address"]

# The StorageImpl's address, without making (and so having torch keep) a Python storage object.
storage_address = getattr(torch._C, "_storage_address", None) or (lambda t: t.untyped_storage()._cdata)


class _OpInfo:
    __slots__ = ("writes", "rebinds", "seeded", "view", "layout_only", "hidden", "bare", "run")

    def __init__(self, writes, rebinds, seeded, view, layout_only=False, hidden=None, bare=False, run=None):
        self.run = run  # what the recorder calls for a view: the op's kernel, or what it runs instead (_WAIT)
        self.writes = writes  # ((position, name), ...) of arguments whose data the op writes
        # writes its schema does not declare (writes.hidden_writes: BatchNorm's running
        # statistics), decided per call by a flag argument
        self.hidden = hidden
        self.rebinds = rebinds  # arguments whose geometry it rewrites in place
        self.seeded = seeded  # draws from a random generator
        # a pure view (transpose, select, split...): allocates and writes nothing, so there
        # is nothing to record; a third of a transformer's ops
        self.view = view
        self.layout_only = layout_only  # reads only the layout of its first argument (_LAYOUT_ONLY)
        self.bare = bare  # returns no tensor and writes none (prim.device, item): run it, nothing else


_aten = torch.ops.aten
# Ops that read their first argument's dtype, shape, strides and device, never its values.
_LAYOUT_ONLY = frozenset(
    [
        _aten.empty_like,
        _aten.zeros_like,
        _aten.ones_like,
        _aten.full_like,
        _aten.rand_like,
        _aten.randn_like,
        _aten.randint_like,
        _aten.new_empty,
        _aten.new_empty_strided,
        _aten.new_zeros,
        _aten.new_ones,
        _aten.new_full,
    ]
)
_INFO: dict = {}


def _holds_tensors(t) -> bool:
    """Whether a schema type is a tensor or holds tensors (``Tensor[]``, ``Tensor?``), not a
    ``SymInt[]`` (``sym_size``, ``sym_stride``: metadata ops that reach the recorder from C++)."""
    if isinstance(t, torch.TensorType):
        return True
    if isinstance(t, (torch.ListType, torch.OptionalType)):
        return _holds_tensors(t.getElementType())
    return False


def _wait(t: torch.Tensor) -> torch.Tensor:
    """``_c10d_functional._wrap_tensor_autograd`` in a region: wait for the collective, and
    return its result as a plain tensor. Outside a region a functional collective's result
    is wrapped in an ``AsyncCollectiveTensor`` that waits at its first use, a subclass whose own
    storage holds no data (recorded, it was a storage of its own); torch.compile's tracing
    waits at once too (``_maybe_wrap_tensor``). A new tensor on the input's storage, as the
    wrapper is: returning the input itself makes autograd call the result a view made in a
    custom function, which the program could then not write in place."""
    torch.ops._c10d_functional.wait_tensor.default._op(t)
    # Made below every mode: a region around this one would record the set_ as a storage swap.
    with torch._C._DisableTorchDispatch():
        out = t.new_empty(0)
        return out.set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


_WAIT = "_c10d_functional::_wrap_tensor_autograd"  # an op the recorder runs as something else


def op_info(func) -> _OpInfo:
    tags = getattr(func, "tags", ())
    written = tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    # An "inplace view" (t_, unsqueeze_, set_, resize_) rewrites a tensor's geometry, not its
    # data. Geometry is read off the tensor at every use, so that is an ordinary view to us,
    # as long as the tensor stays on its storage (set_ and a growing resize_ do not).
    seeded = torch.Tag.nondeterministic_seeded in tags
    hidden = hidden_writes(func) if isinstance(func, torch._ops.OpOverload) else None
    # An op that returns no tensor and writes none (prim.device, sym_size, item): nothing to
    # replay, run it bare. (Such ops also reach the mode from C++, where an exception would
    # abort the process.)
    returns_tensor = any(_holds_tensors(r.type) for r in func._schema.returns)
    bare = not returns_tensor and not written and not seeded and hidden is None
    view = (bool(getattr(func, "is_view", False)) and not written and not seeded and hidden is None) or bare
    if func._schema.name == _WAIT:
        info = _OpInfo((), (), False, True, run=_wait)  # a view of the collective's result
    elif torch.Tag.inplace_view in tags:
        info = _OpInfo((), written, seeded, False)
    else:
        info = _OpInfo(
            written,
            (),
            seeded,
            view,
            getattr(func, "overloadpacket", None) in _LAYOUT_ONLY,
            hidden,
            bare,
            func._op,
        )
    _INFO[id(func)] = (func, info)  # by id: OpOverload.__hash__ is a Python method; func pins the id
    return info


# The ops `save_matmuls()` keeps and `min_cut()` does not replay, each with why it is worth its bytes.
MATMUL_OPS: dict[OpOverloadPacket, str] = {
    _aten.mm: "a matmul replays O(n^3) FLOPs to rebuild O(n^2) bytes",
    _aten.addmm: "nn.Linear with a bias lowers to addmm: a matmul",
    _aten.bmm: "batched matmul (attention scores, MoE experts): a matmul per batch entry",
    _aten.baddbmm: "batched matmul with an added input: as bmm",
    _aten._scaled_dot_product_flash_attention: "attention (CUDA flash): quadratic in sequence length",
    _aten._scaled_dot_product_efficient_attention: "attention (memory-efficient kernel): as flash",
    _aten._scaled_dot_product_cudnn_attention: "attention (cuDNN kernel): as flash",
    _aten._scaled_dot_product_flash_attention_for_cpu: "attention (CPU flash kernel): as flash",
}


# The dtypes autocast computes in below fp32: what a ZeRO-3 group may travel in instead.
LOW_DTYPES = (torch.bfloat16, torch.float16)


def cast_dtype(op, args, kwargs) -> torch.dtype | None:
    """The dtype ``op(*args, **kwargs)`` casts its one input to, if it is a plain cast
    (autocast's ``_to_copy(t, dtype=...)``, or ``prims.convert_element_type`` after
    decomposition); else None. Asked of dispatched ops (``zero/auto.py``'s observer) and of FX
    nodes (``compile/passes/gather_cast.py``)."""
    if op is torch.ops.prims.convert_element_type.default:
        return args[1]
    if op is torch.ops.aten._to_copy.default and len(args) == 1 and set(kwargs) <= {"dtype"}:
        return kwargs.get("dtype")
    return None
