"""Model configs the benchmark can make locally (random weights, nothing downloaded)."""

from __future__ import annotations

import os
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # The issue-5 setup: ~87M parameters, where docs/benchmarks.md measures the targets.
    "llama-90m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
    # ~13M parameters: big enough that model states dominate, small enough for a notebook on a CPU.
    "llama-small": dict(
        vocab_size=8000,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    # Real fine-tuning's vocabulary (Llama 3's 128256) on a small body, untied, ~144M parameters: at
    # 1024+ tokens per sequence the LM head and its loss dominate the memory, as in practice.
    "llama-128k": dict(
        vocab_size=128256,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-1B's shape (meta-llama/Llama-3.2-1B's config.json: 16 layers 2048 wide, 32 heads over 8 KV heads,
    # head 64, MLP 8192, Llama 3's 128256-token vocabulary, head tied to the embeddings, rope theta 500000), ~1.24B
    # parameters with random weights: the size users fine-tune (issue 66, .ci/gpu-speed). Its llama3 rope scaling
    # is left out: it changes no shape, no parameter and no cost at the bench's lengths.
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Small enough for a test to run every strategy in seconds.
    "llama-tiny": dict(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    ),
}


def make_preset(name: str, directory: str) -> str:
    """Write the preset's checkpoint to `directory` (once) and return the directory."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or pass --checkpoint")
    if not os.path.exists(os.path.join(directory, "config.json")):
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**PRESETS[name], dtype="float32"))
        model.save_pretrained(directory)
    return directory
