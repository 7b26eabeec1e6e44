"""Tiny transformers models, built from configs (random weights, nothing downloaded), and a
batch and loss for each: the architectures people fine-tune, small enough for CPU tests."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2)

CONFIGS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**_COMMON)),
    "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        **_COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1)),
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=4, intermediate_size=64)),
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                             num_heads=4, decoder_start_token_id=0)),
}


def build(kind: str, seed: int = 0):
    """A model of ``kind`` in training mode (dropout on where its config has it)."""
    torch.manual_seed(seed)
    model = CONFIGS[kind]()
    model.train()
    return model


def batch(batch_size: int = 2, seq: int = 16, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch_size, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def loss(model, inputs: dict, seed: int = 2) -> torch.Tensor:
    torch.manual_seed(seed)  # dropout draws the same numbers in every run
    return model(**inputs).loss
