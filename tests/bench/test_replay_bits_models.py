"""The bit tests of tests/test_compiled_replay_bits.py on the benchmarks' own models (the Llama
of ``--llama`` and the MoE GPT of ``python -m benchmarks``): here, because only tests/bench imports
``benchmarks``."""

import pytest
import torch

from ..test_compiled_replay_bits import (
    DTYPES,
    MODELS,
    defaults,  # noqa: F401 (a fixture)
)
from ..test_compiled_replay_bits import (
    test_the_benchmarks_models_get_no_checkpointings_gradients_bit_for_bit as check,
)

pytestmark = pytest.mark.slow


def _tokens(device):
    ids = torch.randint(64, (2, 17), generator=torch.Generator().manual_seed(1)).to(device)
    return ids[:, :-1], ids[:, 1:]  # [2, 16] inputs, their next tokens


def _llama(dtype, device="cpu"):
    from benchmarks.llama import DecoderLayer, Llama, LlamaConfig

    cfg = LlamaConfig(vocab=64, layers=2, dim=32, heads=2, mlp_hidden=64, batch=2, seq=16)
    ids, targets = _tokens(device)
    return Llama.seeded(cfg).to(device, dtype), DecoderLayer, lambda m: m(ids, targets)


def _moe(dtype, device="cpu"):
    from benchmarks.model import GPT, Config
    from benchmarks.model import Block as MoEBlock

    cfg = Config(
        vocab=64, layers=2, dim=32, heads=2, experts=4, expert_hidden=32, batch=2, seq=16, dropout=0.0
    )
    ids, targets = _tokens(device)
    return GPT.seeded(cfg).to(device, dtype), MoEBlock, lambda m: m(ids, targets)


BENCH = {"Llama": _llama, "MoE GPT": _moe}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model", list(BENCH))
@pytest.mark.usefixtures("defaults")
def test_the_benchmarks_llama_and_moe_get_no_checkpointings_gradients_bit_for_bit(model, dtype, monkeypatch):
    monkeypatch.setitem(MODELS, model, BENCH[model])
    check(None, model, dtype)
