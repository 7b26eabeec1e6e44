"""The compile package's shape: the vocabulary a leaf, each pass on its own, the passes in
one ordered tuple, and inductor's cache key covering every pass file. (No import circle
anywhere, and imports one way: ``test_imports.py``.)"""

from __future__ import annotations

import os
import shutil

from .test_imports import EDGES


def test_the_vocabulary_is_a_leaf_of_compile_and_no_pass_imports_another():
    assert not {m for m in EDGES["tracedac.compile.vocab"] if m.startswith("tracedac.compile")}
    passes = {m for m in EDGES if m.startswith("tracedac.compile.passes.")}
    assert passes
    for p in passes:
        assert not EDGES[p] & passes, (p, EDGES[p] & passes)


def test_install_runs_the_passes_of_passes_in_their_order(monkeypatch):
    import torch

    import tracedac.compile.install as install
    from tracedac.compile import passes

    assert [name for _, name in passes.PASSES] == [
        "fuse_gather_casts",
        "tag_regions",
        "prefetch_gathers",
        "tag_gathers",
    ]
    on_disk = {f[:-3] for f in os.listdir(os.path.dirname(passes.__file__)) if f.endswith(".py")} - {
        "__init__"
    }
    assert {m.__name__.rpartition(".")[2] for m, _ in passes.PASSES} == on_disk  # every pass file runs
    ran = []
    for module, name in passes.PASSES:
        monkeypatch.setattr(module, name, lambda gm, name=name: ran.append(name) or gm)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    assert install._passes(gm) is gm and install._passes(gm) is gm  # the second run: marked done
    assert ran == [name for _, name in passes.PASSES]


def test_inductor_cache_key_covers_every_pass_file_and_the_vocabulary(tmp_path, monkeypatch):
    import tracedac.compile.install as install
    from tracedac.compile import passes, vocab

    here = os.path.dirname(passes.__file__)
    pass_files = {os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py")}
    hashed = set(install.sources())
    assert pass_files <= hashed and vocab.__file__ in hashed, pass_files - hashed

    # each file's content is in the key: over a copy of compile/, editing any pass changes it
    real = install.PASS.uuid()
    copy = tmp_path / "tracedac"
    shutil.copytree(install.ROOT, copy / "compile", ignore=shutil.ignore_patterns("__pycache__"))
    for f in install.DEPENDS:
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(os.path.dirname(install.ROOT), f), copy / f)
    monkeypatch.setattr(install, "ROOT", str(copy / "compile"))
    assert install.PASS.uuid() == real  # the copy hashes alike: the key is the contents
    edited = sorted((copy / "compile" / "passes").glob("*.py")) + [copy / "compile" / "vocab.py"]
    assert len(edited) == len(pass_files) + 1
    for path in edited:
        text = path.read_bytes()
        path.write_bytes(text + b"\n# edited\n")
        assert install.PASS.uuid() != real, path.name
        path.write_bytes(text)
    assert install.PASS.uuid() == real


def test_the_cache_key_hashes_every_module_the_passes_import():
    """A pass decides with what it imports (planners, decisions, the graph): an edit there must
    change the key too, or inductor serves a graph tagged by the old code. Read from the
    imports (tests/test_imports.py), not from a list kept by hand."""
    import tracedac.compile.install as install
    from tests.test_imports import EDGES, MODULES

    seen, stack = set(), [m for m in MODULES if m.startswith("tracedac.compile")]
    while stack:
        for d in EDGES[stack.pop()]:
            if d not in seen:
                seen.add(d)
                stack.append(d)
    needed = {str(MODULES[m]) for m in seen if not m.startswith("tracedac.compile")}
    hashed = {os.path.abspath(f) for f in install.sources()}
    assert needed <= hashed, sorted(needed - hashed)
