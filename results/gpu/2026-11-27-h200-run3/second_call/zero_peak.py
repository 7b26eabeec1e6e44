"""Where tracedac.zero fp32's peak over a step goes above FSDP2's on one CUDA rank (NCCL):
per phase (forward, backward, optimizer step, zero_grad) the allocated bytes at its end and
its peak, each variant alone on the device; then a memory snapshot of one tracedac step and
the allocations alive at its peak, grouped by the innermost project/torch frame."""

import collections
import gc
import os
import pickle
import sys
import tempfile

import torch

sys.path.insert(0, os.getcwd())
from benchmarks import zero as z
from benchmarks import zero_variants as zv
from benchmarks.model import GPT, Config

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
out = os.environ.get("OUT", "/tmp")
cuda = dev.type == "cuda"
cfg = (
    Config(layers=2, dim=1024, heads=16, experts=8, expert_hidden=2048, seq=512, batch=8)
    if cuda
    else Config(layers=2, dim=64, heads=4, experts=4, expert_hidden=128, seq=32, batch=2)
)
z.init("file://" + tempfile.mktemp(), device=dev, rank=0, world=1)
if cuda:
    dev = torch.device("cuda", torch.cuda.current_device())
MiB = 2**20


def alloc():
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return 0


def phases(tr, batch, label):
    rows = []

    def phase(name, f):
        gc.collect()
        before = alloc()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        r = f()
        after = alloc()
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        rows.append((name, before / MiB, after / MiB, peak / MiB, (peak - before) / MiB))
        return r

    torch.manual_seed(0)
    loss = phase("forward", lambda: tr.forward(*batch))
    phase("backward", lambda: loss.backward())
    phase("optimizer step", lambda: tr.optimizer.step())
    phase("zero_grad", lambda: tr.optimizer.zero_grad(set_to_none=True))
    print(f"\n{label}: phase, allocated before / after / peak (MiB), peak over before")
    for r in rows:
        print(f"  {r[0]:15s} {r[1]:9.1f} {r[2]:9.1f} {r[3]:9.1f} {r[4]:+9.1f}")


def report(snap, label):
    trace = snap["device_traces"][dev.index]
    live, cur, best, at_peak = {}, 0, -1, None
    for e in trace:
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif a == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if cur > best:
            best, at_peak = cur, dict(live)

    def where(e):
        fr = [
            f
            for f in e.get("frames", [])
            if any(k in f["filename"] for k in ("tracedac", "benchmarks", "fsdp", "optim", "autograd"))
        ]
        named = (f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in fr[:3])
        return " < ".join(named) or "?"

    groups = collections.Counter()
    for e in at_peak.values():
        groups[where(e)] += e["size"]
    print(f"  {label}: peak of the step's own allocations {best / MiB:.1f} MiB; alive there by place:")
    for w, b in groups.most_common(14):
        print(f"    {b / MiB:8.1f} MiB  {w}")


base = GPT.seeded(cfg).to(dev)
batch = z._rank_batch(cfg, 0, 1, dev)
for key in ("fsdp2_fp32", "tracedac_fp32"):
    v = next(v for v in zv.ZERO_VARIANTS if v.key == key)
    tr = v.build(base, cfg.batch)
    for _ in range(2):
        z._step(tr, batch, 0)
    phases(tr, batch, v.label)
    phases(tr, batch, v.label + " (again)")
    if cuda:
        gc.collect()
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        z._step(tr, batch, 0)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        pickle.dump(snap, open(f"{out}/snapshot_{key}.pickle", "wb"))
        try:
            report(snap, v.label)
        except Exception as e:
            print("  snapshot analysis failed:", type(e).__name__, e)
    del tr
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
z.finish()
