"""``pack_cast`` and ``accumulate_``: the public functions and their ``torch.library`` ops.

Each is one custom op (``tracedac::pack_cast``, ``tracedac::accumulate_``) with a fake
implementation, so a traced or compiled graph shows one node per call. They are
``custom_op``s rather than ``triton_op``s on purpose: ``triton_op`` reuses its body as the
fake kernel and inlines it under ``torch.compile``, so the body must run on fake tensors,
and the segment table is built from real data pointers, which fake tensors do not have. An
opaque op is also what the compiler needs here: the kernel reads the sources through raw
pointers, which no graph pass could see as reads.

Going through the dispatcher costs 50 to 100 us of Python per call, about what the kernel
takes on a 200 MB unit on an H100. So a call on plain tensors that nothing observes (no
dispatch or function mode, no tensor subclass, not compiling, dst not requiring grad) runs
the same implementation directly; every other call goes through the op, as one node.

The per-call host work is then one key: every tensor's data pointer, dtype, shape, strides
and device, dst's included. The argument checks, the memory-overlap check and the Triton
launch's plan (its device table, grid and constants) depend on nothing else, so a call whose
key was seen before (every training step after the first) skips the checks, which passed for
that key, and reuses the prepared launch (``_Calls``). A tensor freed and another allocated at
the same address with the same metadata gives the same key, and rightly: the checks would give
the same answers, and the plan addresses the same memory. The conditions that can change
between calls with equal keys (modes, compiling, grad mode, ``requires_grad``, subclasses, the
backend and what it needs) are looked at on every call. The op's body (a compiled graph's
call) looks its key up too, for the overlap check and the launch. With the 13 tensors of a
Llama block on a 2-core CPU, a repeated direct call spends about 30 us of Python before its
copies (about 16 of them reading the key) and 40 before a Triton launch, where checking and
planning every call took 50 to 85 and 125 to 195; a call with a new key pays the key on top.
"""

import threading
from collections import OrderedDict
from functools import partial

import torch

from ..kernels.checks import check_accumulate, check_no_overlap, check_pack_cast, resolve_backend
from ..kernels.launch import Launch, prepare
from ..kernels.reference import accumulate_torch, pack_cast_torch

__all__ = ["pack_cast", "accumulate_"]


