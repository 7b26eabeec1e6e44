"""Whether this torch compiles ``tracedac.zero``, asked of the library itself: the one skip of
every test that compiles a sharded model.

Before torch 2.13 ``zero/unit.py``'s ``compiles_zero`` refuses ``torch.compile`` of a sharded
unit with a ``ZeroError`` (dynamo there cannot trace how a unit puts its parameters back). The
compiled tests skip with that reason; the refusal itself is checked on such a torch by
``test_shard.py::test_one_rank_compiles_auto_mixed_precision_in_process_clips_and_reads_full_parameters``.
"""

from __future__ import annotations

import pytest

import tracedac.zero as zero
from tracedac.zero.unit import compiles_zero

__all__ = ["COMPILES", "REFUSED", "WHY_NOT", "needs_compiled_zero"]

# what the refusal says (pytest.raises' match), torch's version aside
REFUSED = r"tracedac\.zero under torch\.compile needs torch 2\.13 or newer.*run the sharded model eagerly"


def _refusal() -> str | None:
    """The library's reason not to compile a sharded unit under dynamo here, or None."""
    try:
        compiles_zero(True)
    except zero.ZeroError as e:
        return str(e)
    return None


_REFUSAL = _refusal()
COMPILES = _REFUSAL is None
# the refusal's first sentence: "... needs torch 2.13 or newer (this is 2.11.0): dynamo before it ..."
WHY_NOT = None if COMPILES else _REFUSAL.split(". ")[0]

needs_compiled_zero = pytest.mark.skipif(not COMPILES, reason=WHY_NOT or "")
