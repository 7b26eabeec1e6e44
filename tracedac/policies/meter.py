"""How many bytes a device holds now, and the most it held since the last look: what
``peak(...)`` measures a step with (``policies/peak.py``).

A ``Meter`` reads the memory the device's tensors occupy from outside tracedac's own
bookkeeping (never from what a region says it keeps), at moments the caller picks (``mark``):

- **accelerators** (``AllocatorMeter``, CUDA): torch's caching allocator, ``memory_allocated``
  now and ``max_memory_allocated`` since the last mark, which ``reset_peak_memory_stats`` starts
  again. Everything the allocator handed out counts: parameters, gradients, optimizer state,
  ZeRO's gathered buffers and prefetches, workspaces.
- **the CPU** (``TensorMeter``): glibc keeps no peak to read, and torch's CPU allocator no
  statistics, so the bytes of live tensor storages are counted: every storage alive when
  measuring starts (found by the garbage collector: parameters, their gradients, optimizer
  state, inputs, and every other tensor the process holds) and every storage an op returns
  while it runs, each let go of when its storage dies (a weak reference). A dispatch mode sees
  the ops, forward, backward and what runs between (the optimizer); it sits at the bottom of
  the mode stack so that modes entered and left around it keep their order
  (``_compat.insert_mode_below``). What it cannot see: a kernel's own scratch buffers (they never
  leave the op), and Python objects.

Reading a ``TensorMeter`` costs a Python call per op while it runs; tracedac runs one only for
the steps it measures.
"""

from __future__ import annotations

import functools
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._compat import allocation_events, dynamo_off, dynamo_restore, insert_mode_below, remove_mode

__all__ = ["AllocatorMeter", "Meter", "ProfilerMeter", "TensorMeter", "meter_for"]


class Meter:
    """Bytes in use on one device: ``start`` begins, ``mark`` reads, ``stop`` ends."""

    device: torch.device

    def start(self) -> int:
        """Begin measuring; the bytes in use now."""
        raise NotImplementedError

    def mark(self) -> tuple[int, int]:
        """(bytes in use now, the most in use since the last mark or the start)."""
        raise NotImplementedError

    def stop(self) -> tuple[int, int]:
        """The last ``mark``, and stop measuring."""
        raise NotImplementedError

    def now(self) -> int:
        """The bytes in use now, read on their own (not measuring)."""
        raise NotImplementedError

    def describe(self) -> str:
        """How this meter measures, for reports."""
        raise NotImplementedError

    def pause(self) -> None:
        """Leave out what is allocated until ``resume`` (tracedac's own planning): a meter that
        reads the allocator cannot, and need not where planning runs on the host."""

    def resume(self) -> None:
        """Count again after ``pause``."""


