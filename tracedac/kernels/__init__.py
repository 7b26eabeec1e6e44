"""The fused casts' implementations: fp32 shards into a low-precision buffer in one pass, and back.

One Triton kernel for any number of sources (``triton_kernels.py``, its segment table
``table.py``, its launch ``launch.py``), a pure-torch reference beside it (``reference.py``),
the float bit rules both follow (``bits.py``) and the argument checks (``checks.py``). The ops
and their entry points, ``tracedac.ops.pack_cast`` and ``tracedac.ops.accumulate_``, are in
``tracedac/ops/cast.py``. Triton is imported only when its backend first runs.
"""

from .checks import BACKENDS, DTYPES

__all__ = ["BACKENDS", "DTYPES"]
