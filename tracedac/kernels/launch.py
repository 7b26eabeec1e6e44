"""Host side of the Triton backend: pick the compiled or interpreted kernel, plan, launch.

Triton is imported here, on first use, never when ``tracedac.kernels`` is imported.
"""

import functools
import os

import torch

from .bits import FORMATS
from .table import plan_for

__all__ = ["triton_available", "interpreter_enabled", "launch", "launches"]

# GPU: 16 elements per thread with 8 warps, 16-byte vector accesses when aligned.
_GPU_BLOCK = 4096
_GPU_WARPS = 8
# The interpreter runs every program as Python over numpy arrays: few, wide programs.
_INTERPRETER_MAX_BLOCK = 1 << 16
_INTERPRETER_MIN_BLOCK = 1 << 10

# Kernel launches made so far; the benchmark and the tests read it to show one per call.
launches = 0


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """Whether the user asked for Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


@functools.cache
def _kernel(interpreted: bool):
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from .triton_kernels import pack_cast_kernel

    # The module-level kernel is whichever flavour TRITON_INTERPRET chose at import; build
    # the other from the same Python function, so CPU tests and GPU runs share a process.
    fn = pack_cast_kernel.fn
    if interpreted:
        return (
            pack_cast_kernel if isinstance(pack_cast_kernel, InterpretedFunction) else InterpretedFunction(fn)
        )
    return pack_cast_kernel if isinstance(pack_cast_kernel, JITFunction) else JITFunction(fn)


def _block(srcs: list[torch.Tensor], interpreted: bool) -> int:
    if not interpreted:
        return _GPU_BLOCK
    largest = max(s.numel() for s in srcs)
    return max(_INTERPRETER_MIN_BLOCK, min(_INTERPRETER_MAX_BLOCK, 1 << max(largest - 1, 0).bit_length()))


def launch(srcs: list[torch.Tensor], dst: torch.Tensor, *, accumulate: bool) -> None:
    """Convert ``srcs`` (already validated) into ``dst`` in one kernel launch."""
    global launches
    if dst.numel() == 0:
        return
    interpreted = dst.device.type == "cpu"
    block = _block(srcs, interpreted)
    plan = plan_for(srcs, dst, block)
    kernel = _kernel(interpreted)[(plan.programs,)]
    args = (plan.segment_table, plan.block_rows, dst)
    meta = dict(
        DST_KIND=FORMATS[dst.dtype].kind,
        ACCUMULATE=accumulate,
        ALIGNED=plan.aligned,
        DST_ALIGN=16 // dst.element_size(),
        BLOCK=block,
        num_warps=_GPU_WARPS,
    )
    if interpreted:
        import numpy

        # inf - inf and NaN inputs are expected here; a GPU does not warn about them either.
        with numpy.errstate(invalid="ignore", over="ignore"):
            kernel(*args, **meta)
    else:
        # Triton launches on the current device, which need not be dst's.
        with torch.cuda.device(dst.device):
            kernel(*args, **meta)
    launches += 1
