"""tracedac: activation checkpointing that records the forward instead of re-running it.

See README.md and docs/guide/ for a tour. Everything public is re-exported here; nothing runs at import.
"""

from . import ops, policies
from .checkpoint import checkpoint, checkpoint_call, is_checkpointed, name, unwrap, wrap
from .errors import CheckpointError
from .inspect.peak_tradeoff import peak_trade_off
from .inspect.saved import print_saved, saved_report
from .inspect.tradeoff import trade_off
from .record.warm import enable as warm_path
from .replay.compiled import compiled_replay

__all__ = [
    "CheckpointError",
    "checkpoint",
    "checkpoint_call",
    "compiled_replay",
    "is_checkpointed",
    "name",
    "ops",
    "peak_trade_off",
    "policies",
    "print_saved",
    "saved_report",
    "trade_off",
    "unwrap",
    "warm_path",
    "wrap",
]


def __getattr__(name: str):
    # Loaded when first asked for, not at import: tracedac.zero imports torch.distributed,
    # and tracedac.integrations serves libraries most users do not have.
    if name in ("zero", "integrations"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tracedac' has no attribute {name!r}")
