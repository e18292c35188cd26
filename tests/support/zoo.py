"""Tiny configs of the causal-LM families people fine-tune, each with its family's quirks switched on.

Shared: a prime vocabulary (uneven vocabulary chunks at any world size), 2 layers, grouped-query
attention where the family has it. Checkpoints are written by vanilla `save_pretrained`, so they are
in the layout transformers writes (per-expert tensors for the MoE families, `embed_out` for GPT-NeoX).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .models import VOCAB

_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# 5 experts: uneven expert groups at 2 and 3 ranks; the decoder plan's MoE settings
_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24)

ZOO: dict[str, tuple[str, dict]] = {
    # name: (model_type, overrides) -- the quirk each one brings is in the comment
    "llama": ("llama", dict(tie_word_embeddings=False)),  # GQA, RMSNorm, SwiGLU
    "mistral": ("mistral", dict(sliding_window=4)),  # sliding-window attention shorter than the batch
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),  # q/k/v biases, tied head
    "qwen3": ("qwen3", dict(head_dim=16)),  # q/k RMSNorm, head_dim != hidden/heads
    "qwen2_moe": (
        "qwen2_moe",
        dict(_MOE, shared_expert_intermediate_size=20, decoder_sparse_step=1, output_router_logits=True),
    ),  # shared expert with a sigmoid gate
    "qwen3_moe": ("qwen3_moe", dict(_MOE, head_dim=8, output_router_logits=True)),
    "mixtral": (
        "mixtral",
        dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=24, output_router_logits=True),
    ),
    "gemma": ("gemma", dict(head_dim=8)),  # scaled embedding, tied head, GeGLU
    "gemma2": (
        "gemma2",
        dict(head_dim=8, sliding_window=4, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    ),  # logit soft-capping, 4 norms per layer
    "gemma3_text": ("gemma3_text", dict(head_dim=8, sliding_window=4, final_logit_softcapping=30.0)),
    "phi3": ("phi3", dict(tie_word_embeddings=False)),  # fused qkv_proj and gate_up_proj
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            n_routed_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,
        ),
    ),  # MLA, shared experts, dense first
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=5,
            num_experts_per_tok=2,
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),  # transposed biased experts, sinks
    "gpt2": (
        "gpt2",
        dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),  # Conv1D, learned positions, tied
    "gpt_neox": ("gpt_neox", dict(rotary_pct=0.5, use_parallel_residual=True, tie_word_embeddings=False)),  # embed_out
    "olmo2": ("olmo2", {}),  # norms after attention and MLP, q/k norm over all heads
    "granite": (
        "granite",
        dict(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.2),
    ),  # multipliers
    "cohere": ("cohere", dict(logit_scale=0.5, use_qk_norm=False)),  # LayerNorm, parallel block, scaled logits
    "starcoder2": ("starcoder2", dict(use_bias=True, sliding_window=4)),  # biases, LayerNorm, GELU MLP
    "stablelm": ("stablelm", dict(partial_rotary_factor=0.25, use_qkv_bias=True)),  # partial rotary
    "phi": ("phi", dict(partial_rotary_factor=0.5)),  # dense + fc1/fc2, parallel block, biased head
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0])),  # NoPE layers
    "olmoe": ("olmoe", dict(num_experts=5, num_experts_per_tok=2)),  # MoE without shared experts, q/k norm
    # FalconLinear writes a plain linear out in its own forward: the linear kind adapts it by its exact code
    "falcon": ("falcon", dict(num_kv_heads=4, parallel_attn=True, bias=False)),
}
# the subset also run at 3 ranks (uneven expert groups, empty chunks): one of each mechanism
AT_THREE = ("llama", "qwen2", "qwen2_moe", "gemma2", "phi3", "deepseek_v3", "gpt_oss", "gpt2", "gpt_neox")
# what loads through plan="auto" (no registered plan)
AUTO = ("gpt_neox", "olmo2", "granite", "cohere", "starcoder2", "stablelm", "phi", "smollm3", "olmoe", "falcon")


def zoo_config(name: str):
    model_type, overrides = ZOO[name]
    settings = dict(_BASE)
    if model_type == "gpt2":
        settings = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    return AutoConfig.for_model(model_type, **{**settings, **overrides})


def make_zoo_checkpoint(name: str, path, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """A randomly initialised tiny model of the family, saved by vanilla save_pretrained."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(zoo_config(name), dtype=dtype)
    with torch.no_grad():  # some inits leave zeros (biases, norms, sinks): make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        for module in model.modules():  # and the buffers it stores (DeepSeek-V3's routing bias)
            for key, b in module._buffers.items():
                if b is not None and b.is_floating_point() and key not in module._non_persistent_buffers_set:
                    b.add_(torch.randn_like(b) * 0.5)  # large enough to change which experts are chosen
    model.save_pretrained(path)
    return str(path)
