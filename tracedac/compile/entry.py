"""Entering a region while dynamo (or another tracer) traces it: no recorder, an annotation
and a mark.

- The annotation (``torch.fx.traceback.annotate({"tracedac_region": key})``) puts the
  region's key on every node the region traces: ``passes/tag_regions.py`` reads it there.
- The mark (``tracedac::region(key)``, an op that does nothing) puts the key in the graph's
  code. Compiler caches hash the code and drop ``node.meta``: without the mark, two graphs
  of the same code whose regions differ only in policy hashed alike, and the second was
  served the first one's partition (measured: ``save_all`` compiled again after
  ``recompute_all`` saved recompute_all's 104 elements, not its own 192). The mark also
  starts a new region call, so two back-to-back calls of one region are planned apart.
  ``passes/tag_regions.py`` removes the marks before the partitioner runs; dead-code
  elimination keeps them until then (``has_side_effect``). Only ``torch.compile`` gets
  them: an exported program or a ``make_fx`` graph has no cache to confuse and should not
  need tracedac to load.
"""

from __future__ import annotations

import types

import torch
import torch.fx.traceback as fx_traceback

from .._compat import is_exporting
from .registry import install_traced, key_for
from .vocab import ANNOTATION, MARK

__all__ = ["ANNOTATION", "MARK", "traced_region"]  # (the first two defined in vocab.py)


def traced_region(fn, args, kwargs, policy, name):
    """Call ``fn`` with every op it traces marked as region ``(policy, name)``."""
    install_traced()
    # a function as it is (dynamo hands functions over); any other policy by id (registry.py)
    key = key_for(policy if isinstance(policy, types.FunctionType) else id(policy), name)
    with fx_traceback.annotate({ANNOTATION: key}):
        if torch.compiler.is_dynamo_compiling() and not is_exporting():
            MARK(key)  # (an exported program or a make_fx graph keeps no op of ours to load)
        return fn(*args, **kwargs)
