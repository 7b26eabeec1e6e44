"""pack_cast's prepared launch calling the compiled kernel's launcher (the default since
2026-11-27, run 4) against Triton's runner (``kernel[grid](...)``) on every call, as before:
host us per call and back-to-back device-clock ms, Llama blocks of 0.53M to 51M elements,
fp32 -> bf16, bit-checked. (FSDP2's copy-in and the copy: ``python -m benchmarks --kernels``.)
Usage: python .gpu/launch_ab.py [cuda|cpu]"""

import os
import sys

sys.path.insert(0, os.getcwd())
import torch

from benchmarks import kernels as k
from tracedac.kernels import launch as launch_module
from tracedac.ops import cast as cast_module
from tracedac.ops import pack_cast

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
on_gpu = dev.type == "cuda"
timer = k._time_cuda if on_gpu else k._time_cpu
repeats = 200 if on_gpu else 3
bare_launcher = launch_module._bare_launcher
gen = torch.Generator().manual_seed(0)
print(f"device {torch.cuda.get_device_name() if on_gpu else 'cpu'}, torch {torch.__version__}")
print(f"{'elements':>9s} {'way':>18s} {'host us':>8s} {'ms':>8s}  bare launches")
for hidden in (208, 832, 1440, 2048) if on_gpu else (64,):
    srcs = [torch.randn(s, generator=gen).to(dev) for s in k.block_shapes(hidden, k.intermediate_for(hidden))]
    n = sum(s.numel() for s in srcs)
    dst = torch.empty(n, dtype=torch.bfloat16, device=dev)
    want = torch.cat([s.reshape(-1) for s in srcs]).to(torch.bfloat16).view(torch.int16)
    for way in ("compiled launcher", "Triton runner"):
        cast_module._pack_calls.clear()
        launch_module._bare_launcher = (
            bare_launcher if way == "compiled launcher" else (lambda *a, **kw: None)
        )
        fn = lambda: pack_cast(srcs, dst, backend="triton")  # noqa: E731
        fn()
        fn()
        assert torch.equal(dst.view(torch.int16), want), way
        host = k._host_time(fn, repeats, on_gpu) * 1e6
        ms = timer(fn, repeats) * 1e3
        bare = bool(next(iter(cast_module._pack_calls._entries.values())).launch.bare)
        print(f"{n / 1e6:8.2f}M {way:>18s} {host:8.1f} {ms:8.4f}  {bare}", flush=True)
launch_module._bare_launcher = bare_launcher
