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
"""

import torch

from .checks import check_accumulate, check_no_overlap, check_pack_cast, resolve_backend
from .reference import accumulate_torch, pack_cast_torch

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
    srcs = check_pack_cast(srcs, dst)
    backend = resolve_backend("pack_cast", backend, dst.device)
    if _unobserved([dst, *srcs]):
        _pack_cast_impl(srcs, dst, backend)
        torch.autograd.graph.increment_version(dst)
    else:
        torch.ops.tracedac.pack_cast(srcs, dst, backend)
    return dst


def accumulate_(dst: torch.Tensor, src: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``dst += src`` for a float32 ``dst``, upcasting a bfloat16 or float16 ``src`` in the same pass.

    Bit-for-bit ``dst.add_(src.to(dst.dtype))``. ``src`` may have any layout; ``dst`` must be
    contiguous and of the same shape. ``backend`` as for :func:`pack_cast`. Returns ``dst``.
    """
    check_accumulate(dst, src)
    backend = resolve_backend("accumulate_", backend, dst.device)
    if _unobserved([dst, src]):
        _accumulate_impl(dst, src, backend)
        torch.autograd.graph.increment_version(dst)
    else:
        torch.ops.tracedac.accumulate_(dst, src, backend)
    return dst


# Private, hence looked up defensively: without it every call takes the op path.
_dispatch_stack_len = getattr(torch._C, "_len_torch_dispatch_stack", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


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


@torch.library.custom_op("tracedac::pack_cast", mutates_args=("dst",))
def _pack_cast_op(srcs: list[torch.Tensor], dst: torch.Tensor, backend: str) -> None:
    """Cast the flattened srcs into consecutive slices of dst."""
    _pack_cast_impl(srcs, dst, backend)


def _pack_cast_impl(srcs: list[torch.Tensor], dst: torch.Tensor, backend: str) -> None:
    check_no_overlap("pack_cast", srcs, dst)
    if backend == "triton":
        from .launch import launch

        launch(srcs, dst, accumulate=False)
    else:
        pack_cast_torch(srcs, dst)


@_pack_cast_op.register_fake
def _pack_cast_fake(srcs: list[torch.Tensor], dst: torch.Tensor, backend: str) -> None:
    return None


@torch.library.custom_op("tracedac::accumulate_", mutates_args=("dst",))
def _accumulate_op(dst: torch.Tensor, src: torch.Tensor, backend: str) -> None:
    """dst += src upcast to dst's dtype."""
    _accumulate_impl(dst, src, backend)


def _accumulate_impl(dst: torch.Tensor, src: torch.Tensor, backend: str) -> None:
    check_no_overlap("accumulate_", [src], dst)
    if backend == "triton":
        from .launch import launch

        launch([src], dst.view(-1), accumulate=True)
    else:
        accumulate_torch(dst, src)


@_accumulate_op.register_fake
def _accumulate_fake(dst: torch.Tensor, src: torch.Tensor, backend: str) -> None:
    return None
