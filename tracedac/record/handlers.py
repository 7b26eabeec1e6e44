"""The fast path of a warm call: one handler per template event, written for that event.

A warm call checks every op against its template (``warm.py``). Interpreting an event's
description at every op (loops over its tensor arguments and constants, tuple unpacking,
attribute lookups on the event) costs about as much Python as the checks themselves, for
every op of every call. So when a template is built, each op event on the fast path (tensor
arguments by position, constants, one tensor out or several views: ``OpEvent.simple``) gets a
function of its own that does exactly its checks, in straight-line code with the positions,
value numbers and constants written in: ``args[1] is not vals[7]``, ``args[2] != [4, 8]``. Anything
else (a pack, a label, an event off the fast path) gets ``slow``, which hands the op to
``WarmMode._slow``, whose generic path (``_general``) checks any event, these included, check
for check as a handler does; ``warm.GENERATED = False`` runs every event through it
(``tests/test_warm.py`` runs the suite's guards both ways).

Handlers are made once per template (``make``), compiled from one generated module, and hold
the event's op, its constants and the event itself (for what they hand to the slow paths);
no tensor.
"""

from __future__ import annotations

import math

import torch

from .template import ALIAS, CREATED, SAME, VIEW, VIEWS, OpEvent, same
from .tracer import UNRECORDED

__all__ = ["make", "slow"]

_NO_KWARGS: dict = {}


def slow(self, func, types, args, kwargs):
    """The handler of an event off the fast path (or of no op event at all)."""
    return self._slow(func, types, args, kwargs)


def _literal(c) -> str | None:
    """``c`` as Python source, for a constant ``==`` compares exactly (ints, bools, None, lists
    of ints); None for anything else (held in the module's namespace instead)."""
    if c is None or c is True or c is False:
        return repr(c)
    if type(c) is int:
        return repr(c)
    if type(c) in (list, tuple) and all(type(x) is int for x in c):
        return repr(c)
    return None


def _source(k: int, e: OpEvent, names: dict) -> str:
    """The handler of event ``k`` as Python source; constants it cannot write go in ``names``."""
    lines = [
        f"def h{k}(self, func, types, args, kwargs):",
        f"    if func is not OP{k} or kwargs or types or UNRECORDED[0] or len(args) != {e.nargs}:",
        "        return self._slow(func, types, args, kwargs)",
        "    vals = self.vals",
    ]
    names[f"OP{k}"] = e.op
    names[f"RUN{k}"] = e.run
    names[f"E{k}"] = e
    if e.first:  # tensors first seen here: bound before the checks that may read them
        lines += [
            f"    if not self._bind_args(E{k}.first, args):",
            "        return self._diverge(func, types, args, kwargs)",
        ]
    checks = [f"args[{p}] is not vals[{v}]" for p, v in e.targs]
    for j, (p, c) in enumerate(e.consts):
        lit = _literal(c)
        if lit is None:
            names[f"C{k}_{j}"] = c
            lit = f"C{k}_{j}"
            checks.append(f"(args[{p}] is not {lit} and args[{p}] != {lit})")
        else:
            checks.append(f"args[{p}] != {lit}")
    for j, (p, c) in enumerate(e.strict):
        if type(c) is int and c != 0 or type(c) is float and math.isfinite(c) and c != 0:
            # a nonzero number: the same type and value is the same constant (``same``)
            checks.append(f"(args[{p}].__class__ is not {type(c).__name__} or args[{p}] != {c!r})")
        else:
            names[f"S{k}_{j}"] = c
            checks.append(f"not same(args[{p}], S{k}_{j})")
    if checks:
        lines.append("    if " + " or ".join(checks) + ":")
        if e.first:
            lines.append(f"        return self._undo(E{k}, func, types, args, kwargs)")
        else:
            lines.append("        return self._diverge(func, types, args, kwargs)")
    lines += [
        f"    self.i = {k + 1}",
        "    try:",
        f"        out = RUN{k}(*args)",
        "    except BaseException:",
        f"        self._raised({k}, E{k})",
        "        raise",
    ]
    after = f"        return self._after(E{k}, func, args, kwargs, out, None)"
    what = e.what
    if what == CREATED:  # a new storage (an aten op that aliases nothing allocates its result)
        lines += ["    if type(out) is not Tensor:", after]
        if e.store:
            lines.append(f"    vals[{e.vid}] = out")
    elif what == VIEW:
        if e.store:
            lines.append(f"    vals[{e.vid}] = out")
    elif what == VIEWS:
        lines += [f"    vals[{v}] = out[{j}]" for j, v in e.vid]
    else:
        assert what in (ALIAS, SAME), what
        lines += [f"    if not self._output(E{k}, out, args):", after]
        if e.store:
            lines.append(f"    vals[{e.vid}] = out")
    lines += [f"    vals[{v}] = None" for v in e.drop]
    if e.holds:
        lines.append(f"    self._hold(E{k}.holds, args, NO_KWARGS, (out,), None)")
    if e.reset:
        lines.append("    self.last_packs = []")
    lines.append("    return out")
    return "\n".join(lines)


def make(events: list) -> tuple:
    """One handler per event: its own for an op event on the fast path, ``slow`` for the rest."""
    names = {"Tensor": torch.Tensor, "UNRECORDED": UNRECORDED, "same": same, "NO_KWARGS": _NO_KWARGS}
    sources = [_source(k, e, names) for k, e in enumerate(events) if isinstance(e, OpEvent) and e.simple]
    code = compile("\n\n".join(sources), "<tracedac warm handlers>", "exec")
    exec(code, names)
    return tuple(
        names[f"h{k}"] if isinstance(e, OpEvent) and e.simple else slow for k, e in enumerate(events)
    )
