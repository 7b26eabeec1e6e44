"""``python -m benchmarks --kernels``: pack_cast and accumulate_ against the torch code they replace.

One transformer block's parameters (Llama-style: q, k, v, o, gate, up, down, two norms, and
qkv/o biases) start as fp32 tensors and must end up as one flat bf16 run inside a bigger
gather buffer. Timed ways to do it:

- ``pack_cast``: tracedac, one pass (Triton, one launch, on CUDA; torch ``copy_`` per tensor on CPU);
- ``to + cat``: per-tensor ``.to(bf16)``, ``torch.cat``, then a copy into the gather buffer;
- ``FSDP2``: ``torch._foreach_copy_`` of the fp32 tensors into a flat bf16 buffer, then a
  second copy into the gather buffer (what FSDP2's all-gather input path does).

Effective GB/s counts the bytes a one-pass cast must move (fp32 read + bf16 written), the same
for every way, so the numbers compare directly. On CUDA the run also measures the card's
copy bandwidth and counts the kernels one pack_cast launches.

Then two size sweeps over Llama-style blocks (intermediate about 2.75 x hidden) of 0.5M to
100M elements (on CPU only up to ``CPU_SWEEP_MAX_ELEMENTS``; ``quick``: two small ones):

- pack_cast against FSDP2's copy-in, and against ``copy``: one device-to-device copy of the
  same bytes (what the card's copy engine path reaches at that size);
- ``accumulate_`` (fp32 += bf16, upcast in the same pass) against torch's ``dst.add_(src)``.

Every size is checked bit for bit (int16 views for the bf16 casts, int32 for the fp32 sums).
The smallest unit gives the fixed cost per call: its device-clock time, and the host time of
one call (``time.perf_counter`` around a call, no synchronisation). Calls are timed back to
back, as in training, so at small sizes host work shows when it is slower than the kernel.
The small units' bytes also fit in an H100's 50 MB L2, which back-to-back calls reuse: there
every way, ``copy`` included, can beat the 1 GiB copy's bandwidth.
"""

import math
import statistics
import sys
import time

import torch

from tracedac.ops import accumulate_, pack_cast

from .child import GOALS, goal_line, table, target

__all__ = ["run", "block_shapes", "intermediate_for", "sweep_hidden", "SWEEP_HIDDEN", "QUICK_SWEEP_HIDDEN"]

_GB = 1e9

# Hidden sizes of the sweep's blocks: 0.53M, 2.1M, 8.5M, 25.4M, 51.4M and 101.8M elements.
SWEEP_HIDDEN = (208, 416, 832, 1440, 2048, 2880)
QUICK_SWEEP_HIDDEN = (64, 208)  # 0.05M and 0.53M elements
CPU_SWEEP_MAX_ELEMENTS = 10_000_000  # a 2-core CPU takes seconds per point above this
# Issue 18, item 4: on CUDA pack_cast is no slower than FSDP2's copy-in at any size, and
# reaches 85% of the copy bandwidth on units of 64 MiB of fp32 or more.
GOAL_FRACTION_OF_BANDWIDTH = 0.85
GOAL_MIN_UNIT_BYTES = 64 << 20


def block_shapes(hidden: int, intermediate: int) -> list[tuple[int, ...]]:
    """Parameter shapes of one Llama-style block with attention biases."""
    return [
        (hidden,),  # attention norm weight
        (hidden, hidden),
        (hidden,),  # q proj, bias
        (hidden, hidden),
        (hidden,),  # k proj, bias
        (hidden, hidden),
        (hidden,),  # v proj, bias
        (hidden, hidden),
        (hidden,),  # o proj, bias
        (hidden,),  # mlp norm weight
        (intermediate, hidden),  # gate proj
        (intermediate, hidden),  # up proj
        (hidden, intermediate),  # down proj
    ]


def intermediate_for(hidden: int) -> int:
    """A Llama-style feed-forward width: about 2.75 x hidden, a multiple of 64 (2048 -> 5632)."""
    return 64 * round(2.75 * hidden / 64)


def _progress(message: str) -> None:
    print(f"  ... {message}", file=sys.stderr, flush=True)


def _time_cpu(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, first-call dispatch
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_cuda(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    # Enqueued back to back, as in training: host-side work overlaps the previous call's
    # kernels, and shows in the timing only when it is slower than them.
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends))


