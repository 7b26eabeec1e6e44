"""Torch's scalar CPU kernels give other NaN bits than its AVX2 ones; tracedac follows either."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_bit_exactness_holds_with_torchs_scalar_cpu_kernels():
    """With ATEN_CPU_CAPABILITY=default torch casts fp32 NaNs to bf16 0x7FC0 (not 0xFFFF) and
    bf16 NaNs to fp16 without their payload. The NaN rule is probed, not hard-coded, so the
    exactness tests must pass unchanged there; they run in a child process because torch
    reads the variable once, at start-up."""
    pytest.importorskip("triton")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    selected = [
        str(HERE / "test_bits.py"),
        str(HERE / "test_pack_cast.py") + "::test_adversarial_fp32_values_cast_bit_exactly",
        str(HERE / "test_pack_cast.py") + "::test_low_precision_sources_cast_and_copy_bit_exactly",
        str(HERE / "test_accumulate.py") + "::test_adversarial_values_add_like_torch",
    ]
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selected],
        cwd=HERE.parents[1],
        env=env,
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout
