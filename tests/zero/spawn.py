"""Run a function on N ranks of a real gloo process group, with a hard timeout.

``run_ranks(fn, world, *args)`` starts ``world`` processes, each initializing gloo through a
file in a fresh temporary directory (no ports), calls ``fn(rank, world, *args)`` and
returns the list of what each returned. A child's exception is re-raised in the parent
with its traceback; a run past ``timeout`` kills every child and fails, so no test can hang.
``start_ranks`` returns at once, so that a test can wait for two groups running together.

The ranks are forked from multiprocessing's fork server, which imports torch, tracedac and
dynamo once for the session: a spawned interpreter spent some 3.5 s of CPU importing them,
for each of the suite's ~60 ranks. The server has only imported (no thread pool, process
group or compile has run in it), so a rank starts as a spawned one would; it is handed this
process's environment of the moment (the server's own is the one it started with).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback

import torch.multiprocessing as mp

# What the fork server imports, so that no rank does: torch with gloo, tracedac.zero, and
# dynamo with inductor's decompositions (aot_eager_decomp_partition), for the compiled tests.
# A test's own worker module (small) is imported by its ranks.
PRELOAD = [
    "torch",
    "torch.distributed",
    "tracedac",
    "tracedac.zero",
    "torch._dynamo",
    "torch._inductor.compile_fx",
]


def _entry(rank, fn, world, tmp, args, environ):
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the parent's environment now (e.g. a test's TORCH_FR_BUFFER_SIZE)
    os.environ.update(environ)
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
    # Out at once, the result written: no destroy_process_group and no interpreter teardown.
    # Under torch 2.15 a rank was seen aborting at the end of a finished run (heap corruption
    # reported by glibc), as the benchmarks' ranks did (``benchmarks.child.leave_ranks``).
    os._exit(0)


class Ranks:
    """``world`` ranks running ``fn`` (``start_ranks``); ``results()`` waits for them."""

    def __init__(self, fn, world: int, args: tuple, timeout: float, env: dict | None):
        self.fn, self.world, self.timeout = fn, world, timeout
        self._tmp = tempfile.TemporaryDirectory()
        self._results = None
        mp.set_forkserver_preload(PRELOAD)  # read when the server starts: at the first run
        self._ctx = mp.start_processes(
            _entry,
            args=(fn, world, self._tmp.name, args, {**os.environ, **(env or {})}),
            nprocs=world,
            join=False,
            start_method="forkserver",
        )
        self._deadline = time.monotonic() + timeout

    def results(self) -> list:
        """What each rank returned; a rank's exception, or the deadline passed, fails here."""
        if self._results is None:
            try:
                self._results = self._wait()
            finally:
                self.close()
        errors = [f"rank {r}:\n{v}" for r, (kind, v) in enumerate(self._results) if kind == "error"]
        if errors:
            raise AssertionError(f"{self.fn.__name__} failed on {self.world} ranks:\n" + "\n".join(errors))
        return [v for _, v in self._results]

    def until_one_dies(self) -> list:
        """Wait until a rank's process ends without a result (killed, as a job whose rank dies
        is), then kill the others, as torchrun does; their exit codes (None: killed here)."""
        while True:
            codes = [p.exitcode for p in self._ctx.processes]
            dead = [
                r
                for r, c in enumerate(codes)
                if c is not None and not os.path.exists(os.path.join(self._tmp.name, f"result{r}.pkl"))
            ]
            if dead:
                break
            if all(c is not None for c in codes):
                raise AssertionError(f"{self.fn.__name__}: every rank finished; none died")
            if time.monotonic() > self._deadline:
                self.close()
                raise TimeoutError(
                    f"{self.fn.__name__} on {self.world} ranks: no rank died in {self.timeout} s"
                )
            time.sleep(0.05)
        self.close()
        return codes

    def close(self) -> None:
        """Kill the ranks still running (a test that stopped waiting for them) and remove
        the rendezvous directory."""
        for p in self._ctx.processes:
            if p.is_alive():
                p.kill()
        self._tmp.cleanup()

    def _wait(self) -> list:
        while not self._ctx.join(timeout=max(0.1, min(1.0, self._deadline - time.monotonic()))):
            if time.monotonic() > self._deadline:
                what = f"{self.fn.__name__} on {self.world} ranks"
                raise TimeoutError(f"{what} ran past {self.timeout} s; killed")
        results = []
        for rank in range(self.world):
            path = os.path.join(self._tmp.name, f"result{rank}.pkl")
            if not os.path.exists(path):
                results.append(("missing", None))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results


def start_ranks(fn, world: int, *args, timeout: float = 90.0, env: dict | None = None) -> Ranks:
    """Start ``fn`` on ``world`` ranks and return at once (the ``timeout`` counts from now):
    a test can start two groups and wait for both. ``env``: variables the ranks see beside
    this process's environment."""
    return Ranks(fn, world, args, timeout, env)


def run_ranks(fn, world: int, *args, timeout: float = 90.0, env: dict | None = None) -> list:
    return start_ranks(fn, world, *args, timeout=timeout, env=env).results()


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
