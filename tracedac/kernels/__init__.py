"""Fused cast kernels: fp32 shards into a low-precision buffer in one pass, and back.

``pack_cast`` packs any number of tensors into a flat buffer while converting them;
``accumulate_`` adds a low-precision gradient into an fp32 one. Triton on CUDA, torch
elsewhere; Triton is imported only when its backend first runs.
"""

from .cast import accumulate_, pack_cast
from .checks import BACKENDS, DTYPES

__all__ = ["pack_cast", "accumulate_", "BACKENDS", "DTYPES"]
