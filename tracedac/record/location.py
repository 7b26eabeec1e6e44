"""Where an op ran: the module whose forward is running (its qualified name in the model) and
the user's source line, for policies that read module paths and for reports.

Module paths cost two global module hooks, installed while some region needs them
(``track_modules``), removed when none does.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

__all__ = ["current_module_path", "track_modules", "user_source"]

_local = threading.local()
_hooks_lock = threading.Lock()
_hook_users = 0
_hook_handles: tuple = ()


def _module_stack() -> list:
    stack = getattr(_local, "modules", None)
    if stack is None:
        stack = _local.modules = []
    return stack


def _push_module(module, args):
    _module_stack().append(module)


def _pop_module(module, args, output):
    stack = _module_stack()
    if stack and stack[-1] is module:
        stack.pop()


def track_modules(on: bool) -> None:
    """Count regions that want module paths; global module hooks exist only while any does."""
    global _hook_users, _hook_handles
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    with _hooks_lock:
        _hook_users += 1 if on else -1
        if on and _hook_users == 1:
            _hook_handles = (
                register_module_forward_pre_hook(_push_module),
                register_module_forward_hook(_pop_module, always_call=True),
            )
        elif not on and _hook_users == 0:
            for h in _hook_handles:
                h.remove()
            _hook_handles = ()


def current_module_path(names: dict) -> str | None:
    """Qualified name of the innermost module running now, from a region's name table."""
    stack = _local.__dict__.get("modules")
    if not stack:
        return None
    m = stack[-1]
    name = names.get(id(m))
    return name if name is not None else type(m).__name__


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)  # tracedac's own modules (not its subpackages' models)


def user_source() -> str | None:
    """``file:line`` of the innermost frame outside torch and tracedac (report mode only)."""
    f = sys._getframe(2)
    while f is not None:
        filename = f.f_code.co_filename
        if not (
            filename.startswith(_TORCH_DIR)
            or os.path.dirname(filename) == _OWN_DIR
            or "contextlib" in filename
        ):
            return f"{filename}:{f.f_lineno}"
        f = f.f_back
    return None
