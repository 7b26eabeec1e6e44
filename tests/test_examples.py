"""The examples run as a user runs them, ``python examples/NAME.py`` from the clone's root, and
print what they promise.

The README's snippets are cut from these files (tests/test_docs_code.py checks that), so a
snippet a user copies is code that ran here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(name: str, timeout: float) -> str:
    """Run ``examples/name`` in a fresh interpreter from the clone's root; return its output."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    )
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_getting_started_example_trains_as_without_checkpointing_and_counts_each_token_once():
    """The first program a user runs shows the project's point: the same training as no
    checkpointing, and the router's side effect once where torch's checkpoint repeats it."""
    out = run_example("getting_started.py", timeout=300)
    reference = re.search(r"losses, no checkpoint: (.*)", out).group(1).split()
    losses = re.search(r"losses, tracedac: +(.*)", out).group(1).split()
    assert losses == reference and len(losses) == 3, out
    assert "parameters equal to no checkpointing: True" in out, out
    true, ours, torchs = map(
        int, re.search(r"true (\d+), tracedac (\d+), torch's checkpoint (\d+)", out).groups()
    )
    assert ours == true and torchs == 2 * true, out
    assert "save_matmuls() -> MUST_SAVE" in out, "the report says why each tensor is kept"
    assert re.search(r"memory_budget\(0\.3\): keeps \d+ bytes", out) and re.search(
        r"min_cut\(\): keeps", out
    ), out


@pytest.mark.slow  # two spawned ranks: 10 to 30 s on 2 cores
def test_the_expert_parallel_example_resumes_exactly_on_two_ranks():
    """Expert parallel with tracedac.zero, saved and resumed: a checkpoint holds one value per
    key, so experts named by global index come back as they were, and the steps after the
    resume are the uninterrupted run's to the bit."""
    out = run_example("expert_parallel.py", timeout=600)
    assert "experts on rank 0: ['0', '1']" in out, out
    losses = re.search(r"losses: (.*)", out).group(1).split()
    resumed = re.search(r"resumed after step 2: (.*)", out).group(1).split()
    assert len(losses) == 4 and resumed == losses[2:], out
    counts, true = re.search(r"tokens counted per block: \[(.*)\] \(true (\d+) each\)", out).groups()
    assert [int(c) for c in counts.split(",")] == [int(true)] * 2, out
    assert "resume exact on every rank: True" in out, out
