"""Host side of the Triton backend: pick the compiled or interpreted kernel, plan, launch.

A launch is prepared once for a call's key (``cast.py``): the plan with its device table, the
grid, the kernel's constexpr arguments and dst's device index are all fixed by the sources' and
dst's metadata, so a :class:`Launch` keeps them and each later call with the same key only
passes the current ``dst`` to the kernel.

The first launch goes through Triton's public syntax, ``kernel[grid](*args, **meta)``, which
compiles the kernel and returns it. Every later launch of a prepared :class:`Launch` calls that
compiled kernel's launcher directly (:func:`_bare_launcher`): Triton's ``kernel[grid]`` binds and
specializes every argument, looks the kernel up and builds launch metadata on each call, and its
launcher asks the driver about each tensor's pointer: on the H200 machine a call took 58 us of
host time that way and takes 28 this way (results/history/gpu.md, run 4), the fixed cost that had made
small units slower than FSDP2's copy-in. A prepared launch has nothing left to decide: the same
kernel, grid, constants and pointers every call. Where this Triton's compiled kernel lacks what
that needs, or a launch hook is registered (a profiler: Triton's runner passes it launch
metadata), the public path runs.

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

    __slots__ = ("plan", "kernel", "grid", "meta", "device", "cacheable", "bare", "dst_ptr")

    def __init__(self, srcs: list[torch.Tensor], dst: torch.Tensor, accumulate: bool) -> None:
        self.plan: Plan | None = None  # None: dst is empty, nothing to launch
        self.cacheable = True
        # CUDA, after the first launch: the compiled kernel's launcher (_bare_launcher), or False
        # where this Triton has none (then Triton's runner launches every call, as at first)
        self.bare = None
        self.dst_ptr = dst.data_ptr()
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
        bare = self.bare
        if bare and dst.data_ptr() == self.dst_ptr and bare(self.device):
            launches += 1
            return
        run = self.kernel[self.grid]
        if self.device is None:
            import numpy

            # inf - inf and NaN inputs are expected here; a GPU does not warn about them either.
            with numpy.errstate(invalid="ignore", over="ignore"):
                run(plan.segment_table, plan.block_rows, dst, **self.meta)
        else:
            if self.device == torch.cuda.current_device():
                compiled = run(plan.segment_table, plan.block_rows, dst, **self.meta)
            else:
                with torch.cuda.device(self.device):
                    compiled = run(plan.segment_table, plan.block_rows, dst, **self.meta)
            if bare is None and self.cacheable and dst.data_ptr() == self.dst_ptr:
                pointers = (plan.segment_table.data_ptr(), plan.block_rows.data_ptr(), self.dst_ptr)
                self.bare = _bare_launcher(compiled, self.kernel, self.grid[0], pointers, self.meta) or False
        launches += 1


def _bare_launcher(compiled, kernel, programs: int, pointers: tuple, meta: dict):
    """``launch(device) -> bool``: launches ``compiled`` (what ``kernel[grid](...)`` returned)
    on ``programs`` programs with the kernel's ``pointers`` (as integers) and constexpr ``meta``
    on ``device``'s current stream, and returns True; returns False, launching nothing, when
    ``device`` is not the current one or a launch hook is registered. None where this Triton's
    compiled kernel has no such launcher.

    It makes the call Triton's own runner (``CompiledKernel.__getitem__``, the same in Triton
    3.6 and 3.9) makes: ``run(grid, stream, function, packed_metadata, launch_metadata,
    enter_hook, exit_hook, *args)``, with no launch metadata and no hooks, which is what that
    runner passes when none is registered. Pointers go as integers, so the launcher does not
    ask the driver about each one (the addresses were checked by the first, public, launch).
    """
    try:
        from triton import knobs
        from triton.runtime import driver

        # every parameter in order, constexprs included, as the JIT passes them to the launcher
        args = (*pointers, *[meta[name] for name in kernel.arg_names[len(pointers) :]])
        run = compiled.run  # (loads the module on first access)
        function, packed = compiled.function, compiled.packed_metadata
        runtime = knobs.runtime
        runtime.launch_enter_hook, runtime.launch_exit_hook  # noqa: B018 (present in this Triton)
        current_stream = driver.active.get_current_stream
        current_device = driver.active.get_current_device
    except (ImportError, AttributeError, KeyError, RuntimeError):
        return None

    def unhooked(hook) -> bool:
        return hook is None or not getattr(hook, "calls", True)  # Triton 3.6+: an empty HookChain

    def launch(device: int) -> bool:
        if device != current_device() or not (
            unhooked(runtime.launch_enter_hook) and unhooked(runtime.launch_exit_hook)
        ):
            return False
        run(programs, 1, 1, current_stream(device), function, packed, None, None, None, *args)
        return True

    return launch


def prepare(srcs: list[torch.Tensor], dst: torch.Tensor, *, accumulate: bool) -> Launch:
    """The launch that converts ``srcs`` (already validated) into ``dst``."""
    return Launch(srcs, dst, accumulate)


def launch(srcs: list[torch.Tensor], dst: torch.Tensor, *, accumulate: bool) -> None:
    """Convert ``srcs`` (already validated) into ``dst`` in one kernel launch, uncached."""
    Launch(srcs, dst, accumulate)(dst)