def _host_time(fn, repeats: int, on_gpu: bool) -> float:
    """Median seconds the host spends in one call (on CUDA: enqueueing it; nothing waits)."""
    seconds = _time_cpu(fn, repeats)  # (wall time of the call: the host's, on CUDA)
    if on_gpu:
        torch.cuda.synchronize()
    return seconds


def _copy_bandwidth(device: torch.device, repeats: int) -> float:
    """Bytes per second of a large device-to-device copy (read + write), this card's ceiling."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    seconds = _time_cuda(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / seconds


def _kernels_per_call(fn) -> int:
    """CUDA kernels one call launches, counted by the profiler (copies and syncs excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and "memcpy" not in e.name.lower()
        and "memset" not in e.name.lower()
    ]
    return len(kernels)


class _PackUnit:
    """One block's fp32 parameters, its bf16 slot in the middle of a gather buffer, and the
    ways to fill the slot."""

    def __init__(self, hidden: int, intermediate: int, device: torch.device, gen: torch.Generator, backend):
        self.hidden, self.intermediate, self.backend = hidden, intermediate, backend
        self.srcs = [
            torch.randn(shape, generator=gen, device=device) for shape in block_shapes(hidden, intermediate)
        ]
        sizes = [s.numel() for s in self.srcs]
        self.numel = numel = sum(sizes)
        # The unit's slot inside a larger all-gather buffer (another rank's slot on either side).
        self.gather = torch.empty(3 * numel, dtype=torch.bfloat16, device=device)
        self.dst = self.gather[numel : 2 * numel]
        self.flat = torch.empty(numel, dtype=torch.bfloat16, device=device)
        self.flat_views = list(torch.split(self.flat, sizes))

    @property
    def bytes_moved(self) -> int:
        return self.numel * (4 + 2)  # fp32 read + bf16 written

    def describe(self) -> dict:
        return {
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "tensors": len(self.srcs),
            "elements": self.numel,
            "src_dtype": "float32",
            "dst_dtype": "bfloat16",
            "bytes_moved": self.bytes_moved,
        }

    def pack_cast(self):
        pack_cast(self.srcs, self.dst, backend=self.backend)

    def to_then_cat(self):
        self.dst.copy_(torch.cat([s.to(torch.bfloat16).view(-1) for s in self.srcs]))

    def fsdp2(self):
        torch._foreach_copy_(self.flat_views, [s.view(-1) for s in self.srcs])
        self.dst.copy_(self.flat)

    def bit_identical(self, ways: dict) -> bool:
        """Whether every way writes the same bits into the slot (which is first overwritten
        with a value no cast of the sources fills it with, so a way that writes nothing fails)."""
        outputs = []
        for fn in ways.values():
            self.dst.fill_(float("nan"))
            fn()
            outputs.append(self.dst.view(torch.int16).clone())
        return all(torch.equal(o, outputs[0]) for o in outputs)


def _time_ways(ways: dict, timer, repeats: int, moved: int, base: str, bandwidth: float | None) -> dict:
    """median_ms, gb_per_s, time_vs_<base> and fraction_of_copy_bandwidth of each way."""
    methods = {}
    for name, fn in ways.items():
        seconds = timer(fn, repeats)
        gb_per_s = moved / seconds / _GB
        methods[name] = {
            "median_ms": seconds * 1e3,
            "gb_per_s": gb_per_s,
            "fraction_of_copy_bandwidth": None if bandwidth is None else gb_per_s / bandwidth,
        }
    base_ms = methods[base]["median_ms"]
    for figures in methods.values():
        figures[f"time_vs_{base}"] = figures["median_ms"] / base_ms
    return methods


