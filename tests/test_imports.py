"""The library's imports run one way, read from its folders (docs/design.md, "Layout").

Read from the source with ``ast``: every ``import`` and ``from ... import`` in a module, at the
top or inside a function (a lazy import that dodges a circle is still a circle). A *room* is
a folder of ``tracedac/`` or one of its top-level modules. No module imports in a circle, no
room imports in a circle either (so the folders have an order: what each may import), and
docs/design.md lists the rooms in that order. Every ``torch.library`` op is defined in
``tracedac/ops/`` (the ``torch.ops.tracedac`` namespace), and no other module is called ``ops``.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import tracedac

ROOT = pathlib.Path(tracedac.__file__).parent
DESIGN = ROOT.parent / "docs" / "design.md"


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


def room(module: str) -> str | None:
    """The folder or top-level module of ``tracedac`` that ``module`` is in (None: the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def room_edges(edges: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, deps in edges.items():
        if room(a) is None:
            continue
        out.setdefault(room(a), set())
        for b in deps:
            if room(b) is not None and room(b) != room(a):
                out[room(a)].add(room(b))
    return out


def cycles(edges: dict) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_closes_a_circle():
    assert cycles(EDGES) == []


def test_the_folders_import_one_way():
    """Between rooms too: a folder that imports one which imports it back has no place."""
    assert cycles(room_edges(EDGES)) == []


def _documented_order() -> list[str]:
    """The rooms as docs/design.md lists them, bottom first (its line ``Rooms, bottom first: ...``)."""
    m = re.search(r"Rooms, bottom first:(.*?)(?:\n\n|$)", DESIGN.read_text(), re.S)
    assert m, f"{DESIGN} has no line 'Rooms, bottom first: ...'"
    return re.findall(r"`([\w]+)/?(?:\.py)?`", m.group(1))


def test_docs_list_every_room_below_what_imports_it():
    """The layer order is visible: docs/design.md names every folder and top-level module, each
    after every room it imports, so a newcomer reads the house bottom up."""
    order = _documented_order()
    rooms = room_edges(EDGES)
    assert sorted(order) == sorted(rooms), (sorted(set(rooms) - set(order)), sorted(set(order) - set(rooms)))
    position = {r: i for i, r in enumerate(order)}
    upward = sorted(f"{a} -> {b}" for a, deps in rooms.items() for b in deps if position[b] > position[a])
    assert upward == []


def test_the_checker_finds_a_circle_between_modules_and_between_folders():
    """The checks above can fail: circles are reported, at either level."""
    edges = {
        "tracedac.record.graph": {"tracedac.record.tracer"},
        "tracedac.record.tracer": {"tracedac.record.graph", "tracedac.zero"},
        "tracedac.zero": {"tracedac.record.decisions"},
        "tracedac.record.decisions": set(),
    }
    assert cycles(edges) == [["tracedac.record.graph", "tracedac.record.tracer"]]
    assert cycles(room_edges(edges)) == [["record", "zero"]]


_DEFINES_OP = re.compile(r"torch\.library\.(custom_op|triton_op|define|Library)\b|\blibrary\.custom_op\b")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_only_tracedac_ops_defines_torch_library_ops(name):
    """``tracedac/ops/`` is the ``torch.ops.tracedac`` namespace: every op is defined there."""
    if room(name) == "ops":
        return
    found = [line.strip() for line in MODULES[name].read_text().splitlines() if _DEFINES_OP.search(line)]
    assert found == [], f"{name} defines an op outside tracedac/ops: {found}"


def test_no_other_module_is_called_ops():
    assert [m for m in MODULES if m.rpartition(".")[2] == "ops" and m != "tracedac.ops"] == []


def test_the_public_ops_are_the_documented_calls():
    """``from tracedac import ops; ops.pack_cast(...)`` as the design shows."""
    import torch

    from tracedac import ops

    dst = torch.empty(6, dtype=torch.bfloat16)
    assert ops.pack_cast([torch.ones(2, 2), torch.full((2,), 2.0)], dst) is dst
    assert dst.tolist() == [1, 1, 1, 1, 2, 2]
    acc = torch.zeros(6)
    assert ops.accumulate_(acc, dst).tolist() == [1, 1, 1, 1, 2, 2]
