"""The library's imports run one way and close no circle (docs/design.md, "Layout").

Read from the source with ``ast``: every ``import`` and ``from ... import`` in a module,
at the top or inside a function (a lazy import that dodges a circle is still a circle).
Layers, bottom first: a module may import its own layer and the ones below, never above.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import tracedac

ROOT = pathlib.Path(tracedac.__file__).parent

# Bottom first. A name is a top-level module or package of tracedac.
LAYERS = (
    ("errors", "_compat", "kernels", "location", "naming", "copy_stats", "host_group", "wrapper_checks"),
    (
        "graph",
        "writes",
        "op_info",
        "decisions",
        "matching",
        "report",
        "offload",
        "subclasses",
        "link",
        "collectives",
    ),
    ("trace",),
    ("replay_compiled", "replay_plan", "replay"),
    ("min_cut", "offload_plan"),
    ("planners",),
    ("plan_cache", "wrappers"),
    ("collectives", "policies"),
    ("selective",),
    ("compile",),
    ("region",),
    ("checkpoint", "inspect", "tradeoff"),
    ("zero", "integrations"),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The tracedac modules ``name`` imports (a name imported from a package that is a
    module of its own counts as that module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # ``from pkg import sub`` imports the module ``pkg.sub``; ``from pkg import name``, ``pkg``
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("tracedac"):
                found.add(t)
    return found


EDGES = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER.get(parts[1]) if len(parts) > 1 else None


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in EDGES:
        if v not in index:
            visit(v)
    return out


def test_every_module_of_the_library_has_a_layer():
    """A new top-level module must say where it sits before it can be imported from."""
    missing = sorted({m.split(".")[1] for m in MODULES if m != "tracedac" and _layer(m) is None})
    assert missing == [], f"add these to LAYERS in {__file__}: {missing}"


def test_no_import_closes_a_circle():
    assert _cycles() == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = sorted(
        f"{a} -> {b}"
        for a, deps in EDGES.items()
        for b in deps
        if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)
    )
    assert upward == []


def test_the_checker_finds_a_circle_and_an_upward_import(monkeypatch):
    """The checks above can fail: a graph with a circle and an upward edge is reported."""
    edges = {
        "tracedac.graph": {"tracedac.trace"},
        "tracedac.trace": {"tracedac.graph", "tracedac.zero"},
        "tracedac.zero": set(),
    }
    monkeypatch.setattr(__import__(__name__, fromlist=["EDGES"]), "EDGES", edges)
    assert _cycles() == [["tracedac.graph", "tracedac.trace"]]
    assert _layer("tracedac.zero.unit") > _layer("tracedac.trace")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_file_of_the_library_is_over_450_lines(name):
    """One idea a file (docs/design.md, "Layout"): a file past this has grown a second one."""
    assert len(MODULES[name].read_text().splitlines()) <= 450