def _pack_point(hidden, device, gen, backend, timer, repeats, bandwidth, host: dict | None) -> dict:
    """One size of the pack_cast sweep; with ``host``, also each way's host time per call."""
    unit = _PackUnit(hidden, intermediate_for(hidden), device, gen, backend)
    # A plain copy of the same bytes: 3 bytes per element read and written, as a cast moves.
    copy_src = torch.ones(3 * unit.numel, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    ways = {"pack_cast": unit.pack_cast, "FSDP2": unit.fsdp2, "copy": lambda: copy_dst.copy_(copy_src)}
    identical = unit.bit_identical({k: ways[k] for k in ("pack_cast", "FSDP2")})
    methods = _time_ways(ways, timer, repeats, unit.bytes_moved, "pack_cast", bandwidth)
    if host is not None:
        host.update({name: _host_time(fn, repeats, device.type == "cuda") for name, fn in ways.items()})
    return {**unit.describe(), "bit_identical": identical, "methods": methods}


def _accumulate_point(numel, device, gen, backend, timer, repeats, bandwidth, host: dict | None) -> dict:
    """One size of the accumulate_ sweep: a flat fp32 gradient shard += a flat bf16
    reduce-scatter output; with ``host``, also each way's host time per call."""
    grad = torch.randn(numel, generator=gen, device=device)
    src = torch.randn(numel, generator=gen, device=device).to(torch.bfloat16)
    ways = {
        "accumulate_": lambda: accumulate_(grad, src, backend=backend),
        "add_": lambda: grad.add_(src),
    }
    start = grad.clone()
    outputs = []
    for fn in ways.values():
        grad.copy_(start)
        fn()
        outputs.append(grad.view(torch.int32).clone())
    identical = torch.equal(outputs[0], outputs[1])
    del start, outputs
    moved = numel * (4 + 2 + 4)  # fp32 read + bf16 read + fp32 written
    methods = _time_ways(ways, timer, repeats, moved, "accumulate_", bandwidth)
    if host is not None:
        host.update({name: _host_time(fn, repeats, device.type == "cuda") for name, fn in ways.items()})
    return {
        "elements": numel,
        "dst_dtype": "float32",
        "src_dtype": "bfloat16",
        "bytes_moved": moved,
        "bit_identical": identical,
        "methods": methods,
    }


def _sweeps(hiddens, device, gen, backend, timer, repeats: int, bandwidth: float | None) -> dict:
    """The pack_cast and accumulate_ sweeps over blocks of ``hiddens``, and the fixed cost per
    call measured on the smallest."""
    pack_units, accumulate_units, host = [], [], {}
    for i, hidden in enumerate(hiddens):
        _progress(
            f"sweep [{i + 1}/{len(hiddens)}]: hidden {hidden}, {_elements(hidden) / 1e6:.2f}M elements "
            f"({repeats} runs per way, median)"
        )
        args = (device, gen, backend, timer, repeats, bandwidth, host if i == 0 else None)
        point = _pack_point(hidden, *args)
        pack_units.append(point)
        accumulate_units.append(_accumulate_point(point["elements"], *args))
        # The figures so far, in case a later size fails.
        methods = {**point["methods"], **accumulate_units[-1]["methods"]}
        identical = point["bit_identical"] and accumulate_units[-1]["bit_identical"]
        _progress(
            ", ".join(f"{name} {m['median_ms']:.4f} ms" for name, m in methods.items())
            + f"; bit-identical: {identical}"
        )
    smallest = pack_units[0]
    return {
        "pack_cast": pack_units,
        "accumulate_": accumulate_units,
        "fixed_cost": {
            "elements": smallest["elements"],
            "pack_cast_ms": smallest["methods"]["pack_cast"]["median_ms"],
            "accumulate_ms": accumulate_units[0]["methods"]["accumulate_"]["median_ms"],
            "host_us_per_call": {name: seconds * 1e6 for name, seconds in host.items()},
        },
    }


def _targets(sweep: dict, backend: str, bandwidth: float | None) -> list[dict]:
    """Issue 18's goals for the Triton kernel, judged on the sweep (n/a on the torch backend)."""
    units = sweep["pack_cast"]
    vs_fsdp2 = None
    if backend == "triton":
        vs_fsdp2 = max(
            u["methods"]["pack_cast"]["median_ms"] / u["methods"]["FSDP2"]["median_ms"] for u in units
        )
    big = [u for u in units if u["elements"] * 4 >= GOAL_MIN_UNIT_BYTES]
    vs_copy = None
    if backend == "triton" and bandwidth is not None and big:
        vs_copy = max(bandwidth / u["methods"]["pack_cast"]["gb_per_s"] for u in big)
    return [
        target("pack_cast time / FSDP2 copy-in time, worst unit size (Triton on CUDA)", vs_fsdp2, 1.0),
        target(
            f"copy bandwidth / pack_cast GB/s, worst unit of >= {GOAL_MIN_UNIT_BYTES >> 20} MiB fp32 "
            f"(pack_cast at >= {GOAL_FRACTION_OF_BANDWIDTH:.0%} of copy bandwidth; Triton on CUDA)",
            vs_copy,
            1 / GOAL_FRACTION_OF_BANDWIDTH,
        ),
    ]


def _elements(hidden: int) -> int:
    """Parameters of the sweep's block of this hidden size."""
    return sum(math.prod(s) for s in block_shapes(hidden, intermediate_for(hidden)))


def sweep_hidden(*, quick: bool, on_gpu: bool) -> tuple[tuple[int, ...], str | None]:
    """The sweep's hidden sizes, and a line saying which were left out (on CPU), if any."""
    if quick:
        return QUICK_SWEEP_HIDDEN, None
    if on_gpu:
        return SWEEP_HIDDEN, None
    kept = tuple(h for h in SWEEP_HIDDEN if _elements(h) <= CPU_SWEEP_MAX_ELEMENTS)
    left_out = ", ".join(f"{_elements(h) / 1e6:.0f}M" for h in SWEEP_HIDDEN if h not in kept)
    return kept, (
        f"on CPU the sweeps stop at {CPU_SWEEP_MAX_ELEMENTS / 1e6:.0f}M elements; "
        f"the larger units ({left_out}) are measured on CUDA only"
    )


def _one_block(hidden, intermediate, device, gen, backend, timer, repeats: int) -> dict:
    """The three ways on one block: figures, and on CUDA the copy bandwidth and kernel counts."""
    on_gpu = device.type == "cuda"
    unit = _PackUnit(hidden, intermediate, device, gen, backend)
    ways = {"pack_cast": unit.pack_cast, "to + cat": unit.to_then_cat, "FSDP2": unit.fsdp2}
    bit_identical = unit.bit_identical(ways)
    methods = {}
    for i, (name, fn) in enumerate(ways.items(), 1):
        _progress(f"[{i}/{len(ways)}] timing {name} ({repeats} runs, median)")
        seconds = timer(fn, repeats)
        methods[name] = {"median_ms": seconds * 1e3, "gb_per_s": unit.bytes_moved / seconds / _GB}
    base = methods["pack_cast"]["median_ms"]
    for figures in methods.values():
        figures["time_vs_pack_cast"] = figures["median_ms"] / base

    result = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "backend": backend,
        "unit": unit.describe(),
        "repeats": repeats,
        "bit_identical": bit_identical,
        "methods": methods,
        "copy_bandwidth_gb_per_s": None,
        "pack_cast_fraction_of_bandwidth": None,
        "pack_cast_kernels_per_call": None,
        "accumulate_kernels_per_call": None,
    }
    if on_gpu:
        _progress("measuring copy bandwidth (1 GiB device-to-device copy)")
        bandwidth = _copy_bandwidth(device, repeats) / _GB
        result["copy_bandwidth_gb_per_s"] = bandwidth
        result["pack_cast_fraction_of_bandwidth"] = methods["pack_cast"]["gb_per_s"] / bandwidth
        _progress("counting kernel launches")
        result["pack_cast_kernels_per_call"] = _kernels_per_call(unit.pack_cast)
        grad = torch.zeros(unit.numel, device=device)
        result["accumulate_kernels_per_call"] = _kernels_per_call(
            lambda: accumulate_(grad, unit.dst, backend=backend)
        )
    return result


