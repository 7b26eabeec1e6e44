"""Start a benchmark's ranks as processes, joined by a file rendezvous in a temporary directory.

``launch(entry, spec, world, ...)`` runs ``entry.rank_main(json.dumps(spec))`` in ``world``
interpreters (``RANK`` and ``WORLD_SIZE`` in their environment, the rendezvous added to
``spec`` as ``init_method``), shows rank 0's progress lines (stderr lines starting with
``[rank 0]``) and returns the JSON rank 0 printed. A rank that fails, or a launch past its
timeout, stops every rank and raises with the failing rank's output. ``serve`` is a rank's
side: the process group, the phases the spec names, rank 0's JSON.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from . import probe
from .child import ROOT, leave_ranks

__all__ = ["launch", "serve"]


def serve(spec_json: str, make_config, checks, timing, timeout: float) -> None:
    """A rank's entry point (``rank_main``, which ``launch`` starts): join the process group
    (NCCL, one GPU per rank, where ``spec["device"]`` is CUDA; else gloo), then run the phases
    ``spec["phases"]`` names, in order: ``checks(cfg, rank, world, say)``, then
    ``timing(cfg, rank, world, steps, say)`` (on the CPU with glibc keeping freed memory,
    ``probe.keep_freed_memory``); rank 0 prints every rank's ``{phase: figures}`` as JSON."""
    spec = json.loads(spec_json)
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = spec.get("device", "cpu").startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=spec["init_method"],
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        cfg = make_config(**spec["config"])
        # Imported by torch on its first checkpoint otherwise; it leaves millions of objects,
        # frozen here so that the gc.collect() before each reading and step skips them
        # (0.35 s -> ms each).
        from torch import _dynamo  # noqa: F401 (``import torch._dynamo`` would make ``torch`` local)

        gc.collect()
        gc.freeze()

        def say(message: str) -> None:
            if rank == 0:
                print(f"[rank 0] {message}", file=sys.stderr, flush=True)

        mine = {}
        if "checks" in spec["phases"]:
            mine["checks"] = checks(cfg, rank, world, say)
        if "timing" in spec["phases"]:
            if not cuda:
                probe.keep_freed_memory()
            mine["timing"] = timing(cfg, rank, world, spec["steps"], say)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            json.dump(everyone, sys.stdout)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_ranks()


def launch(entry: str, spec: dict, world: int, say, *, what: str, count_python: bool, timeout: float):
    """Run ``world`` ranks of module ``entry`` (``benchmarks.fsdp2``); rank 0's JSON.

    ``what``: the command, for messages (``--fsdp2``). ``count_python``: ranks run with
    ``PYTHONMALLOC=malloc`` and glibc's per-thread cache off, so the allocator probe counts
    Python objects too and reads the same forward alike (see ``child.run_child``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world))
    if count_python:
        tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.tcache_count=0") if t)
        env.update(PYTHONMALLOC="malloc", GLIBC_TUNABLES=tunables)
    source = f"import sys\nfrom {entry} import rank_main\nrank_main(sys.argv[1])\n"
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(spec, init_method=f"file://{tmp}/init")
        procs, outs, errs = [], [], []
        for rank in range(world):
            outs.append(open(os.path.join(tmp, f"rank{rank}.out"), "w+"))  # files: no pipe to fill
            errs.append(open(os.path.join(tmp, f"rank{rank}.err"), "w+"))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", source, json.dumps(spec)],
                    env=dict(env, RANK=str(rank)),
                    cwd=ROOT,  # benchmarks/ is not installed
                    stdout=outs[rank],
                    stderr=errs[rank],
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        shown, failed = 0, []
        try:
            while True:
                with open(errs[0].name) as f:  # rank 0's progress lines, as they come
                    lines = f.read().splitlines()
                for line in lines[shown:]:
                    if line.startswith("[rank 0]"):
                        say(line.removeprefix("[rank 0] "))
                shown = len(lines)
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or all(p.poll() == 0 for p in procs):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world} ranks of `{what}` ran past {timeout:.0f} s; stopped")
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for f in outs + errs:
                f.close()
        if failed:
            r = failed[0]
            with open(errs[r].name) as f:
                tail = "\n".join(f.read().splitlines()[-25:])
            raise RuntimeError(
                f"rank {r} of the `{what}` benchmark exited with status {procs[r].returncode}; its last "
                f"output:\n{tail}\nRun `python -m benchmarks {what} --quick` to check the set-up."
            )
        with open(outs[0].name) as f:
            return json.loads(f.read())