def pack_cast(srcs: list[torch.Tensor], dst: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Write the flattened ``srcs``, one after another, into the flat ``dst``, cast to its dtype.

    ``srcs`` may be any number of float32, bfloat16 or float16 tensors of any shape and
    layout; ``dst`` (float32, bfloat16 or float16) is a contiguous 1-D tensor, often a slice
    of a bigger buffer, with exactly as many elements as the sources. Nothing outside ``dst``
    is written. Every value is bit-for-bit ``src.to(dst.dtype)``; NaNs carry the bits torch's
    cast of contiguous data gives on that device.

    ``backend``: ``"triton"`` (one kernel launch for all sources; CUDA, or CPU under
    ``TRITON_INTERPRET=1``), ``"torch"`` (one ``copy_`` per source), or ``"auto"`` (Triton on
    CUDA when it is installed, torch otherwise). Returns ``dst``.
    """
    key = _pack_key(srcs, dst) if type(srcs) in _SEQUENCES and _direct(dst) else None
    if key is None:  # observed, or not plain tensors (then the checks say what is wrong)
        srcs = check_pack_cast(srcs, dst)
        return _checked("pack_cast", [dst, *srcs], (srcs, dst), backend, _pack_cast_impl)
    check = partial(check_pack_cast, srcs, dst)
    return _keyed("pack_cast", _pack_calls, key, check, srcs, dst, backend, pack_cast_torch, False)


def accumulate_(dst: torch.Tensor, src: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``dst += src`` for a float32 ``dst``, upcasting a bfloat16 or float16 ``src`` in the same pass.

    Bit-for-bit ``dst.add_(src.to(dst.dtype))``. ``src`` may have any layout; ``dst`` must be
    contiguous and of the same shape. ``backend`` as for :func:`pack_cast`. Returns ``dst``.
    """
    key = _accumulate_key(dst, src) if _direct(dst) else None
    if key is None:  # observed, or not plain tensors (then the checks say what is wrong)
        check_accumulate(dst, src)
        return _checked("accumulate_", [dst, src], (dst, src), backend, _accumulate_impl)
    check = partial(check_accumulate, dst, src)
    return _keyed("accumulate_", _accumulate_calls, key, check, [src], dst, backend, _accumulate_torch, True)


def _checked(name: str, tensors: list, args: tuple, backend: str, impl) -> torch.Tensor:
    """A call the keyed path does not take, its arguments checked: the implementation called
    directly where nothing observes it (``tensors[0]``, dst, then marked written), else the
    op ``tracedac.<name>``. Returns dst."""
    dst = tensors[0]
    backend = resolve_backend(name, backend, dst.device)
    if _unobserved(tensors):
        impl(*args, backend)
        torch.autograd.graph.increment_version(dst)
    else:
        getattr(torch.ops.tracedac, name)(*args, backend)
    return dst


# Private, hence looked up defensively: without it every call takes the op path.
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_SEQUENCES = (list, tuple)


def _unobserved(tensors: list[torch.Tensor]) -> bool:
    """Whether calling the implementation directly is indistinguishable from the op.

    ``tensors[0]`` is the mutated dst.
    """
    if _dispatch_stack_len is None or _dispatch_stack_len() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch.compiler.is_compiling() or tensors[0].device.type == "meta":
        return False
    if any(type(t) not in _PLAIN for t in tensors):
        return False
    # Sources that require grad change nothing (the op has no outputs to attach a graph
    # to); a dst that requires grad is left to autograd's in-place rules.
    return not (torch.is_grad_enabled() and tensors[0].requires_grad)


def _direct(dst: object) -> bool:
    """``_unobserved`` for what does not depend on the sources (their types are checked with
    their keys), for a ``dst`` that may be anything; False sends the call the checked way."""
    return (
        type(dst) in _PLAIN
        and _dispatch_stack_len is not None
        and not _dispatch_stack_len()
        and not torch._C._is_torch_function_mode_enabled()
        and not torch.compiler.is_compiling()
        and not dst.is_meta
        and not (dst.requires_grad and torch.is_grad_enabled())
    )


# -- keys: everything the checks and the launch depend on, read once per call --
#
# Per tensor: data pointer, dtype, shape, strides, device. The overlap check needs the
# pointers and extents of the sources and of dst; the plan, the sources' pointers and layouts
# and dst's dtype, device and alignment; the argument checks, dtypes, devices and sizes.
# ``None``: a tensor is not a plain one, or has no such metadata (sparse, no storage): such a
# call is checked as before and nothing is remembered.


def _pack_key(srcs, dst: torch.Tensor) -> tuple | None:
    try:
        key = [(s.data_ptr(), s.dtype, s.shape, s.stride(), s.device) for s in srcs if type(s) in _PLAIN]
        if len(key) != len(srcs):
            return None
        key.append((dst.data_ptr(), dst.dtype, dst.shape, dst.stride(), dst.device))
    except (RuntimeError, NotImplementedError):  # no such metadata (sparse): the checked path says so
        return None
    return tuple(key)


def _accumulate_key(dst: torch.Tensor, src: object) -> tuple | None:
    if type(src) not in _PLAIN:
        return None
    try:
        return (
            (src.data_ptr(), src.dtype, src.shape, src.stride(), src.device),
            (dst.data_ptr(), dst.dtype, dst.shape, dst.stride(), dst.device),
        )
    except (RuntimeError, NotImplementedError):  # no such metadata (sparse): the checked path says so
        return None


class _Call:
    """What calls with one key have established: the overlap check passed (the entry exists),
    the argument checks passed (``args_checked``; an op called directly skips them), and the
    prepared Triton launch, once one ran (None for plans that hold copies: made per call)."""

    __slots__ = ("args_checked", "launch")

    def __init__(self) -> None:
        self.args_checked = False
        self.launch: Launch | None = None


class _Calls:
    """The most recently used ``_Call``s by key, at most ``size`` (each may hold a plan's table
    on the device); thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, _Call] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> _Call | None:
        with self._lock:
            call = self._entries.get(key)
            if call is not None:
                self._entries.move_to_end(key)
        return call

    def add(self, key: tuple) -> _Call:
        """The entry for ``key`` (a new one unless another thread just added it); call it only
        once the overlap check passed for ``key``."""
        with self._lock:
            call = self._entries.get(key)
            if call is None:
                call = self._entries[key] = _Call()
                while len(self._entries) > self.size:
                    self._entries.popitem(last=False)
            self._entries.move_to_end(key)
        return call

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


# As many as the plan cache of ``table.py`` held for both ops together before, per op: a
# model whose step makes more distinct calls of one op than this finds none of them again.
_CACHE_SIZE = 64
_pack_calls = _Calls(_CACHE_SIZE)
_accumulate_calls = _Calls(_CACHE_SIZE)


def _keyed(op: str, calls: _Calls, key: tuple, check_args, srcs, dst, backend, torch_impl, accumulate: bool):
    """A direct call with a key: ``check_args()`` and the overlap check only where no call
    with this key passed them, then the (prepared) launch; returns ``dst``."""
    call = calls.get(key)
    if call is None or not call.args_checked:
        check_args()
    backend = resolve_backend(op, backend, dst.device)
    if call is None:
        check_no_overlap(op, srcs, dst)
        call = calls.add(key)
    call.args_checked = True
    _run(call, srcs, dst, backend, torch_impl, accumulate)
    torch.autograd.graph.increment_version(dst)
    return dst


def _op_body(op: str, calls: _Calls, key: tuple | None, srcs, dst, backend, torch_impl, accumulate: bool):
    """The op's body (and a checked direct call's): the overlap check, unless it passed for
    this key before. The argument checks ran in the public function (or not at all, for the
    op called directly), so the entry does not count them."""
    call = None if key is None else calls.get(key)
    if call is None:
        check_no_overlap(op, srcs, dst)
        call = None if key is None else calls.add(key)
    _run(call, srcs, dst, backend, torch_impl, accumulate)


def _run(call: _Call | None, srcs, dst: torch.Tensor, backend: str, torch_impl, accumulate: bool) -> None:
    """Run checked arguments on ``backend``, with ``call``'s prepared launch when it has one."""
    if backend != "triton":
        torch_impl(srcs, dst)
        return
    launch = None if call is None else call.launch
    if launch is None:
        launch = prepare(srcs, dst, accumulate=accumulate)
        if call is not None and launch.cacheable:
            call.launch = launch
    launch(dst)


