"""Argument checks for pack_cast and accumulate_: what went wrong, why it matters, what to do.

Everything here reads metadata only (shapes, dtypes, devices), so it also runs on fake
tensors while tracing; the memory-overlap check needs real addresses and runs in the op.
"""

import torch

from . import launch

__all__ = ["BACKENDS", "DTYPES", "check_pack_cast", "check_accumulate", "check_no_overlap", "resolve_backend"]

BACKENDS = ("auto", "triton", "torch")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = "float32, bfloat16 or float16"


def resolve_backend(op: str, backend: object, device: torch.device) -> str:
    """The concrete backend ('triton' or 'torch') that runs ``op`` on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(
            f"{op} got backend={backend!r}, which is not one of {', '.join(map(repr, BACKENDS))}. "
            "Pass one of those; 'auto' picks Triton on CUDA when it is installed and torch otherwise."
        )
    if backend == "auto":
        return "triton" if device.type == "cuda" and launch.triton_available() else "torch"
    if backend == "triton":
        if not launch.triton_available():
            raise RuntimeError(
                f"{op}(backend='triton') needs the triton package, which cannot be imported here. "
                "Install it (pip install triton, or tracedac[triton]) or use backend='torch'."
            )
        if device.type == "cpu" and not launch.interpreter_enabled():
            raise RuntimeError(
                f"{op}(backend='triton') got CPU tensors, which Triton runs only in its interpreter "
                "(slow; meant for tests). Set TRITON_INTERPRET=1 in the environment to use it, "
                "use backend='torch' (or 'auto'), or move the tensors to a CUDA device."
            )
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError(
                f"{op}(backend='triton') got tensors on {device}; the kernel runs on CUDA devices "
                "(and on CPU under TRITON_INTERPRET=1). Use backend='torch' on this device."
            )
    return backend


def _check_tensor(op: str, name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op} expects {name} to be a torch.Tensor, got {type(value).__name__}.")
    if value.layout != torch.strided:
        raise TypeError(
            f"{op} reads and writes dense tensors through their storage, but {name} is {value.layout}. "
            f"Pass {name}.to_dense()."
        )
    return value


def _check_dtype(op: str, name: str, t: torch.Tensor, hint: str) -> None:
    if t.dtype not in DTYPES:
        raise TypeError(f"{op} handles {_DTYPE_NAMES} tensors, but {name} is {t.dtype}. {hint}")


def _check_device(op: str, name: str, t: torch.Tensor, dst: torch.Tensor) -> None:
    if t.device != dst.device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but dst is on {dst.device}; the kernel reads every "
            f"source where it lives, on dst's device. Move it there first ({name}.to(dst.device))."
        )


def check_pack_cast(srcs: object, dst: object) -> list[torch.Tensor]:
    """Validate pack_cast's arguments; returns srcs as a list."""
    op = "pack_cast"
    if isinstance(srcs, torch.Tensor) or not isinstance(srcs, (list, tuple)):
        raise TypeError(
            f"pack_cast takes srcs as a list or tuple of tensors, got {type(srcs).__name__}. "
            "Wrap a single tensor in a list: pack_cast([t], dst)."
        )
    dst = _check_tensor(op, "dst", dst)
    if dst.dim() != 1:
        raise ValueError(
            f"pack_cast fills a flat (1-D) dst, but dst has shape {tuple(dst.shape)}: the sources "
            "are written back to back as one run of memory. Pass dst.view(-1) or a 1-D slice of "
            "your buffer."
        )
    if dst.numel() > 1 and dst.stride(0) != 1:
        raise ValueError(
            f"pack_cast fills a contiguous dst, but dst has stride {dst.stride(0)}: the sources "
            "are written back to back. Pass a contiguous 1-D slice such as buffer[start:stop]."
        )
    _check_dtype(op, "dst", dst, "Give dst one of those dtypes, or cast with torch directly.")
    srcs = list(srcs)
    total = 0
    for i, src in enumerate(srcs):
        name = f"srcs[{i}]"
        _check_tensor(op, name, src)
        _check_dtype(op, name, src, f"Convert it first ({name}.float()) or leave it out.")
        _check_device(op, name, src, dst)
        total += src.numel()
    if total != dst.numel():
        raise ValueError(
            f"pack_cast: the {len(srcs)} sources hold {total} elements in all but dst has "
            f"{dst.numel()}; dst must be filled exactly. Pass a slice of the right length "
            f"(buffer[start:start + {total}]) or check which source is missing or extra."
        )
    return srcs


def check_accumulate(dst: object, src: object) -> None:
    """Validate accumulate_'s arguments."""
    op = "accumulate_"
    dst = _check_tensor(op, "dst", dst)
    src = _check_tensor(op, "src", src)
    if dst.dtype != torch.float32:
        raise TypeError(
            f"accumulate_ adds into a float32 dst (the fp32 gradient shard), but dst is {dst.dtype}. "
            "For other dtypes use dst.add_(src)."
        )
    _check_dtype(op, "src", src, "Convert it first (src.float()).")
    _check_device(op, "src", src, dst)
    if src.shape != dst.shape:
        raise ValueError(
            f"accumulate_: src has shape {tuple(src.shape)} but dst has {tuple(dst.shape)}; it adds "
            "element by element and does not broadcast. If they hold the same elements, pass "
            "src.view(dst.shape)."
        )
    if not dst.is_contiguous():
        raise ValueError(
            f"accumulate_ updates a contiguous dst, but dst has strides {dst.stride()}: the kernel "
            "writes it as one run of memory. Accumulate into a contiguous tensor (a 1-D slice of "
            "the flat shard) and copy back if you must."
        )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) that t's elements occupy (holes included)."""
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + t.numel() * t.element_size()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def check_no_overlap(op: str, srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    """Raise if a source shares memory with dst (an exact alias of dst is fine: elementwise)."""
    if dst.numel() == 0:
        return
    dst_start, dst_end = _span(dst)
    for i, src in enumerate(srcs):
        if src.numel() == 0:
            continue
        start, end = _span(src)
        if start >= dst_end or end <= dst_start:
            continue
        exact_alias = (
            start == dst_start
            and src.dtype == dst.dtype
            and src.shape == dst.shape
            and src.stride() == dst.stride()
        )
        if not exact_alias:
            raise ValueError(
                f"{op}: source {i} overlaps dst in memory, so some of it would be overwritten "
                "before it is read. Copy that source first (src.clone()) or write into a "
                "separate buffer."
            )
