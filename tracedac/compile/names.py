"""Names dynamo gives things, made readable."""

from __future__ import annotations

import re

__all__ = ["module_path"]


def module_path(n) -> str | None:
    """``layers.0.attn`` from dynamo's ``L['self'].layers.0.forward.__self__.attn``."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\]\.?", "", path).replace(".forward.__self__", "")
    return re.sub(r"\._modules\['([^']*)'\]", r".\1", path) or None