def _accumulate_torch(srcs, dst: torch.Tensor) -> None:
    accumulate_torch(dst, srcs[0])


@torch.library.custom_op("tracedac::pack_cast", mutates_args=("dst",))
def _pack_cast_op(srcs: list[torch.Tensor], dst: torch.Tensor, backend: str) -> None:
    """Cast the flattened srcs into consecutive slices of dst."""
    _pack_cast_impl(srcs, dst, backend)


def _pack_cast_impl(srcs: list[torch.Tensor], dst: torch.Tensor, backend: str) -> None:
    _op_body("pack_cast", _pack_calls, _pack_key(srcs, dst), srcs, dst, backend, pack_cast_torch, False)


@_pack_cast_op.register_fake
def _pack_cast_fake(srcs: list[torch.Tensor], dst: torch.Tensor, backend: str) -> None:
    return None


@torch.library.custom_op("tracedac::accumulate_", mutates_args=("dst",))
def _accumulate_op(dst: torch.Tensor, src: torch.Tensor, backend: str) -> None:
    """dst += src upcast to dst's dtype."""
    _accumulate_impl(dst, src, backend)


def _accumulate_impl(dst: torch.Tensor, src: torch.Tensor, backend: str) -> None:
    key = _accumulate_key(dst, src)
    _op_body("accumulate_", _accumulate_calls, key, [src], dst, backend, _accumulate_torch, True)


@_accumulate_op.register_fake
def _accumulate_fake(dst: torch.Tensor, src: torch.Tensor, backend: str) -> None:
    return None