class AllocatorMeter(Meter):
    """An accelerator's caching allocator (``torch.cuda``): its own figures, read on the host
    with no synchronization (the allocator accounts a block when the host asks for it). Each
    mark resets the peak statistic, so a program's own ``max_memory_allocated`` reads the peak
    since tracedac's last mark during the steps it measures."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(
                f"AllocatorMeter reads torch.cuda's allocator statistics, and {device} is not a CUDA "
                "device; measure the CPU with TensorMeter."
            )
        self.device = device

    def start(self) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def mark(self) -> tuple[int, int]:
        now = torch.cuda.memory_allocated(self.device)
        most = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return now, max(now, most)

    def stop(self) -> tuple[int, int]:
        return self.mark()

    def now(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def describe(self) -> str:
        return f"torch.cuda.memory_allocated / max_memory_allocated on {self.device}"


class _SeeResults(TorchDispatchMode):
    """Hands every op's tensor results to the meter (``TensorMeter.see``)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # as the recorder's: no dynamo-disable frame per call (and no import of torch._dynamo)
        return False

    def __init__(self, meter: TensorMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.meter.paused:
            return out
        see = self.meter.see
        for t in tree_leaves(out):
            if type(t) is torch.Tensor:
                see(t)
        return out


def _freed(meter_ref, key: int, _storage_ref) -> None:
    meter = meter_ref()
    if meter is not None:
        meter.level -= meter.live.pop(key, 0)
        meter.refs.pop(key, None)


class TensorMeter(Meter):
    """The bytes of the live tensor storages on ``device`` (the CPU): see the module's notes."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.live: dict[int, int] = {}  # storage address -> its bytes
        self.refs: dict[int, weakref.ref] = {}  # storage address -> a weak reference that lets go of it
        self.level = 0  # bytes of the storages in ``live``
        self.most = 0  # the most ``level`` was since the last mark
        self.mode = None
        self.paused = False
        self._dynamo = None
        self._weak = weakref.ref(self)

    def pause(self) -> None:
        self.paused = True
        if self.mode is not None:  # (and no Python call per op meanwhile; not inside a backward)
            remove_mode(self.mode)

    def resume(self) -> None:
        self.paused = False
        if self.mode is not None:
            insert_mode_below(self.mode)

    def see(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage if it is new; follow a storage an op grew (``resize_``)."""
        if t.device != self.device:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage of its own (a sparse tensor...)
            return
        key = storage._cdata
        n = storage.nbytes()
        old = self.live.get(key)
        if old is None:
            self.refs[key] = weakref.ref(storage, functools.partial(_freed, self._weak, key))
            self.live[key] = n
            self.level += n
        elif old != n:
            self.live[key] = n
            self.level += n - old
        if self.level > self.most:
            self.most = self.level

    def _alive(self):
        """Every plain tensor on the device the garbage collector knows (parameters, gradients,
        optimizer state, inputs; a subclass's inner tensors are found on their own), and each
        leaf's gradient, which has no Python object until someone reads it."""
        for o in gc.get_objects():
            if (type(o) is torch.Tensor or type(o) is torch.nn.Parameter) and o.device == self.device:
                yield o
                grad = o.grad if o.is_leaf and o.requires_grad else None
                if type(grad) is torch.Tensor:
                    yield grad

    def now(self) -> int:
        seen: dict[int, int] = {}
        for t in self._alive():
            storage = t.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
        return sum(seen.values())

    def start(self) -> int:
        self.live.clear()
        self.refs.clear()
        self.level = 0
        for t in self._alive():
            self.see(t)
        self.most = self.level
        self.mode = _SeeResults(self)
        # Compiled code cannot run under the mode (dynamo would skip its frames for good, as it
        # would under a region's recorder): it runs eagerly, and is measured, until ``stop``.
        self._dynamo = dynamo_off()
        insert_mode_below(self.mode)
        return self.level

    def mark(self) -> tuple[int, int]:
        now, most = self.level, max(self.most, self.level)
        self.most = now
        return now, most

    def stop(self) -> tuple[int, int]:
        out = self.mark()
        if self.mode is not None:
            remove_mode(self.mode)
            self.mode = None
            dynamo_restore(self._dynamo)
            self._dynamo = None
        self.live.clear()
        self.refs.clear()  # (their callbacks die with them)
        return out

    @property
    def running(self) -> bool:
        return self.mode is not None

    def describe(self) -> str:
        return f"bytes of live tensor storages on {self.device} (a dispatch mode and weak references)"


class ProfilerMeter(Meter):
    """The CPU's allocator as torch's profiler reports it (``profile_memory=True``): every
    allocation and free of a tensor's memory, compiled code's too (which ``TensorMeter`` cannot
    see: compiled code runs eagerly under its mode). From ``start`` to ``stop`` only (the
    profiler's events are read when it stops): for measuring a whole step, not its moments.
    What was alive at ``start`` is counted as ``TensorMeter`` counts it; a free of it during the
    step is not reported by the allocator, so the figure can only err upwards."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError(
                f"ProfilerMeter reads the CPU allocator's events, and {self.device} is not the CPU"
            )
        self.profile = None
        self.base = 0

    def start(self) -> int:
        self.base = TensorMeter(self.device).now()
        activities = [torch.profiler.ProfilerActivity.CPU]
        self.profile = torch.profiler.profile(activities=activities, profile_memory=True)
        self.profile.__enter__()
        return self.base

    def mark(self) -> tuple[int, int]:
        raise NotImplementedError(
            "ProfilerMeter reads the allocator's events when it stops: it measures from start() to stop() "
            "only; use TensorMeter (the CPU) or AllocatorMeter (CUDA) to read moments in between."
        )

    def stop(self) -> tuple[int, int]:
        self.profile.__exit__(None, None, None)
        level = most = 0
        for size in allocation_events(self.profile):
            level += size
            most = max(most, level)
        self.profile = None
        return self.base + level, self.base + most

    def now(self) -> int:
        return TensorMeter(self.device).now()

    def describe(self) -> str:
        return "torch.profiler's CPU allocation events over the step, plus the tensors alive before it"


def meter_for(device: torch.device, *, compiled: bool = False) -> Meter:
    """The meter for ``device``: its allocator's statistics on CUDA; on the CPU live tensor
    storages (``TensorMeter``), or with ``compiled`` (a step that runs compiled code, read from
    start to stop only) the profiler's allocation events (``ProfilerMeter``)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return AllocatorMeter(torch.device("cuda", index))
    if device.type == "cpu":
        return ProfilerMeter(device) if compiled else TensorMeter(device)
    raise ValueError(
        f"peak() measures device memory on CUDA (torch.cuda's allocator statistics) or the CPU (live "
        f"tensor storages), and this region runs on {device}. Pass a meter of your own: "
        "policies.peak(budget, meter=...), an object with start(), mark() and stop() (policies.meter.Meter)."
    )
