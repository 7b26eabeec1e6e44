"""tracedac: activation checkpointing that records the forward instead of re-running it.

See README.md for a tour. Everything public is re-exported here; nothing runs at import.
"""

from . import policies
from .checkpoint import checkpoint, checkpoint_call, name, wrap
from .errors import CheckpointError
from .inspect import print_saved, saved_report
from .tradeoff import trade_off

__all__ = [
    "CheckpointError",
    "checkpoint",
    "checkpoint_call",
    "name",
    "policies",
    "print_saved",
    "saved_report",
    "trade_off",
    "wrap",
]


def __getattr__(name: str):
    # tracedac.zero imports torch.distributed: loaded when first asked for, not at import.
    if name == "zero":
        import importlib

        return importlib.import_module(".zero", __name__)
    raise AttributeError(f"module 'tracedac' has no attribute {name!r}")