def run(*, quick: bool = False) -> dict:
    """Time the three ways on one block's parameters, then the size sweeps; print a table and
    return the figures.

    ``quick`` uses a small block (hidden 256), two small sweep sizes and few repeats, for
    tests; the default is a hidden-2048 block (51M parameters, 206 MB of fp32), big enough to
    be bandwidth-bound, and sweeps of 0.5M to 100M elements (on CPU up to
    ``CPU_SWEEP_MAX_ELEMENTS``).
    """
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    hidden, intermediate = (256, 704) if quick else (2048, 5632)
    repeats = 5 if quick else (50 if on_gpu else 10)
    backend = "triton" if on_gpu else "torch"
    timer = _time_cuda if on_gpu else _time_cpu
    gen = torch.Generator(device=device).manual_seed(0)

    result = _one_block(hidden, intermediate, device, gen, backend, timer, repeats)
    bandwidth = result["copy_bandwidth_gb_per_s"]

    hiddens, note = sweep_hidden(quick=quick, on_gpu=on_gpu)
    if note:
        _progress(note)
    sweep = _sweeps(hiddens, device, gen, backend, timer, repeats, bandwidth)
    result["sweep"] = {"repeats": repeats, "note": note, **sweep}
    result["bit_identical"] = (
        result["bit_identical"]
        and all(u["bit_identical"] for u in sweep["pack_cast"])
        and all(u["bit_identical"] for u in sweep["accumulate_"])
    )
    result["targets"] = _targets(sweep, backend, bandwidth)
    print(format_table(result))
    return result


