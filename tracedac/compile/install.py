"""Registering the joint-graph passes, once, the first time dynamo traces a region or a gather.

The passes are ``passes.PASSES``, run in that order: ``fuse_gather_casts`` (autocast's
downcast of a gathered parameter moved into ZeRO-3's gather), ``tag_regions`` (each region's
policy), ``prefetch_gathers`` (each unit's all-gather started while the unit before it
computes), then ``tag_gathers`` (ZeRO-3's gathers and what is computed from them alone:
recomputed in backward).

Nothing is registered at import: eager users never touch torch's compiler configuration.
The pass is added beside any pass already set (a list for inductor; a chained function for
AOTAutograd), never in place of one:

- ``torch._inductor.config.joint_custom_pre_pass``: inductor runs it on the joint graph
  before partitioning, and its ``uuid`` is part of inductor's and AOTAutograd's cache keys,
  so a cached artifact is never reused for a different set of region policies.
- ``torch._functorch.config.joint_custom_pass``: AOTAutograd runs it before any backend's
  partitioner (``aot_eager_decomp_partition``...). It is not in the cache key and is skipped
  on a cache hit, which is why inductor's entry above is the one the cache relies on. Both
  hooks are handed the same graph module; the second finds it marked done and returns it.
"""

from __future__ import annotations

import hashlib
import os

from torch._inductor.custom_graph_pass import CustomGraphPass

from . import passes
from .vocab import SPECS

__all__ = ["TagRegions", "install", "sources"]

ROOT = os.path.dirname(os.path.abspath(__file__))  # tracedac/compile
# beside compile/: every module of tracedac that compile/ imports, directly or not (the passes
# decide with them; tests/test_compile_layout.py checks the list against the imports)
DEPENDS = (
    "_compat.py",
    "errors.py",
    "offload/link.py",
    "ops/marks.py",
    "policies/held.py",
    "policies/min_cut.py",
    "policies/placement.py",
    "policies/planners.py",
    "policies/spec.py",
    "record/decisions.py",
    "record/graph.py",
    "record/op_info.py",
    "record/undeclared_writes.py",
)


def sources(root: str | None = None) -> list[str]:
    """The files whose contents ``TagRegions.uuid`` hashes: every ``.py`` under compile/
    (``root``, default ``ROOT``), ``passes/`` and ``vocab.py`` included, then ``DEPENDS``."""
    root = ROOT if root is None else root
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        files += [os.path.join(folder, f) for f in sorted(names) if f.endswith(".py")]
    return files + [os.path.join(os.path.dirname(root), f) for f in DEPENDS]


class TagRegions(CustomGraphPass):
    """Inductor's handle on the passes: its uuid is the source of every file of ``sources()``
    (each pass among them) and every region key."""

    def __call__(self, graph) -> None:
        _passes(graph.owning_module)

    def uuid(self) -> str:
        h = hashlib.sha256()
        for path in sources():
            with open(path, "rb") as f:
                h.update(f.read())
        for key in sorted(SPECS):
            h.update(key.encode())
        return h.hexdigest()


PASS = TagRegions()


def _passes(gm):
    if gm.meta.get(_DONE):  # both hooks run on one graph: AOTAutograd's first, then inductor's
        return gm
    gm = passes.run(gm)
    gm.meta[_DONE] = True
    return gm


_DONE = "tracedac_passes_done"


def _aot_pass(gm, joint_inputs):
    return _passes(gm)


def install() -> None:
    """Add the pass to inductor's and AOTAutograd's joint-graph hooks (once; idempotent)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    current = inductor_config.joint_custom_pre_pass
    hooked = list(current) if isinstance(current, (list, tuple)) else ([current] if current else [])
    if not any(isinstance(p, TagRegions) for p in hooked):
        inductor_config.joint_custom_pre_pass = [*hooked, PASS] if hooked else PASS
    user = functorch_config.joint_custom_pass
    if user is None:
        functorch_config.joint_custom_pass = _aot_pass
    elif user is not _aot_pass and getattr(user, "_tracedac_chained", None) is None:

        def chained(gm, joint_inputs):
            return _aot_pass(user(gm, joint_inputs), joint_inputs)

        chained._tracedac_chained = user
        functorch_config.joint_custom_pass = chained
