"""Entering a region while dynamo (or another tracer) traces it: no recorder, an annotation."""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback

from .registry import key_for

__all__ = ["ANNOTATION", "traced_region"]

ANNOTATION = "tracedac_region"


def traced_region(fn, args, kwargs, policy, name):
    """Call ``fn`` with every op it traces marked as region ``(policy, name)``."""
    key = key_for(policy, name)
    with fx_traceback.annotate({ANNOTATION: key}):
        return fn(*args, **kwargs)
