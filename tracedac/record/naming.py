"""What a region calls things, for people: its own name (a module's qualified name in its
model), the tensors it was given, and a parameter or buffer by its full name, in reports and
error messages."""

from __future__ import annotations

import weakref

import torch
from torch import nn

__all__ = ["arg_refs", "describe", "module_table", "register_name", "registered_name", "unregister_name"]


def arg_refs(items, label: str) -> list:
    """(label, weak reference) for each tensor argument, and each tensor in a tuple or list
    argument (Hugging Face passes ``position_embeddings=(cos, sin)``)."""
    refs = []
    for k, a in items:
        if isinstance(a, torch.Tensor):
            refs.append((label.format(k), weakref.ref(a)))
        elif isinstance(a, (tuple, list)):
            refs += [
                (f"{label.format(k)}[{i}]", weakref.ref(x))
                for i, x in enumerate(a)
                if isinstance(x, torch.Tensor)
            ]
    return refs


def _storages(t: torch.Tensor, inside: str = ""):
    """(storage address, where) of ``t``'s plain tensors: its own storage, or a tensor
    subclass's inner tensors' (a DTensor parameter's local shard: " (its _local_tensor)")."""
    if hasattr(type(t), "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            x = getattr(t, name)
            if isinstance(x, torch.Tensor):
                yield from _storages(x, f"{inside}.{name}" if inside else name)
    else:
        yield t.untyped_storage()._cdata, f" (its {inside})" if inside else ""


def _find(cdata: int, t: torch.Tensor) -> str | None:
    return next((where for c, where in _storages(t) if c == cdata), None)


def describe(module_ref, arg_refs, prefix, t) -> str:
    """A name a person can find: an argument, a parameter's or buffer's qualified name, else a shape."""
    shape = f"of shape {list(t.shape)} ({t.dtype})"
    cdata = t.untyped_storage()._cdata
    for label, ref in arg_refs:
        a = ref()
        where = _find(cdata, a) if a is not None else None
        if where is not None:
            return f"{label}{where} {shape}"
    module = module_ref() if module_ref is not None else None
    if module is not None:
        for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for n, p in items:
                where = _find(cdata, p)
                if where is not None:
                    return f"{kind} {prefix + n!r}{where} {shape}"
    return f"a tensor {shape}"


# Qualified names of modules in the model they were checkpointed in (tracedac.integrations.hf
# registers each layer): regions entered through checkpoint_call are named by them.
_module_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_name(module: nn.Module, qualified: str) -> None:
    """Name the regions ``module`` runs in (``model.layers.3``) when entered by checkpoint_call."""
    _module_names[module] = qualified


def unregister_name(module: nn.Module) -> None:
    _module_names.pop(module, None)


def module_table(module: nn.Module, name: str, qualified: bool):
    """A builder of ``id(submodule) -> name`` under ``module`` named ``name`` (paths below it
    start with ``name.`` when that is a qualified name, as ``wrap`` names them)."""
    prefix = f"{name}." if qualified else ""
    return lambda: {id(m): prefix + n if n else name for n, m in module.named_modules()}


def registered_name(module: nn.Module) -> str | None:
    """The qualified name ``register_name`` gave ``module``, or None."""
    return _module_names.get(module)
