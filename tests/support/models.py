"""Tiny checkpoints made locally with vanilla transformers (nothing is downloaded)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 101  # prime: no world size divides it, so vocabulary chunks are uneven


def tiny_llama_config(tied: bool = False, **overrides) -> LlamaConfig:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def make_tiny_llama(path, tied: bool = False, max_shard_size: str = "50GB", seed: int = 0, **overrides) -> str:
    """Save a randomly initialised tiny Llama to `path` (several files when max_shard_size is small)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(tied, **overrides), dtype=torch.float32)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return str(path)


def global_batch(world_size: int, batch: int = 2, seq: int = 9, seed: int = 1) -> torch.Tensor:
    """[world_size, batch, seq] token ids: rank r trains on [r], the vanilla reference on all of them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (world_size, batch, seq), generator=gen)
