"""What a warm forward's time above an empty dispatch mode is made of (issue 46), measured.

The tiny Llama of ``python -m benchmarks --profile --llama --quick`` (8 layers, hidden 32),
one intra-op thread, the forward alone, median thread time of ``REPS`` taken in turns. Beside
the floors (plain, an empty ``TorchDispatchMode``, the same with trivial pack hooks, the least
recorder), tracedac's warm forward with parts of its work taken out, each a patch of
``WarmMode`` for the run (wrong results, right timings):

- *regions, modes and hooks only*: the region (made, entered, left), its mode running each op
  and nothing else, a pack hook that only counts: what any region pays before it checks.
- *warm, no handles*: the checks of every op, but a pack makes no handle.
- *warm*: as it runs.

Run from the clone's root: ``python tools/warm_floor.py``. Not a benchmark mode: it patches
tracedac's internals.
"""

from __future__ import annotations

import copy
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tracedac  # noqa: E402
from benchmarks.floors import under_empty_mode, under_least_recorder  # noqa: E402
from benchmarks.llama import DecoderLayer, Llama, LlamaConfig  # noqa: E402
from benchmarks.model import make_batch  # noqa: E402
from benchmarks.profile import _each_block  # noqa: E402
from tracedac.record import warm as W  # noqa: E402

REPS = 15


class _Handle:
    pass


def _count_pack(self, t):
    self.i += 1
    return _Handle()


def _run_op(self, func, types, args=(), kwargs=None):
    return func._op(*args, **(kwargs or {}))


def _no_handle(self, e, t):
    for v in e.drop:
        self.vals[v] = None
    return _Handle()


def _pack_no_handle(self, t):
    i = self.i
    e = self.events[i]
    if e.__class__ is not W.PackEvent or e.vid < 0 or t is not self.vals[e.vid]:
        return self._pack_slow(t)
    self.i = i + 1
    return _no_handle(self, e, t)


def _finish_nothing(self, region):
    region.kept = []
    self.close()
    return True


def _empty_hooks(block, x):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: _Handle(), lambda h: h):
        return under_empty_mode(block, x)


def main() -> None:
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab=64, layers=8, dim=32, heads=2, mlp_hidden=64, batch=2, seq=16)
    base, batch = Llama.seeded(cfg), make_batch(cfg)
    floors = {
        "plain": lambda m, unit: None,
        "empty mode": _each_block(under_empty_mode),
        "empty mode, trivial pack hooks": _each_block(_empty_hooks),
        "least recorder": _each_block(under_least_recorder),
    }
    patched = {
        "regions, modes and hooks only": {
            "__torch_dispatch__": _run_op,
            "pack": _count_pack,
            "finish": _finish_nothing,
        },
        "warm, no handles": {"pack": _pack_no_handle, "finish": _finish_nothing},
        "warm": {},
    }
    models = {}
    for key, apply in floors.items():
        models[key] = copy.deepcopy(base)
        apply(models[key], DecoderLayer)
    warm_model = tracedac.wrap(copy.deepcopy(base), DecoderLayer)
    for _ in range(3):
        warm_model(*batch)
    original = {name: getattr(W.WarmMode, name) for name in ("__torch_dispatch__", "pack", "finish")}

    def forward(key):
        if key in models:
            return models[key](*batch)
        for name, f in patched[key].items():
            setattr(W.WarmMode, name, f)
        try:
            return warm_model(*batch)
        finally:
            for name, f in original.items():
                setattr(W.WarmMode, name, f)

    keys = [*floors, *patched]
    for key in keys:
        for _ in range(2):
            forward(key)
    times = {k: [] for k in keys}
    load = os.getloadavg()[0]
    for rep in range(REPS):
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            gc.collect()
            start = time.thread_time()
            loss = forward(key)
            times[key].append(time.thread_time() - start)
            del loss
    empty = statistics.median(times["empty mode"])
    after = os.getloadavg()[0]
    print(f"thread ms of the forward, median of {REPS} in turns (load average {load:.1f} -> {after:.1f})")
    print("| forward | thread ms | over the empty mode |")
    print("|---|---|---|")
    for key in keys:
        t = statistics.median(times[key])
        print(f"| {key} | {t * 1e3:.2f} | {(t - empty) * 1e3:+.2f} ms ({t / empty:.2f}x) |")


if __name__ == "__main__":
    main()
