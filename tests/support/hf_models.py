"""The tiny transformers models of the tests, hidden 32 and 2 layers, from configs (random
weights: nothing is downloaded), with a batch and a loss for each. ``benchmarks/hf.py`` builds
the same architectures for its timings; the tests keep their own builders (the benchmarks
must not be imported by a test, nor a test by the benchmarks), so that a benchmark's sizes
can change without changing what a test checks.

``needs_switch``: the one skip of the tests that run ``tracedac.integrations.hf`` (or
transformers' ``activation_checkpointing_enable`` itself), for a transformers without that
switch (before ``hf.TRANSFORMERS_MIN``); there ``hf.enable`` refuses, saying so
(tests/integrations/test_hf.py checks the refusal on any transformers)."""

import pytest
import torch
import transformers

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

ARCHITECTURES = ("llama", "mixtral", "qwen2_moe", "gpt2", "bert", "t5")


def build(kind: str, *, hidden: int = 32, layers: int = 2, vocab: int = 64, seed: int = 0):
    """A ``kind`` model from a small config (heads of 8 dimensions), in training mode."""
    import transformers as tf

    heads = hidden // 8
    decoder = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
    )
    configs = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**decoder)),
        "mixtral": lambda: tf.MixtralForCausalLM(
            tf.MixtralConfig(**decoder, num_local_experts=4, num_experts_per_tok=2)
        ),
        "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(
            tf.Qwen2MoeConfig(
                **decoder,
                moe_intermediate_size=hidden,
                shared_expert_intermediate_size=2 * hidden,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
            )
        ),
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(
                vocab_size=vocab,
                n_embd=hidden,
                n_layer=layers,
                n_head=heads,
                n_positions=512,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        "bert": lambda: tf.BertForMaskedLM(
            tf.BertConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=2 * hidden,
            )
        ),
        "t5": lambda: tf.T5ForConditionalGeneration(
            tf.T5Config(
                vocab_size=vocab,
                d_model=hidden,
                d_kv=8,
                d_ff=2 * hidden,
                num_layers=layers,
                num_heads=heads,
                decoder_start_token_id=0,
            )
        ),
    }
    if kind not in configs:
        raise ValueError(f"unknown architecture {kind!r}; one of {', '.join(ARCHITECTURES)}")
    torch.manual_seed(seed)
    return configs[kind]().train()


def batch(batch_size: int = 2, seq: int = 16, *, vocab: int = 64, seed: int = 1) -> dict:
    """Token ids (never 0, the pad/start id) and the same ids as labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch_size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def loss(model, inputs: dict, seed: int = 2) -> torch.Tensor:
    torch.manual_seed(seed)  # dropout draws the same numbers in every run
    return model(**inputs).loss
