"""The exception tracedac.zero raises for a sharded model it cannot run safely."""

__all__ = ["ZeroError"]


class ZeroError(RuntimeError):
    """Sharding cannot go on: no process group, ranks that disagree, or a collective that failed.

    The message says what happened, on which rank and unit, why, and what to do.
    """
