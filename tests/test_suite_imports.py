"""The suite's own imports run one way: a test imports ``benchmarks`` only in tests/bench (the
benchmarks' tests), and nothing in ``benchmarks/`` or ``tracedac/`` imports ``tests``.

A test that borrowed a benchmark's model or probe changed when the benchmark did, and ran only
from a clone; what the tests share lives in tests/support/ (its ``__init__`` says what). Read
from the source (``ast``), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imported(path: Path) -> set[str]:
    """The top-level package of every module ``path`` imports (relative imports: its own)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _offenders(folder: str, package: str, skip: str | None = None) -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / folder).rglob("*.py")
        if (skip is None or skip not in p.relative_to(ROOT).parts) and package in _imported(p)
    )


def test_no_test_outside_tests_bench_imports_the_benchmarks():
    assert _offenders("tests", "benchmarks", skip="bench") == []


def test_neither_the_benchmarks_nor_the_library_import_the_tests():
    assert _offenders("benchmarks", "tests") == []
    assert _offenders("tracedac", "tests") == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """What the two tests above rely on: a lazy import is found, a relative one is not taken for
    a package of that name."""
    (tmp_path / "m.py").write_text(
        "from . import benchmarks\n\ndef f():\n    from benchmarks.probe import allocated_bytes\n"
    )
    assert _imported(tmp_path / "m.py") == {"benchmarks"}
    (tmp_path / "n.py").write_text("from .benchmarks import x\nimport os.path\n")
    assert _imported(tmp_path / "n.py") == {"os"}