def _sweep_table(units: list[dict], base: str, bandwidth: bool) -> list[str]:
    header = ["elements", "MB moved", "way", "ms", "GB/s", f"time / {base}"]
    if bandwidth:
        header.append("% of copy BW")
    cells = []
    for u in units:
        first = True
        for name, m in u["methods"].items():
            row = [
                f"{u['elements'] / 1e6:.2f}M" if first else "",
                f"{u['bytes_moved'] / 1e6:.1f}" if first else "",
                name,
                f"{m['median_ms']:.4f}",
                f"{m['gb_per_s']:.1f}",
                f"{m[f'time_vs_{base}']:.2f}",
            ]
            if bandwidth:
                row.append(f"{100 * m['fraction_of_copy_bandwidth']:.1f}")
            cells.append(row)
            first = False
    return table(header, cells)


def format_table(result: dict) -> str:
    unit = result["unit"]
    lines = [
        f"pack_cast benchmark on {result['device']} (backend {result['backend']}): one block, "
        f"hidden {unit['hidden']}, {unit['tensors']} tensors, {unit['elements'] / 1e6:.1f}M elements, "
        f"fp32 -> bf16, {unit['bytes_moved'] / 1e6:.0f} MB moved; median of {result['repeats']}",
        f"{'way':<12}{'ms':>10}{'GB/s':>10}{'time / pack_cast':>18}",
    ]
    for name, m in result["methods"].items():
        lines.append(
            f"{name:<12}{m['median_ms']:>10.3f}{m['gb_per_s']:>10.1f}{m['time_vs_pack_cast']:>18.2f}"
        )
    if result["copy_bandwidth_gb_per_s"] is not None:
        lines.append(
            f"copy bandwidth {result['copy_bandwidth_gb_per_s']:.0f} GB/s; pack_cast reaches "
            f"{100 * result['pack_cast_fraction_of_bandwidth']:.1f}% of it in "
            f"{result['pack_cast_kernels_per_call']} kernel launch(es) per call "
            f"(accumulate_: {result['accumulate_kernels_per_call']})"
        )
    sweep = result["sweep"]
    has_bw = result["copy_bandwidth_gb_per_s"] is not None
    lines += [
        "",
        f"size sweep, fp32 -> bf16 into a gather slot (median of {sweep['repeats']}; "
        "copy: one device copy of the same bytes):",
        *_sweep_table(sweep["pack_cast"], "pack_cast", has_bw),
        "",
        "accumulate_ sweep, fp32 += bf16 (bytes: fp32 read and written, bf16 read):",
        *_sweep_table(sweep["accumulate_"], "accumulate_", has_bw),
    ]
    if sweep["note"]:
        lines.append(sweep["note"])
    fixed = sweep["fixed_cost"]
    host = ", ".join(f"{name} {us:.1f}" for name, us in fixed["host_us_per_call"].items())
    lines += [
        "",
        f"fixed cost per call, smallest unit ({fixed['elements'] / 1e6:.2f}M elements): pack_cast "
        f"{fixed['pack_cast_ms']:.4f} ms, accumulate_ {fixed['accumulate_ms']:.4f} ms; host us per call "
        f"(no synchronisation, median): {host}",
        "outputs bit-identical (the block, and every sweep size): " + str(result["bit_identical"]),
        "",
        GOALS,
        *(goal_line(t) for t in result["targets"]),
    ]
    return "\n".join(lines)
