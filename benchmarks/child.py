"""What the benchmarks share: progress lines, a seeded step, measuring in a child interpreter,
timing variants in turns, and printing tables and targets."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

__all__ = [
    "Progress",
    "clear_grads",
    "conditions_line",
    "mark",
    "mib",
    "run_child",
    "seeded_step",
    "table",
    "goal_line",
    "leave_ranks",
    "target",
    "target_lines",
    "sanity",
    "unreliable",
    "time_in_turns",
]

# The checkout's root, where ``benchmarks`` is importable from (it is not installed): a child
# interpreter runs there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Progress:
    """One line per event on ``stream``, with the time since the run began."""

    def __init__(self, stream: TextIO | None):
        self.stream = stream
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.stream is not None:
            print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", file=self.stream, flush=True)


def clear_grads(model: torch.nn.Module) -> None:
    """Drop every parameter's gradient (``None``, not zeros: no bytes stay allocated)."""
    for p in model.parameters():
        p.grad = None


def seeded_step(model: torch.nn.Module, batch, seed: int) -> None:
    """Forward and backward of ``model(*batch)`` (which returns the loss) after
    ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    model(*batch).backward()


def leave_ranks(init_method: str | None = None) -> None:
    """End a benchmark rank whose figures are printed and written: past a barrier (no rank
    still talks to another), output flushed, then out, skipping ``destroy_process_group`` and
    the interpreter's teardown. A ``file://`` rendezvous is removed by rank 0 after the
    barrier: torch leaves it behind, and a second run given the same path fails to connect.

    Why: under torch 2.15 on gloo, CI's ``--zero --quick`` ranks aborted after printing
    "finished" ("terminate called without an active exception", twice in one run), and once
    a suite rank running the tensor-parallel benchmark died of "malloc(): unaligned tcache
    chunk detected"; some forty runs of those benchmarks alone did not reproduce either.
    Gloo's worker threads tearing down while the interpreter finalizes is a known way to get
    the first (pytorch/pytorch#179291). A run's exit status should say whether its figures
    are right, and by here they are out. Only on success: a failing rank raises as before.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        if init_method and init_method.startswith("file://") and dist.get_rank() == 0:
            Path(init_method[len("file://") :]).unlink(missing_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_child(source: str, spec: dict, say, what: str, retry: str) -> dict:
    """Run ``source`` (which reads ``spec`` from ``sys.argv[1]`` and prints JSON) in a fresh
    interpreter where every allocation goes through glibc (``PYTHONMALLOC=malloc``), so the
    allocator probe counts Python objects too, and glibc's per-thread cache of freed small
    chunks is off (``tcache_count=0``): ``mallinfo2`` counts a chunk parked there as in use,
    which made the same forward read tens of KiB apart from run to run. Lines it writes to
    stderr starting with ``[`` are progress, passed to ``say``; a failure raises with the rest
    of its output, ``what`` it was doing and the command (``retry``) that checks the set-up.
    It runs in the checkout's root (``ROOT``), so that it imports ``benchmarks`` whatever
    the caller's directory."""
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.tcache_count=0") if t)
    env = dict(os.environ, PYTHONMALLOC="malloc", GLIBC_TUNABLES=tunables)
    proc = subprocess.Popen(
        [sys.executable, "-c", source, json.dumps(spec)],
        env=env,
        text=True,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    errors = []
    for line in proc.stderr:  # progress lines; anything else is kept for an error message
        line = line.rstrip("\n")
        if line.startswith("["):
            say(line)
        else:
            errors.append(line)
    out = proc.stdout.read()
    if proc.wait() != 0:
        tail = "\n".join(errors[-20:])
        raise RuntimeError(
            f"the child interpreter that {what} exited with status {proc.returncode}; its last "
            f"output:\n{tail}\nRun `{retry}` to see whether the set-up itself works."
        )
    return json.loads(out)


def time_in_turns(keys, steps: int, timed_step, say, what: str = "timing") -> dict[str, list]:
    """Timings of ``steps`` steps of each key, taking turns: each round starts one key later,
    so a drift of the machine (a neighbour's load, frequency) falls on every key alike.
    ``timed_step(key, rep)`` runs one step and returns its seconds (or a tuple of them)."""
    times: dict[str, list] = {k: [] for k in keys}
    order = list(keys)
    for rep in range(steps):
        for key in order[rep % len(order) :] + order[: rep % len(order)]:
            gc.collect()
            times[key].append(timed_step(key, rep))
        say(f"{what}: step {rep + 1}/{steps} done for {len(order)} variants")
    return times


# At most this many untimed steps for tracedac's warm path to settle (``settle``).
SETTLE_LIMIT = 12


def learning() -> dict:
    """tracedac's warm-path counts that change only while it learns a model: templates built,
    calls fallen back from one, keys found unwarmable (a warm call's count grows every call)."""
    from tracedac.record import warm

    return {k: v for k, v in warm.stats().items() if k != "warm"}


def settle(step, keys, limit: int = SETTLE_LIMIT) -> int:
    """Untimed steps of ``keys`` (``step(key, i)`` runs one, ``i`` the round: a seed of its own,
    so routing changes as in the timed steps), a round at a time, until a round in
    which tracedac's warm path built no template and fell back from none; the rounds run (at
    most ``limit``). A region whose structure repeats runs warm from its second call; one whose
    structure follows its values (an MoE block: the routing sizes each expert's batch) logs a
    template and falls back from it for a few calls, then records in full for good
    (tracedac/record/template.py, ``MAX_MISSES``). Those first calls are a one-off cost of
    learning the model: timing them would put it into a median of a handful of steps."""
    rounds = 0
    while rounds < limit:
        before = learning()
        for key in keys:
            step(key, rounds)
        rounds += 1
        if learning() == before:
            break
    return rounds


def target(name: str, value: float | None, limit: float, unit: str = "x") -> dict:
    """A target met when ``value <= limit``; undecided (``passed`` None) without a finite value."""
    passed = None if value is None or not math.isfinite(value) else value <= limit
    return {"name": name, "value": value, "limit": limit, "unit": unit, "passed": passed}


def mib(n: float) -> str:
    """Bytes as MiB, two decimals."""
    return f"{n / 2**20:.2f} MiB"


def table(header: list[str], cells: list[list[str]]) -> list[str]:
    """``cells`` under ``header`` and a rule, the first column left-aligned, the others right."""
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]

    def line(c: list[str]) -> str:
        return "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths)))

    return [line(header), line(["-" * w for w in widths]), *(line(c) for c in cells)]


# Goals, not tests: a figure of one run on one machine (a loaded 2-core CPU misses what a
# quiet one meets). Printed as met/missed so that no line reads as a broken install.
GOALS = (
    "goals (what this run reached against the project's performance goals; "
    "a missed goal is a figure, not an error):"
)


def mark(passed: bool | None) -> str:
    """``met``, ``missed``, or ``n/a`` for a goal this run could not judge; all as wide."""
    return "n/a   " if passed is None else ("met   " if passed else "missed")


def goal_line(t: dict) -> str:
    """One goal: its verdict, name, value and limit."""
    value = "-" if t["value"] is None else f"{t['value']:.3f}{t['unit']}"
    return f"  {mark(t['passed'])}  {t['name']}: {value} (goal <= {t['limit']:.2f}{t['unit']})"


def conditions_line(result: dict) -> str:
    """The run's wall time and the load on the machine before it, after a blank line."""
    return (
        f"\nwall time {result['wall_s']:.1f}s; load average {result['load_average_before']:.1f} "
        f"on {result['cpus']} CPUs before the run (other processes skew timings)"
    )


# A run is judged only when the machine let it measure: the load before it below this many
# runnable processes per CPU, and no figure that more work cannot give (a variant doing more
# than its baseline measured faster by more than the noise below: ``sanity``).
LOADED = 0.5
NOISE = 0.95


def sanity(name: str, more: float | None, less: float | None) -> dict:
    """A check that ``more`` (seconds of a variant that does at least the work of ``less``'s)
    is not below ``less`` beyond the noise: else this run's timings cannot be trusted."""
    ratio = None if not more or not less else more / less
    return {"name": name, "ratio": ratio, "ok": ratio is None or ratio >= NOISE}


def unreliable(result: dict) -> list[str]:
    """Why this run's timings cannot score its goals (empty: they can)."""
    why = []
    load, cpus = result.get("load_average_before"), result.get("cpus") or 1
    if load is not None and load >= LOADED * cpus:
        why.append(f"load average {load:.1f} on {cpus} CPUs before the run (other processes ran)")
    for s in result.get("sanity", ()):
        if not s["ok"]:
            why.append(f"{s['name']}: {s['ratio']:.2f}x, below what more work can take ({NOISE:.2f}x)")
    return why


def target_lines(result: dict) -> list[str]:
    """The goals of a benchmark's result under their heading, one line each, and the run's
    conditions. A run whose timings cannot be trusted (``unreliable``) prints its figures and
    says why, instead of scoring them met or missed."""
    why = unreliable(result)
    if not why:
        return [GOALS, *(goal_line(t) for t in result["targets"]), conditions_line(result)]
    unscored = [{**t, "passed": None} for t in result["targets"]]
    return [
        "goals not scored: this run's timings are unreliable ("
        + "; ".join(why)
        + "). Run again on an idle machine; the figures:",
        *(goal_line(t).replace("n/a   ", "unsure", 1) for t in unscored),
        conditions_line(result),
    ]
