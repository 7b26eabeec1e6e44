"""Registering the joint-graph passes, once, the first time dynamo traces a region or a gather.

The passes: ``fuse_gather_casts`` (autocast's downcast of a gathered parameter moved into
ZeRO-3's gather), ``tag_regions`` (each region's policy), ``prefetch_gathers`` (each unit's
all-gather started while the unit before it computes), then ``tag_gathers`` (ZeRO-3's
gathers and what is computed from them alone: recomputed in backward).

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

__all__ = ["TagRegions", "install"]


class TagRegions(CustomGraphPass):
    """Inductor's handle on ``tag_regions``: its uuid is the pass's source and every region key."""

    def __call__(self, graph) -> None:
        _passes(graph.owning_module)

    def uuid(self) -> str:
        from .registry import SPECS

        h = hashlib.sha256()
        here = os.path.dirname(__file__)
        parent = os.path.dirname(here)
        files = [os.path.join(here, f) for f in sorted(os.listdir(here)) if f.endswith(".py")]
        files += [os.path.join(parent, f) for f in ("decisions.py", "planners.py", "policies.py", "graph.py")]
        for path in files:
            with open(path, "rb") as f:
                h.update(f.read())
        for key in sorted(SPECS):
            h.update(key.encode())
        return h.hexdigest()


PASS = TagRegions()


def _passes(gm):
    from .gather_cast import fuse_gather_casts
    from .gather_prefetch import prefetch_gathers
    from .tag_regions import tag_regions
    from .zero_tags import tag_gathers

    if gm.meta.get(_DONE):  # both hooks run on one graph: AOTAutograd's first, then inductor's
        return gm
    gm = tag_gathers(prefetch_gathers(tag_regions(fuse_gather_casts(gm))))
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
    passes = list(current) if isinstance(current, (list, tuple)) else ([current] if current else [])
    if not any(isinstance(p, TagRegions) for p in passes):
        inductor_config.joint_custom_pre_pass = [*passes, PASS] if passes else PASS
    user = functorch_config.joint_custom_pass
    if user is None:
        functorch_config.joint_custom_pass = _aot_pass
    elif user is not _aot_pass and getattr(user, "_tracedac_chained", None) is None:
        def chained(gm, joint_inputs):
            return _aot_pass(user(gm, joint_inputs), joint_inputs)

        chained._tracedac_chained = user
        functorch_config.joint_custom_pass = chained
