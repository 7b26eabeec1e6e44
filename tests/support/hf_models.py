"""The tiny transformers models of the tests: the benchmark's builders (benchmarks.hf) at
their smallest, hidden 32 and 2 layers, with a batch and a loss for each."""

from benchmarks.hf import ARCHITECTURES, batch, build
from benchmarks.hf import lm_loss as loss

__all__ = ["ARCHITECTURES", "batch", "build", "loss"]
