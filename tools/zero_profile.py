"""Where a compiled tracedac.zero bf16 "auto" step spends its time against FSDP2 compiled under
the same autocast, on one rank: GPU run 4 measured 34 against 28 ms (results/history/gpu.md), while on the
CPU at one rank the two cost the same host time, so the difference is the GPU's to show.

    python tools/zero_profile.py                   # on a GPU (NCCL, one rank): the bench's size
    python tools/zero_profile.py --device cpu --tiny   # a dry run (gloo, a tiny model)

Prints each trainer's median step (wall, and host time until the step returns), then for the
two bf16 trainers torch.profiler's ops by self device (or CPU) time, the GPU's kernel time per
step against the wall, and the calls that make the host wait for the device or copy to it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
from benchmarks import zero_variants as zv  # noqa: E402
from benchmarks.model import GPT, Config, make_batch  # noqa: E402

BENCH = dict(vocab=2048, layers=2, dim=1024, heads=16, experts=8, expert_hidden=2048, batch=8, seq=512)
TINY = dict(vocab=64, layers=2, dim=32, heads=2, experts=8, expert_hidden=64, batch=2, seq=16)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    init = f"file://{tempfile.mkdtemp()}/init"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    cfg = Config(**(TINY if args.tiny else BENCH), dropout=0.0, capacity=1.25)
    batch = tuple(t.to(device) for t in make_batch(cfg))
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def build(make, bf16):
        torch.manual_seed(0)
        return make(GPT(cfg).to(device), bf16, cfg.batch)

    trainers = {
        "tracedac compiled bf16 auto": build(zv._tracedac_compiled, True),
        "FSDP2 compiled bf16 autocast": build(zv._fsdp2_compiled_autocast, True),
        "tracedac compiled fp32": build(zv._tracedac_compiled, False),
        "FSDP2 compiled fp32": build(zv._fsdp2_compiled, False),
    }

    def step(trainer):
        trainer.finish(trainer.forward(*batch))

    for trainer in trainers.values():
        for _ in range(3):
            step(trainer)
    wall, host = {n: [] for n in trainers}, {n: [] for n in trainers}
    for _ in range(args.steps):  # in turns
        for name, trainer in trainers.items():
            sync()
            start = time.perf_counter()
            step(trainer)
            returned = time.perf_counter()
            sync()
            wall[name].append(time.perf_counter() - start)
            host[name].append(returned - start)
    for name in trainers:
        w, h = sorted(wall[name]), sorted(host[name])
        print(f"{name:30s} step {w[len(w) // 2] * 1e3:8.2f} ms, host {h[len(h) // 2] * 1e3:8.2f} ms")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name in ("tracedac compiled bf16 auto", "FSDP2 compiled bf16 autocast"):
        sync()
        with profile(activities=activities) as prof:
            for _ in range(3):
                step(trainers[name])
            sync()
        ops = prof.key_averages()
        print(f"\n===== {name}, 3 steps")
        print(ops.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25))
        if cuda:
            on_gpu = torch.autograd.DeviceType.CUDA
            busy = sum(e.self_device_time_total for e in ops if e.device_type == on_gpu)
            print(f"GPU kernel time a step: {busy / 3 / 1e3:.2f} ms")
            print("by self CPU time:")
            print(ops.table(sort_by="self_cpu_time_total", row_limit=15))
        print("waits and copies a step:", {e.key: e.count // 3 for e in ops if e.key.startswith(WAITS)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
