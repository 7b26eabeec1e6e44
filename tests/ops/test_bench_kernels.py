"""The kernel benchmark runs on CPU and reports figures that make sense."""

import json
import math

from tracedac.bench.kernels import block_shapes, run


def test_quick_kernel_benchmark_reports_every_way_with_sane_figures(capsys):
    """CI runs the quick variant; the figures must be present, positive, consistent with each
    other, JSON-able, and the three ways must agree bit for bit."""
    result = run(quick=True)
    json.dumps(result)
    unit = result["unit"]
    assert unit["elements"] == sum(math.prod(s) for s in block_shapes(unit["hidden"], unit["intermediate"]))
    assert unit["bytes_moved"] == 6 * unit["elements"]
    assert result["bit_identical"] is True
    assert set(result["methods"]) == {"pack_cast", "to + cat", "FSDP2"}
    for figures in result["methods"].values():
        assert figures["median_ms"] > 0
        seconds = figures["median_ms"] / 1e3
        assert math.isclose(figures["gb_per_s"], unit["bytes_moved"] / seconds / 1e9)
    assert result["methods"]["pack_cast"]["time_vs_pack_cast"] == 1.0
    assert result["backend"] == "torch" and result["pack_cast_kernels_per_call"] is None
    out = capsys.readouterr().out
    assert "GB/s" in out and "FSDP2" in out
