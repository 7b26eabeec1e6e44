"""``python -m benchmarks.hf``: step time of small Hugging Face models, tracedac against
transformers' own checkpointing (torch's ``checkpoint``) and no checkpointing.

Each architecture is built from a small config (random weights: nothing is downloaded) three
times with the same weights: plain, with ``activation_checkpointing_enable()`` (torch's
checkpoint, as transformers runs it) and with ``tracedac.integrations.hf.enable`` (default
policy ``recompute_all()``). A step is forward and backward of the language-model loss on a
fixed batch; the three variants take turns (``child.time_in_turns``) and the median is
reported, with tracedac's ratio to torch's checkpoint. Timings only: memory and gradients
are the tests' (tests/integrations/test_hf.py), which build the same architectures with
builders of their own (tests/support/hf_models.py: the benchmarks import no test).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .child import Progress, clear_grads, table, time_in_turns

__all__ = ["ARCHITECTURES", "batch", "build", "lm_loss", "main"]

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


def lm_loss(model, inputs: dict, seed: int = 2) -> torch.Tensor:
    torch.manual_seed(seed)  # dropout draws the same numbers in every run
    return model(**inputs).loss


def _variants(kind: str, hidden: int, layers: int) -> dict:
    from tracedac.integrations import hf

    models = {name: build(kind, hidden=hidden, layers=layers) for name in ("none", "torch", "tracedac")}
    models["torch"].activation_checkpointing_enable()
    hf.enable(models["tracedac"])
    return models


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--kinds", default=",".join(ARCHITECTURES), help="architectures, comma-separated (%(default)s)"
    )
    p.add_argument("--hidden", type=int, default=128, help="hidden size (%(default)s)")
    p.add_argument("--layers", type=int, default=4, help="layers (%(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (%(default)s)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (%(default)s)")
    p.add_argument(
        "--steps", type=int, default=10, help="timed steps per variant, after two untimed (%(default)s)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    import warnings

    from transformers import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    say = Progress(None if args.quiet else sys.stderr)
    inputs = batch(args.batch, args.seq)
    rows = []
    for kind in args.kinds.split(","):
        models = _variants(kind, args.hidden, args.layers)

        def step(name, rep):
            model = models[name]
            start = time.perf_counter()
            lm_loss(model, inputs).backward()
            elapsed = time.perf_counter() - start
            clear_grads(model)
            return elapsed

        for name in models:  # untimed: caches, the first plan
            step(name, 0), step(name, 0)
        times = time_in_turns(list(models), args.steps, step, say, kind)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append(
            [kind, *(f"{med[n] * 1e3:.1f}" for n in models), f"{med['tracedac'] / med['torch']:.2f}x"]
        )
        say(f"{kind}: medians (ms) " + ", ".join(f"{n} {med[n] * 1e3:.1f}" for n in models))
    print(
        f"step time, median of {args.steps} (ms): hidden {args.hidden}, {args.layers} layers, "
        f"{args.batch} x {args.seq} tokens, CPU threads {torch.get_num_threads()}"
    )
    print("\n".join(table(["model", "none", "torch checkpoint", "tracedac", "tracedac / torch"], rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
