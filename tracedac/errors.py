"""The one exception tracedac raises for what it cannot do safely."""

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpointed region cannot give backward the value it needs, or was used wrongly.

    Raised instead of ever returning a wrong value: the message names the tensor, the op
    and the place involved, says why, and says what to change.
    """
