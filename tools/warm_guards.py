# ruff: noqa: E501 (the patches are the source lines they replace, whole)
"""Show that each guard of the warm path is what its test checks (issue 46).

For each guard of ``tracedac/record/warm.py`` (and ``handlers.py``, ``template.py``,
``policies/spec.py``), this patches the source to take the guard out, runs the test of
``tests/test_warm.py`` named for it, and puts the source back (``git checkout``): every test
must fail without its guard. It changes the checkout while it runs: run it on a clean one,
from the clone's root, ``python tools/warm_guards.py``. A guard with several layers (tensor
subclasses: the op's argument types, a first sight's class, a pack's, a storage-less tensor's
lookup) is taken out whole.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
W = "tracedac/record/warm.py"
H = "tracedac/record/handlers.py"
T = "tracedac/record/template.py"
S = "tracedac/policies/spec.py"
GUARDS = [
    (
        "op identity",
        [
            (H, 'f"    if func is not OP{k} or kwargs', 'f"    if kwargs'),
            (
                W,
                "        if func is not e.op or (types and has_subclass(types)):\n            return self._other(func, types, args, kwargs)\n        return self._general",
                "        if e.__class__ is not OpEvent:\n            return self._other(func, types, args, kwargs)\n        return self._general",
            ),
        ],
        "test_another_op_falls_back_where_it_differs",
    ),
    (
        "constants",
        [
            (H, "    for j, (p, c) in enumerate(e.consts):", "    for j, (p, c) in enumerate(()):"),
            (H, "    for j, (p, c) in enumerate(e.strict):", "    for j, (p, c) in enumerate(()):"),
            (
                W,
                "            for p, c in e.consts:\n                a = args[p]",
                "            for p, c in ():\n                a = args[p]",
            ),
            (
                W,
                "            for p, c in e.strict:\n                if not same(args[p], c):\n                    raise _Diverged",
                "            for p, c in ():\n                if not same(args[p], c):\n                    raise _Diverged",
            ),
        ],
        "test_a_constant_that_changes_falls_back",
    ),
    (
        "constants by type and sign",
        [
            (
                T,
                "    if a is b:\n        return True\n    t = type(a)",
                "    if a is b or a == b:\n        return True\n    t = type(a)",
            )
        ],
        "test_constants_compare_by_value_type_and_sign_of_zero",
    ),
    (
        "dataflow identity",
        [
            (H, '    checks = [f"args[{p}] is not vals[{v}]" for p, v in e.targs]', "    checks = []"),
            (
                W,
                "            for p, v in e.targs:\n                if args[p] is not vals[v]:\n                    raise _Diverged",
                "            for p, v in ():\n                if args[p] is not vals[v]:\n                    raise _Diverged",
            ),
        ],
        "test_a_tensor_read_where_the_template_read_another_falls_back",
    ),
    (
        "first-sight geometry",
        [
            (
                W,
                "                if not (\n                    t.dtype is m.dtype\n                    and t.size() == m.size\n                    and t.stride() == m.stride\n                    and t.storage_offset() == m.offset\n                    and t.device == f.device\n                ):\n                    raise _Diverged",
                "                pass",
            )
        ],
        "test_an_outside_tensor_of_another_shape_dtype_or_layout_falls_back",
    ),
    (
        "snapshot before first write",
        [
            (
                W,
                "                self.snap[gid] = at(args, kwargs, path).untyped_storage().clone()",
                "                self.snap[gid] = at(args, kwargs, path).untyped_storage().clone().fill_(0) if False else self.snap.get(gid)",
            )
        ],
        "test_an_outside_tensor_written_in_the_region_is_copied_before_the_write_on_every_call",
    ),
    (
        "versions read at the end",
        [
            (
                W,
                "                x = g.external = ext[gid]\n                g.version = x._version",
                "                x = g.external = ext[gid]",
            )
        ],
        "test_an_outside_tensor_written_after_a_warm_forward_is_refused_as_after_a_recorded_one",
    ),
    (
        "policies that read values record",
        [
            (
                S,
                "            self.structural\n            and not self.timing\n            and not self.reads_values\n",
                "            not self.timing\n",
            )
        ],
        "test_a_policy_that_reads_values_is_asked_on_every_call",
    ),
    (
        "generator state per call",
        [
            (
                W,
                "            gen = _generator(args, kwargs)\n            state = gen.get_state()",
                "            gen = _generator(args, kwargs)\n            state = gen.get_state()\n            torch.manual_seed(12345)",
            )
        ],
        "test_random_ops_replay_the_numbers_this_call_drew",
    ),
    (
        "tensor subclasses",
        [
            (
                W,
                "        if func is not e.op or (types and has_subclass(types)):",
                "        if func is not e.op:",
            ),
            (
                W,
                "        if type(t) is not f.cls and (not isinstance(t, _Tensor) or is_subclass(t)):",
                "        if not isinstance(t, _Tensor):",
            ),
            (H, "or kwargs or types or UNRECORDED[0]", "or kwargs or UNRECORDED[0]"),
            (H, '        lines += ["    if type(out) is not Tensor:", after]', "        pass"),
            (
                W,
                "        if e.__class__ is not PackEvent or e.vid < 0 or t is not self.vals[e.vid]:",
                "        if e.__class__ is not PackEvent or e.vid < 0:",
            ),
            (
                W,
                "        except (RuntimeError, NotImplementedError):  # (no strides, no storage: not strided)\n            raise _Diverged from None",
                "        except ZeroDivisionError:\n            raise _Diverged from None",
            ),
            (
                W,
                "        if e.__class__ is not PackEvent or (type(t) is not _Tensor and is_subclass(t)):",
                "        if e.__class__ is not PackEvent:",
            ),
        ],
        "test_a_tensor_subclass_in_a_warm_call_falls_back",
    ),
    (
        "shapes read from values",
        [
            (
                W,
                "                and not _same_geometry(o, node_outputs[k])\n            ):",
                "                and False\n            ):",
            )
        ],
        "test_a_shape_read_from_values_falls_back",
    ),
    (
        "labels are events",
        [
            (
                W,
                "        try:\n            h = self.handlers[self.i]",
                "        while self.events and self.i < len(self.events) and self.events[self.i].__class__ is LabelEvent:\n            self.i += 1\n        try:\n            h = self.handlers[self.i]",
            ),
            (
                W,
                "        if self.i != self.n_events or wanted != t.wanted_metas",
                "        if self.i != self.n_events and not all(isinstance(x, LabelEvent) for x in self.events[self.i:]) or wanted != t.wanted_metas",
            ),
        ],
        "test_a_label_is_checked_like_an_op",
    ),
    (
        "the mode lets go at the end",
        [(W, "        self.__dict__.clear()\n", "        self.vals = None\n")],
        "test_a_warm_call_holds_after_its_forward_what_a_recorded_call_holds",
    ),
    (
        "autograd.grad inside records",
        [
            (
                W,
                '        if self.cold is None:\n            self.fall_back()\n        elif self.log is not None:\n            self.unwarmable = "a handle was unpacked while the region recorded"',
                "        pass",
            )
        ],
        "test_autograd_grad_inside_a_region_records_every_call",
    ),
    (
        "nested regions record",
        [
            (
                W,
                '        if self.cold is None:\n            self.fall_back()\n        elif self.log is not None:\n            self.unwarmable = "a region ran inside it"',
                "        pass",
            )
        ],
        "test_nested_regions_record_every_call_and_stay_exact",
    ),
]


def patch(path, old, new):
    p = os.path.join(ROOT, path)
    s = open(p).read()
    if s.count(old) < 1:
        raise SystemExit(f"patch text not found in {path}: {old[:70]!r}")
    open(p, "w").write(s.replace(old, new))


results = []
for name, patches, test in GUARDS:
    for path, old, new in patches:
        patch(path, old, new)
    try:
        r = subprocess.run(
            [PY, "-m", "pytest", "-q", "-p", "no:randomly", "tests/test_warm.py", "-k", test],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        last = r.stdout.strip().splitlines()[-1]
        results.append(
            (name, test, "FAILS without the guard" if r.returncode else "passes (guard not shown)", last)
        )
    finally:
        subprocess.run(["git", "checkout", "--", *{p for p, _, _ in patches}], cwd=ROOT)
for row in results:
    print(" | ".join(row))
sys.exit(0 if all(r[2].startswith("FAILS") for r in results) else 1)
