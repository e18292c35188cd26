"""Llama: every projection, the embeddings and the LM head rotate; the RMSNorms stay whole."""

from .base import Plan

LLAMA = Plan(
    name="llama",
    rotate={
        "model.embed_tokens": "embedding",
        "model.layers.*.self_attn.[qkvo]_proj": "linear",
        "model.layers.*.mlp.gate_proj": "linear",
        "model.layers.*.mlp.up_proj": "linear",
        "model.layers.*.mlp.down_proj": "linear",
        "lm_head": "linear",
    },
    replicate=(
        "model.layers.*.input_layernorm.weight",
        "model.layers.*.post_attention_layernorm.weight",
        "model.norm.weight",
    ),
)
