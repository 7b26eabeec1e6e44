"""Fixtures for tracedac.kernels: run each backend, the Triton one under its CPU interpreter."""

import pytest
import torch


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter for CPU tensors, for this test only.

    tracedac reads TRITON_INTERPRET when the Triton backend runs (not at import), so setting
    it per test leaves the rest of the suite alone. Triton itself reads it when a function is
    decorated: importing triton first keeps its own library (tl.sum, tl.zeros, ...) compiled
    for any later GPU test in this process.
    """
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    if request.param == "triton":
        request.getfixturevalue("interpreter")
    return request.param


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
