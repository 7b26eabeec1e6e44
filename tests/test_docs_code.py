"""The python blocks of README.md and docs/guide/*.md run, or are cut from a file that does.

A user pastes what the README shows. A ```python block is one of:

- complete: run as it is, in a fresh interpreter (one per page), each block in a namespace of
  its own;
- ``# continued`` on its first line: run in the namespace of the block before it on the page;
- ``# cut from PATH`` on its first line: a piece of a runnable file of the clone (an example,
  which tests/test_examples.py runs); each of its lines must be in that file, in order;
- ``# fragment: WHY`` on its first line (guides only, never the README): a part of a program the
  page describes that cannot run here (several ranks, a GPU, a Trainer's data), not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs" / "guide").glob("*.md"))

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# Runs each block; a failure names the page and line and shows the traceback.
_DRIVER = r"""
import json, sys, traceback, types
page, blocks = json.load(sys.stdin)
OPTIONAL = {"transformers", "peft", "matplotlib", "triton", "torchtitan"}  # extras: skipped if absent
ns, failed, skipped = None, [], False
for line, kind, code in blocks:
    if kind == "continued" and skipped:
        continue
    skipped = False
    if kind != "continued" or ns is None:
        # a fresh __main__, as a pasted script gets (dynamo's guards look globals up through it)
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        ns = main.__dict__
    try:
        exec(compile(code, f"{page}:{line}", "exec"), ns)
    except BaseException as e:
        if isinstance(e, ModuleNotFoundError) and e.name in OPTIONAL:
            skipped = True
            print(f"{page}: the block at line {line} needs {e.name}, not installed: skipped")
            continue
        failed.append(line)
        print(f"--- {page}: the block at line {line} failed", file=sys.stderr)
        traceback.print_exc()
print("blocks failed:", failed)
sys.exit(1 if failed else 0)
"""


def blocks(page: Path) -> list[tuple[int, str, str]]:
    """``(line, kind, code)`` of every python block of ``page``; kind is ``complete``,
    ``continued``, ``cut`` or ``fragment``."""
    text = page.read_text()
    found = []
    for m in _BLOCK.finditer(text):
        code = m.group(1)
        first = code.split("\n", 1)[0].strip()
        kind = "complete"
        for prefix, name in (
            ("# continued", "continued"),
            ("# cut from ", "cut"),
            ("# fragment", "fragment"),
        ):
            if first.startswith(prefix):
                kind = name
        found.append((text[: m.start()].count("\n") + 2, kind, code))
    return found


def run_page(page: Path, tmp_path, timeout: float) -> subprocess.CompletedProcess:
    runnable = [b for b in blocks(page) if b[1] in ("complete", "continued")]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    )
    env["MPLBACKEND"] = "Agg"  # a plot is drawn, never shown
    return subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps([page.name, runnable]),
        capture_output=True,
        text=True,
        cwd=tmp_path,  # what a block writes (a checkpoint, a plot) lands in the test's directory
        env=env,
        timeout=timeout,
    )


def test_the_readme_has_no_fragment_a_user_cannot_run():
    """A snippet with an undefined ``Block`` or ``model`` cannot be pasted and run: the README's
    blocks are complete, or say which runnable file of the clone they are cut from."""
    kinds = {kind for _, kind, _ in blocks(README)}
    assert kinds <= {"complete", "continued", "cut"}, kinds
    assert "complete" in kinds


@pytest.mark.parametrize("page", [README, *GUIDES], ids=lambda p: p.name)
def test_every_cut_block_is_in_the_file_it_names_in_order(page):
    """A snippet cut from an example stays what the example runs: each of its lines, stripped,
    is in the file, after the line the one before it matched."""
    for line, kind, code in blocks(page):
        if kind != "cut":
            continue
        first, rest = code.split("\n", 1)
        source = ROOT / first.strip().removeprefix("# cut from ").split()[0]
        assert source.is_file(), f"{page.name}:{line} is cut from {source}, which does not exist"
        lines = source.read_text().splitlines()
        at = 0
        for wanted in (w.strip() for w in rest.splitlines()):
            if not wanted or wanted == "...":
                continue
            while at < len(lines) and wanted not in lines[at]:
                at += 1
            assert at < len(lines), f"{page.name}:{line}: {wanted!r} is not in {source.name} (in order)"
            at += 1


@pytest.mark.slow  # a transformers model and a compile: 8 to 25 s on 2 cores
def test_every_python_block_of_the_readme_runs(tmp_path):
    """The README's complete blocks run as a user would paste them."""
    done = run_page(README, tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow  # compiles, trains, plans: a minute or more on 2 cores
@pytest.mark.parametrize(
    "page",
    [g for g in GUIDES if any(k in ("complete", "continued") for _, k, _ in blocks(g))],
    ids=lambda p: p.name,
)
def test_every_python_block_of_each_guide_runs(page, tmp_path):
    """A guide's code is working code: its complete and continued blocks run in order."""
    done = run_page(page, tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
