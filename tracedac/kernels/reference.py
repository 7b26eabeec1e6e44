"""The pure-torch backend: what the Triton kernel must match, and the CPU path.

Each source is cast straight into its slice of ``dst`` (one read, one write, no concatenated
temporary). A strided source is first made contiguous in its own dtype: on CPU torch's cast
gives other NaN bits for strided inputs than for contiguous ones, and this keeps both
backends on the contiguous rule.
"""

import torch

__all__ = ["pack_cast_torch", "accumulate_torch"]


def pack_cast_torch(srcs: list[torch.Tensor], dst: torch.Tensor) -> None:
    start = 0
    for src in srcs:
        numel = src.numel()
        dst[start : start + numel].copy_(src.reshape(-1))  # [numel]
        start += numel


def accumulate_torch(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Mixed-dtype add_ is exactly dst.add_(src.to(dst.dtype)): TensorIterator casts CPU inputs
    # with .to() first and fuses the same conversion into the kernel on CUDA (one pass there).
    dst.add_(src)
