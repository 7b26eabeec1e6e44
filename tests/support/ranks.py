"""Run a function on N ranks of a real gloo process group, with a hard timeout, and check what
each rank computes where it computes it.

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

Checks. A rank function asserts on what it computed, where it computed it, as torch's
``MultiProcessTestCase`` does: a failure's traceback points at the line with the wrong value.
Starting ranks costs seconds, so one spawn runs several rank functions (``run_parts``:
``[(fn, *args)]``, each a part) and each test reports the checks it is about:

- in a rank function, ``with check("name"):`` around the asserts of one check records whether
  they held or the failure's traceback, and the function goes on to its next check. Put a
  check's asserts after the collectives it needs, so that a failing rank stays in step with
  the others. A part is a check too, under its function's name;
- in the test, ``ranks.passed("name")`` fails with the traceback of every rank where the
  check failed, was never made, or whose part raised outside its checks;
- ``together(fn, ...)`` runs a step that may fail on some ranks only and tells every rank, so
  that the ranks stay in step for the collectives after it.

The test process gets the outcomes, not the values, which are asserted where they are
computed; a test that checks a rank's value beside what its own process computes (a
checkpoint the ranks saved, loaded here on one rank) reads it with ``Checks.values``.
(Spawned ranks import the rank function's module without pytest's assertion rewriting: an
``assert`` says what it compared through its message.)
"""

from __future__ import annotations

import contextlib
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

    def checks(self) -> Checks:
        """The checks of ranks started by ``start_parts`` (waits for them)."""
        return Checks(self.results(), self.world)

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


# --- checks ----------------------------------------------------------------------------------

_RUNNING: dict | None = None  # in a rank under ``run_parts``: check name -> (part, traceback or None)
_PART: str | None = None  # the part running


@contextlib.contextmanager
def check(name: str):
    """The asserts of check ``name``: under ``run_parts`` an exception in the block is recorded
    with its traceback and the rank function goes on; anywhere else it propagates."""
    outcomes = _RUNNING
    if outcomes is None:
        yield
        return
    if name in outcomes:
        raise ValueError(f"check {name!r} is made twice in one spawn: give each check its own name")
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # noqa: BLE001 (recorded, pytest's outcomes too: the check's test fails with it)
        outcomes[name] = (_PART, traceback.format_exc())
    else:
        outcomes[name] = (_PART, None)


def message_of(error: type[BaseException], fn, *args, **kwargs) -> str:
    """The message of the ``error`` that ``fn(*args, **kwargs)`` raises; an AssertionError
    (a failed check) if it raises none."""
    try:
        fn(*args, **kwargs)
    except error as e:
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised no {error.__name__}")


def together(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on every rank, then one all-reduce of which ranks raised: a rank
    that raised raises its own error, the others an AssertionError naming it. What a check wraps
    around a step that may fail on some ranks only (a load that crashes where a rank's rows do
    not fit), so that no rank goes on to a collective the others skip (gloo would wait for it
    until its timeout, or abort the process on mismatched sizes)."""
    import torch
    import torch.distributed as dist

    error = None
    try:
        out = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (raised again below, once every rank knows)
        error = e
    failed = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    failed[dist.get_rank()] = error is not None
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if failed.any():
        ranks = failed.nonzero().flatten().tolist()
        raise AssertionError(
            f"{getattr(fn, '__name__', fn)} raised on rank(s) {ranks} (their checks say why)"
        )
    return out


def run_parts_here(rank: int, world: int, parts: list) -> tuple[dict, dict]:
    """Run each ``(fn, *args)`` of ``parts`` in turn: (check name -> (part, traceback or None),
    part -> what it returned). A part is named for its function (one run twice with other
    arguments is one part: an error in either run fails it). What ``run_parts`` spawns; called
    as it is in a process that has its own process group (a world of one)."""
    global _RUNNING, _PART
    outcomes, values = {}, {}
    for fn, *args in parts:
        name = fn.__name__
        _RUNNING, _PART = outcomes, name
        try:
            values[name] = fn(rank, world, *args)
            error = None
        except Exception:  # noqa: BLE001 (recorded per part; the others still run)
            error = traceback.format_exc()
        finally:
            _RUNNING = _PART = None
        if name in outcomes:  # the function ran before, with other arguments: its first error stands
            error = outcomes[name][1] or error
        outcomes[name] = (name, error)
    return outcomes, values


class Checks:
    """The outcome of every check each rank of a ``run_parts`` made."""

    def __init__(self, results: list, world: int | None = None):
        self.results = results  # per rank: (outcomes, values) of run_parts_here
        self.world = len(results) if world is None else world

    def passed(self, *names: str) -> None:
        """Fail the test unless every rank made each check of ``names``, it held, and its
        part raised nothing outside its checks."""
        import pytest

        failures = []
        for name in names:
            for rank, (outcomes, _) in enumerate(self.results):
                where = f"rank {rank} of {self.world}"
                if name not in outcomes:
                    raised = [f"\npart {k} raised:\n{e}" for k, (p, e) in outcomes.items() if k == p and e]
                    failures.append(f"check {name!r} was never made on {where}" + "".join(raised))
                    continue
                part, error = outcomes[name]
                if error is not None:
                    failures.append(f"check {name!r} failed on {where}:\n{error}")
                elif outcomes[part][1] is not None:
                    failures.append(
                        f"check {name!r}: its part {part} failed on {where}:\n{outcomes[part][1]}"
                    )
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)

    def values(self, part: str) -> list:
        """What ``part`` returned on each rank (after ``passed(part)``), for a test that
        checks them beside what this process computes."""
        self.passed(part)
        return [values[part] for _, values in self.results]


def start_parts(world: int, parts: list, *, timeout: float = 90.0, env: dict | None = None) -> Ranks:
    """``start_ranks`` of ``run_parts_here``: ``.checks()`` waits for the outcomes."""
    return start_ranks(run_parts_here, world, parts, timeout=timeout, env=env)


def run_parts(world: int, parts: list, *, timeout: float = 90.0, env: dict | None = None) -> Checks:
    """Run ``parts`` (``[(fn, *args)]``) on ``world`` ranks of one spawn; their checks."""
    return start_parts(world, parts, timeout=timeout, env=env).checks()
