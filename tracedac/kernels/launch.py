"""Host side of the Triton backend: pick the compiled or interpreted kernel, plan, launch.

A launch is prepared once for a call's key (``cast.py``): the plan with its device table, the
grid, the kernel's constexpr arguments and dst's device index are all fixed by the sources' and
dst's metadata, so a :class:`Launch` keeps them and each later call with the same key only
passes the current ``dst`` to the kernel. Triton is used only through its public launch syntax,
``kernel[grid](*args, **meta)``, which is the same in every Triton 3 release.

Triton is imported here, on first use, never when ``tracedac.kernels`` is imported.
"""

import functools
import os

import torch

from .bits import FORMATS
from .table import Plan, build_plan

__all__ = ["triton_available", "interpreter_enabled", "Launch", "prepare", "launch", "launches"]

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


class Launch:
    """One prepared launch: everything but ``dst`` that a call with given sources and dst needs.

    It holds no tensor of the caller's, only the plan's own table (and, for a plan with
    ``keepalive``, its copies: such a launch is not ``cacheable`` and serves one call).
    """

    __slots__ = ("plan", "kernel", "grid", "meta", "device", "cacheable")

    def __init__(self, srcs: list[torch.Tensor], dst: torch.Tensor, accumulate: bool) -> None:
        self.plan: Plan | None = None  # None: dst is empty, nothing to launch
        self.cacheable = True
        if dst.numel() == 0:
            return
        interpreted = dst.device.type == "cpu"
        block = _block(srcs, interpreted)
        self.plan = plan = build_plan(srcs, dst, block)
        self.cacheable = not plan.keepalive  # a plan pointing at temporary copies is useless next time
        self.kernel = _kernel(interpreted)
        self.grid = (plan.programs,)
        self.meta = dict(
            DST_KIND=FORMATS[dst.dtype].kind,
            ACCUMULATE=accumulate,
            ALIGNED=plan.aligned,
            DST_ALIGN=16 // dst.element_size(),
            BLOCK=block,
            num_warps=_GPU_WARPS,
        )
        # The CUDA device to launch on (Triton launches on the current one); None on CPU.
        self.device = None if interpreted else dst.device.index

    def __call__(self, dst: torch.Tensor) -> None:
        """Launch into ``dst``, which has the metadata and address the launch was prepared for
        (its shape may differ from the flat one: the kernel sees only its data pointer)."""
        global launches
        plan = self.plan
        if plan is None:
            return
        run = self.kernel[self.grid]
        if self.device is None:
            import numpy

            # inf - inf and NaN inputs are expected here; a GPU does not warn about them either.
            with numpy.errstate(invalid="ignore", over="ignore"):
                run(plan.segment_table, plan.block_rows, dst, **self.meta)
        elif self.device == torch.cuda.current_device():
            run(plan.segment_table, plan.block_rows, dst, **self.meta)
        else:
            with torch.cuda.device(self.device):
                run(plan.segment_table, plan.block_rows, dst, **self.meta)
        launches += 1


def prepare(srcs: list[torch.Tensor], dst: torch.Tensor, *, accumulate: bool) -> Launch:
    """The launch that converts ``srcs`` (already validated) into ``dst``."""
    return Launch(srcs, dst, accumulate)


def launch(srcs: list[torch.Tensor], dst: torch.Tensor, *, accumulate: bool) -> None:
    """Convert ``srcs`` (already validated) into ``dst`` in one kernel launch, uncached."""
    Launch(srcs, dst, accumulate)(dst)
