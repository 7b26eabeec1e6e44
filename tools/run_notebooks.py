"""Run the notebooks top to bottom in a fresh kernel and save them with their outputs.

    python tools/run_notebooks.py [NAME.ipynb ...]    # default: every notebook

The committed notebooks carry the outputs of this run, so a reader sees what each cell
shows without running it; ``tests/test_notebooks.py`` runs them again and checks it.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def run(path: pathlib.Path) -> float:
    nb = nbformat.read(path, as_version=4)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    )
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute(env=env)
    nbformat.write(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    for name in names:
        print(f"{name}: {run(NOTEBOOKS / name):.0f} s", flush=True)
