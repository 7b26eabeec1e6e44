"""Choosing modules: the ``match`` argument of ``wrap`` and ``tracedac.zero.shard(units=...)``."""

from __future__ import annotations

from torch import nn

__all__ = ["module_matcher", "no_match_error"]


def module_matcher(match, where: str = "wrap(match=...)"):
    """A predicate ``(qualified_name, module) -> bool`` from a class, a tuple of classes or a
    predicate, as ``wrap`` and ``tracedac.zero.shard`` take them; ``where`` names the argument
    in errors."""
    if isinstance(match, type):
        if not issubclass(match, nn.Module):
            raise TypeError(f"{where} takes nn.Module classes, got {match!r}")
        return lambda name, m: isinstance(m, match)
    if isinstance(match, tuple):
        if not match or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in match):
            raise TypeError(f"{where} takes a non-empty tuple of nn.Module classes, got {match!r}")
        return lambda name, m: isinstance(m, match)
    if callable(match):
        return match
    raise TypeError(
        f"{where} takes an nn.Module class, a tuple of them, or a predicate "
        f"(qualified_name, module) -> bool, got {match!r} of type {type(match).__name__}"
    )


def no_match_error(model: nn.Module, what: str) -> ValueError:
    """The error for a ``match`` that selected nothing: ``what`` says what that would mean."""
    classes = sorted({type(m).__name__ for m in model.modules()})
    return ValueError(f"{what}. Module classes present: {', '.join(classes)}.")
