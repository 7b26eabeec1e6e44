"""The benchmarks' models at test sizes: the Llama-style decoder (``benchmarks/llama.py``) and
the GPT with a Mixture-of-Experts feed-forward (``benchmarks/model.py``), each with a batch."""

from benchmarks.llama import DecoderLayer, Llama, LlamaConfig
from benchmarks.model import GPT, Block, Config, make_batch

__all__ = ["GPT", "Block", "Config", "DecoderLayer", "Llama", "LlamaConfig", "llama", "moe"]


def llama(layers: int = 3, dim: int = 64, seq: int = 64, batch: int = 2):
    """A seeded small Llama and a batch of token ids with next-token targets."""
    cfg = LlamaConfig(layers=layers, dim=dim, heads=4, mlp_hidden=3 * dim, batch=batch, seq=seq, vocab=256)
    return Llama.seeded(cfg), make_batch(cfg)


def moe(layers: int = 3, dim: int = 64, seq: int = 32, batch: int = 2):
    """A seeded small MoE GPT (data-dependent expert shapes, dropout) and a batch."""
    cfg = Config(
        layers=layers,
        dim=dim,
        heads=4,
        experts=4,
        top_k=2,
        expert_hidden=2 * dim,
        batch=batch,
        seq=seq,
        vocab=256,
    )
    return GPT.seeded(cfg), make_batch(cfg)
