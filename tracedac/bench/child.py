"""What the benchmarks share: measuring in a child interpreter, timing variants in turns, and
printing targets."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

__all__ = ["run_child", "target_lines", "time_in_turns"]


def run_child(source: str, spec: dict, say, what: str, retry: str) -> dict:
    """Run ``source`` (which reads ``spec`` from ``sys.argv[1]`` and prints JSON) in a fresh
    interpreter where every allocation goes through glibc (``PYTHONMALLOC=malloc``), so the
    allocator probe counts Python objects too, and glibc's per-thread cache of freed small
    chunks is off (``tcache_count=0``): ``mallinfo2`` counts a chunk parked there as in use,
    which made the same forward read tens of KiB apart from run to run. Lines it writes to stderr starting with ``[``
    are progress, passed to ``say``; a failure raises with the rest of its output, ``what``
    it was doing and the command (``retry``) that checks the set-up."""
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.tcache_count=0") if t)
    env = dict(os.environ, PYTHONMALLOC="malloc", GLIBC_TUNABLES=tunables)
    proc = subprocess.Popen([sys.executable, "-c", source, json.dumps(spec)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
        for key in order[rep % len(order):] + order[:rep % len(order)]:
            gc.collect()
            times[key].append(timed_step(key, rep))
        say(f"{what}: step {rep + 1}/{steps} done for {len(order)} variants")
    return times


def target_lines(result: dict) -> list[str]:
    """The targets of a benchmark's result, one PASS/FAIL line each, and the run's conditions."""
    out = []
    for target in result["targets"]:
        mark = "n/a " if target["passed"] is None else ("PASS" if target["passed"] else "FAIL")
        value = "-" if target["value"] is None else f"{target['value']:.3f}{target['unit']}"
        out.append(f"  {mark}  {target['name']}: {value} (target <= {target['limit']:.2f}{target['unit']})")
    out.append(f"\nwall time {result['wall_s']:.1f}s; load average {result['load_average_before']:.1f} "
               f"on {result['cpus']} CPUs before the run (other processes skew timings)")
    return out
