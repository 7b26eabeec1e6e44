"""The kernel benchmark runs on CPU and reports figures that make sense."""

import json
import math

import torch

from benchmarks.kernels import block_shapes, run


def test_quick_kernel_benchmark_reports_every_way_with_sane_figures(capsys):
    """CI runs the quick variant; the figures must be present, positive, consistent with each
    other, JSON-able, and the three ways must agree bit for bit."""
    result = run(quick=True)
    json.dumps(result)
    unit = result["unit"]
    assert unit["elements"] == sum(math.prod(s) for s in block_shapes(unit["hidden"], unit["intermediate"]))
    # the cast reads each fp32 element once and writes it once as bf16
    assert unit["bytes_moved"] == unit["elements"] * (torch.float32.itemsize + torch.bfloat16.itemsize)
    assert result["bit_identical"] is True
    methods = result["methods"]
    assert set(methods) == {"pack_cast", "to + cat", "FSDP2"}
    assert all(figures["median_ms"] > 0 for figures in methods.values())
    # the same bytes for every way: the faster way has the higher bandwidth
    by_time = sorted(methods, key=lambda m: methods[m]["median_ms"])
    by_bandwidth = sorted(methods, key=lambda m: -methods[m]["gb_per_s"])
    assert by_time == by_bandwidth
    assert methods["pack_cast"]["time_vs_pack_cast"] == 1.0
    if torch.cuda.is_available():
        assert result["backend"] == "triton" and result["pack_cast_kernels_per_call"] == 1
    else:
        assert result["backend"] == "torch" and result["pack_cast_kernels_per_call"] is None
    out = capsys.readouterr().out
    assert "GB/s" in out and "FSDP2" in out
