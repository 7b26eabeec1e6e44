"""Run a function on N ranks of a real gloo process group, with a hard timeout.

``run_ranks(fn, world, *args)`` spawns ``world`` processes, each initializing gloo through a
file in a fresh temporary directory (no ports), calls ``fn(rank, world, *args)`` and
returns the list of what each returned. A child's exception is re-raised in the parent
with its traceback; a run past ``timeout`` kills every child and fails, so no test can hang.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _entry(rank, fn, world, tmp, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = os.path.join(tmp, f"result{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/init",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        result = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(out, "wb") as f:
        pickle.dump(result, f)
    if result[0] == "ok":
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown (and gloo's on a failed group): the result is written


def run_ranks(fn, world: int, *args, timeout: float = 90.0) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _entry, args=(fn, world, tmp, args), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world} ranks ran past {timeout} s; killed")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world):
            path = os.path.join(tmp, f"result{rank}.pkl")
            if not os.path.exists(path):
                results.append(("missing", None))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    errors = [f"rank {r}:\n{v}" for r, (kind, v) in enumerate(results) if kind == "error"]
    if errors:
        raise AssertionError(f"{fn.__name__} failed on {world} ranks:\n" + "\n".join(errors))
    return [v for _, v in results]


def part(results: list, name: str, world: int | None = None) -> list:
    """Each rank's value of part ``name`` of a run of ``several``-style workers (each rank
    returns {name: ("ok", value) or ("error", traceback)}); a rank's error fails the test."""
    import pytest

    out = []
    for rank, parts in enumerate(results):
        kind, value = parts[name]
        if kind == "error":
            where = f"rank {rank}" if world is None else f"rank {rank} of {world}"
            pytest.fail(f"{name} failed on {where}:\n{value}")
        out.append(value)
    return out
