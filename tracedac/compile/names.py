"""Names dynamo gives things, made readable."""

from __future__ import annotations

import re

__all__ = ["input_name", "module_path", "readable_path"]


# What dynamo's paths carry that a module's qualified name does not: the way to the module
# through a forward set on the instance (``tracedac.checkpoint``'s and ``tracedac.zero``'s
# partials: ``.forward.args[0]``; a bound method: ``.forward.__self__``) and the dicts
# ``named_modules`` and ``named_parameters`` hide.
_THROUGH_FORWARD = re.compile(r"\.forward(?:\.func)?(?:\.__self__|\.args\[\d+\]|\.keywords\['[^']*'\])")
_DICT_ENTRY = re.compile(r"(?:^|\.)_(?:modules|parameters|buffers)\['([^']*)'\]")
_ITEM = re.compile(r"\[(\d+)\]")


def readable_path(path: str) -> str:
    """``layers.0.attn`` from ``L['self'].layers.0.forward.args[0].attn`` (dynamo's)."""
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    path = re.sub(r"(?:^|\.)__dict__\['(_\w+)'\]", r".\1", path)
    path = _THROUGH_FORWARD.sub("", path)
    path = _DICT_ENTRY.sub(r".\1", path)
    return _ITEM.sub(r".\1", path).lstrip(".")


def module_path(n) -> str | None:
    """The qualified name of the module that ran FX node ``n`` (``nn_module_stack``'s last)."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    return readable_path(list(stack.values())[-1][0]) or None


def input_name(source: str) -> str:
    """What a compiled graph input is, from dynamo's source of it: a parameter or buffer by
    its qualified name (``blocks.0.ln1.weight``), an argument by its name (``argument x``)."""
    root = re.match(r"^L\['([^']*)'\]", source)
    rest = source[root.end() :] if root else source
    if root and not rest:
        return f"argument {root.group(1)}"
    # a module called as ``module(*args, **kwargs)``: dynamo's frame is its ``_call_impl``
    item = re.fullmatch(r"\[(\d+)\]|\['([^']*)'\]", rest)
    if root and root.group(1) in ("args", "kwargs") and item:
        return f"argument {item.group(1) or repr(item.group(2))}"
    return readable_path(rest) or source
