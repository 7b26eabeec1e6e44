"""``python -m benchmarks --kernels``: pack_cast against the casts it replaces.

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
"""

import statistics
import sys
import time

import torch

from tracedac.kernels import pack_cast

__all__ = ["run", "block_shapes"]

_GB = 1e9


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


def run(*, quick: bool = False) -> dict:
    """Time the three ways on one block's parameters; print a table and return the figures.

    ``quick`` uses a small block (hidden 256) and few repeats, for tests; the default is a
    hidden-2048 block (51M parameters, 206 MB of fp32), big enough to be bandwidth-bound.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    hidden, intermediate = (256, 704) if quick else (2048, 5632)
    repeats = 5 if quick else (50 if on_gpu else 10)
    backend = "triton" if on_gpu else "torch"
    timer = _time_cuda if on_gpu else _time_cpu

    shapes = block_shapes(hidden, intermediate)
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randn(shape, generator=gen).to(device) for shape in shapes]
    sizes = [s.numel() for s in srcs]
    numel = sum(sizes)
    # The unit's slot inside a larger all-gather buffer (another rank's slot on either side).
    gather = torch.empty(3 * numel, dtype=torch.bfloat16, device=device)
    dst = gather[numel : 2 * numel]
    flat = torch.empty(numel, dtype=torch.bfloat16, device=device)
    flat_views = list(torch.split(flat, sizes))

    def tracedac_pack():
        pack_cast(srcs, dst, backend=backend)

    def to_then_cat():
        dst.copy_(torch.cat([s.to(torch.bfloat16).view(-1) for s in srcs]))

    def fsdp2():
        torch._foreach_copy_(flat_views, [s.view(-1) for s in srcs])
        dst.copy_(flat)

    ways = [("pack_cast", tracedac_pack), ("to + cat", to_then_cat), ("FSDP2", fsdp2)]
    outputs = {}
    for name, fn in ways:
        fn()
        outputs[name] = dst.clone()
    reference = outputs["pack_cast"].view(torch.int16)
    bit_identical = all(torch.equal(o.view(torch.int16), reference) for o in outputs.values())

    moved = numel * (4 + 2)  # fp32 read + bf16 written
    methods = {}
    for i, (name, fn) in enumerate(ways, 1):
        _progress(f"[{i}/{len(ways)}] timing {name} ({repeats} runs, median)")
        seconds = timer(fn, repeats)
        methods[name] = {"median_ms": seconds * 1e3, "gb_per_s": moved / seconds / _GB}
    base = methods["pack_cast"]["median_ms"]
    for figures in methods.values():
        figures["time_vs_pack_cast"] = figures["median_ms"] / base

    result = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "backend": backend,
        "unit": {
            "hidden": hidden,
            "intermediate": intermediate,
            "tensors": len(srcs),
            "elements": numel,
            "src_dtype": "float32",
            "dst_dtype": "bfloat16",
            "bytes_moved": moved,
        },
        "repeats": repeats,
        "bit_identical": bit_identical,
        "methods": methods,
        "copy_bandwidth_gb_per_s": None,
        "pack_cast_fraction_of_bandwidth": None,
        "pack_cast_kernels_per_call": None,
    }
    if on_gpu:
        _progress("measuring copy bandwidth (1 GiB device-to-device copy)")
        bandwidth = _copy_bandwidth(device, repeats) / _GB
        result["copy_bandwidth_gb_per_s"] = bandwidth
        result["pack_cast_fraction_of_bandwidth"] = methods["pack_cast"]["gb_per_s"] / bandwidth
        _progress("counting kernel launches")
        result["pack_cast_kernels_per_call"] = _kernels_per_call(tracedac_pack)
    print(format_table(result))
    return result


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
    lines.append(f"outputs bit-identical: {result['bit_identical']}")
    if result["copy_bandwidth_gb_per_s"] is not None:
        lines.append(
            f"copy bandwidth {result['copy_bandwidth_gb_per_s']:.0f} GB/s; pack_cast reaches "
            f"{100 * result['pack_cast_fraction_of_bandwidth']:.1f}% of it in "
            f"{result['pack_cast_kernels_per_call']} kernel launch(es) per call"
        )
    return "\n".join(lines)
