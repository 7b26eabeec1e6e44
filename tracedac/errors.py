"""The exceptions tracedac raises for what it cannot do safely: ``CheckpointError`` (a region),
``ZeroError`` (a sharded model)."""

__all__ = ["CheckpointError", "ZeroError"]


class CheckpointError(RuntimeError):
    """A checkpointed region cannot give backward the value it needs, or was used wrongly.

    Raised instead of ever returning a wrong value: the message names the tensor, the op
    and the place involved, says why, and says what to change.
    """


class ZeroError(RuntimeError):
    """Sharding cannot go on: no process group, ranks that disagree, or a collective that failed.

    The message says what happened, on which rank and unit, why, and what to do.
    """
