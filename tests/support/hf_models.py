"""The tiny transformers models of the tests: the benchmark's builders (benchmarks.hf) at
their smallest, hidden 32 and 2 layers, with a batch and a loss for each.

``needs_switch``: the one skip of the tests that run ``tracedac.integrations.hf`` (or
transformers' ``activation_checkpointing_enable`` itself), for a transformers without that
switch (before ``hf.TRANSFORMERS_MIN``); there ``hf.enable`` refuses, saying so
(tests/integrations/test_hf.py checks the refusal on any transformers)."""

import pytest
import transformers

from benchmarks.hf import ARCHITECTURES, batch, build
from benchmarks.hf import lm_loss as loss
from tracedac.integrations.hf import TRANSFORMERS_MIN

__all__ = ["ARCHITECTURES", "NO_SWITCH", "batch", "build", "loss", "needs_switch"]

# why the tests of tracedac.integrations.hf cannot run here, or None
NO_SWITCH = (
    None
    if callable(getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None))
    else (
        f"transformers {transformers.__version__} has no PreTrainedModel.activation_checkpointing_enable, "
        f"which tracedac.integrations.hf works through (transformers >= {TRANSFORMERS_MIN})"
    )
)

needs_switch = pytest.mark.skipif(NO_SWITCH is not None, reason=NO_SWITCH or "")
