"""python -m benchmarks --llama at a tiny size: every variant steps and gets no-checkpoint gradients."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import llama_steps
from tracedac import replay_compiled as compiled

pytestmark = pytest.mark.slow  # the quick loop (pytest -m "not slow") leaves this file out


def _run(variants):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # timings mean nothing here; spinning OpenMP workers only slow it down
    try:
        return llama_steps.run(llama_steps.QUICK, steps=1, variants=variants, progress=None)
    finally:
        torch.set_num_threads(threads)


def test_every_eager_variant_steps_with_the_no_checkpoint_gradients():
    compiled.clear()
    keys = (
        "none",
        "torch",
        "torch_sac",
        "tracedac_recompute_all",
        "tracedac_save_matmuls",
        "tracedac_compiled_replay",
    )
    r = _run(keys)
    rows = {x["key"]: x for x in r["variants"]}
    assert list(rows) == list(keys)
    for key in keys[:-1]:  # no dropout, fp32 on CPU: every eager variant computes the same numbers
        assert rows[key]["max_grad_diff"] == 0.0, key
        assert rows[key]["step_s"] > 0
    # compiled replay ran (and only in its own variant's steps), within inductor's rounding
    assert compiled.stats().get("runs", 0) > 0 and not compiled.is_enabled()
    assert rows["tracedac_compiled_replay"]["max_grad_diff"] < 1e-5
    text = llama_steps.format_report(r)
    assert "tracedac recompute_all, compiled replay" in text and "1.00x" in text  # torch's row against itself


@pytest.mark.skipif(
    os.environ.get("TRACEDAC_SLOW_TESTS", "") in ("", "0"),
    reason="torch.compile of the model takes about two minutes on a 2-core CPU; "
    "TRACEDAC_SLOW_TESTS=1 runs it",
)
def test_the_torch_compile_row_steps_with_the_no_checkpoint_gradients():
    rows = {x["key"]: x for x in _run(("none", "torch_compile"))["variants"]}
    assert rows["torch_compile"]["max_grad_diff"] < 1e-5 and rows["torch_compile"]["step_s"] > 0
