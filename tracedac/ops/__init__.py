"""The ``torch.ops.tracedac`` namespace: every op tracedac defines, and nothing else.

Each op's schema, fake (meta) implementation, autograd formula and effects are defined here;
what an op runs lives beside the code that uses it:

- ``cast.py``: ``tracedac::pack_cast`` and ``tracedac::accumulate_``, the fused casts of
  ZeRO-3's shards, and their Python entry points ``pack_cast`` / ``accumulate_`` (argument
  checks, a call cache); the Triton and torch bodies are in ``tracedac/kernels/``.
- ``zero.py``: ZeRO-3's collectives (``all_gather``, ``all_gather_start`` /
  ``all_gather_wait``, ``reduce_scatter``, ``reduce_grad``, ``release``), run by the flat
  group each names (``tracedac/zero/group.py``).
- ``marks.py``: the compile path's ``tracedac::region`` mark and ``tracedac::label``.

Importing this package registers them all; it imports nothing of tracedac but the kernels'
host code and ``errors`` (Triton is imported when its backend first runs).
"""

from . import marks, zero  # noqa: F401 (registers tracedac::region, tracedac::label and ZeRO-3's ops)
from .cast import accumulate_, pack_cast

__all__ = ["accumulate_", "pack_cast"]
