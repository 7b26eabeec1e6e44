"""The link between host and device, and the device's FLOP rate: what a planner that may
offload (``memory_budget(b, offload=...)``, ``min_cut(offload=...)``) weighs a copy against a
replay with.

``Link(bandwidth, flop_rate)`` holds the two figures, passed in or measured: a field left
``None`` is measured once per device (and dtype) the first time a plan needs it, then cached
for the process (``measure``). On CUDA: a copy of 64 MiB between pinned host memory and the
device, each way (the slower way is the figure), and a 4096-square matmul in the dtype of the
region's largest matmul. On the CPU, where the host is both ends, a memcpy of 16 MiB and a
256-square matmul: figures that only exercise the decisions, not a link anyone offloads over.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch

__all__ = ["Link", "measure"]


def _number(x) -> str:
    """``x`` as a Python literal that evaluates equal to it: ``5.5e+10``, ``float('inf')``."""
    if math.isinf(x):
        return "float('inf')"
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


@dataclass(frozen=True)
class Link:
    """``bandwidth``: bytes per second each way between host memory and the device (``0``: no
    link, nothing is offloaded; ``float('inf')``: copies cost nothing). ``flop_rate``: FLOPs per
    second the device's matmuls run at. ``None`` (either): measured for the device (``measure``)."""

    bandwidth: float | None = None
    flop_rate: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("bandwidth", self.bandwidth), ("flop_rate", self.flop_rate)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"Link({name}={value!r}): {name} is a number ({_UNITS[name]}), or None to measure it "
                    "on the device."
                )
            if math.isnan(value) or value < 0 or (name == "flop_rate" and (value == 0 or math.isinf(value))):
                raise ValueError(f"Link({name}={value!r}): {_RANGE[name]}")

    @property
    def measured(self) -> bool:
        """Whether a figure is left to be measured."""
        return self.bandwidth is None or self.flop_rate is None

    def __repr__(self) -> str:
        given = (("bandwidth", self.bandwidth), ("flop_rate", self.flop_rate))
        return f"Link({', '.join(f'{k}={_number(v)}' for k, v in given if v is not None)})"


_UNITS = {"bandwidth": "bytes per second each way", "flop_rate": "FLOPs per second"}
_RANGE = {
    "bandwidth": (
        "a bandwidth is bytes per second each way, >= 0 (0: no link, nothing is offloaded; "
        "float('inf'): copies cost nothing). Pass a measured figure (PCIe 5 x16 moves about 55e9), "
        "or leave it out to measure it on the device."
    ),
    "flop_rate": (
        "a FLOP rate is the FLOPs per second the device's matmuls run at, finite and > 0 (an H100 "
        "runs bf16 matmuls at about 7e14). Pass a measured figure, or leave it out to measure it."
    ),
}

_measured: dict = {}
_lock = threading.Lock()


def measure(device="cpu", dtype: torch.dtype = torch.float32) -> Link:
    """The link and FLOP rate of ``device`` (matmuls in ``dtype``), measured the first time
    asked and cached for the process."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    # Below any dispatch mode (a region being recorded around a plan made at a nested region's
    # end, a FLOP counter) and autograd; the tensors are constants, drawing nothing from the
    # program's random generators.
    with _lock, torch.no_grad(), torch._C._DisableTorchDispatch():
        link = _measured.get(key)
        if link is None:
            if device.type == "cuda":
                link = Link(_cuda_bandwidth(device), _cuda_flop_rate(device, dtype))
            elif device.type == "cpu":
                link = Link(_cpu_bandwidth(), _cpu_flop_rate(dtype))
            else:
                raise ValueError(
                    f"tracedac measures the link and FLOP rate on CUDA devices and the CPU, not on "
                    f"{device.type}: pass both figures, offload=Link(bandwidth=..., flop_rate=...)."
                )
            _measured[key] = link
        return link


def resolve(link: Link, device, dtype: torch.dtype) -> Link:
    """``link`` with any ``None`` figure measured for ``device`` and ``dtype``."""
    if not link.measured:
        return link
    got = measure(device, dtype)
    return Link(
        got.bandwidth if link.bandwidth is None else link.bandwidth,
        got.flop_rate if link.flop_rate is None else link.flop_rate,
    )


def _best(fn, reps: int = 3) -> float:
    """The least of ``reps`` timings (seconds) of ``fn``, after one call to warm up."""
    fn()
    return min(fn() for _ in range(reps))


def _cpu_bandwidth() -> float:
    src = torch.ones(16 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def run() -> float:
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t

    return src.numel() / max(_best(run), 1e-9)


def _cpu_flop_rate(dtype: torch.dtype) -> float:
    n = 256
    dtype = dtype if dtype.is_floating_point else torch.float32
    a, b = torch.full((n, n), 0.5, dtype=dtype), torch.full((n, n), 0.25, dtype=dtype)

    def run() -> float:
        t = time.perf_counter()
        a @ b
        return time.perf_counter() - t

    return 2 * n**3 / max(_best(run), 1e-9)


def _cuda_time(device, fn) -> float:
    with torch.cuda.device(device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _cuda_bandwidth(device) -> float:
    host = torch.ones(64 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    up = _best(lambda: _cuda_time(device, lambda: dev.copy_(host, non_blocking=True)))
    down = _best(lambda: _cuda_time(device, lambda: host.copy_(dev, non_blocking=True)))
    return host.numel() / max(up, down, 1e-9)


def _cuda_flop_rate(device, dtype: torch.dtype) -> float:
    n = 4096
    dtype = dtype if dtype.is_floating_point else torch.float32
    a = torch.full((n, n), 0.5, dtype=dtype, device=device)
    b = torch.full((n, n), 0.25, dtype=dtype, device=device)
    return 2 * n**3 / max(_best(lambda: _cuda_time(device, lambda: a @ b)), 1e-9)
