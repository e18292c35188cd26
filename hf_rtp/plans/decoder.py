"""The Llama-shaped decoders (Llama, Mistral, Qwen 2/2.5/3 and their MoE, Gemma 1/2/3, Phi-3,
DeepSeek-V3, Mixtral, gpt-oss): one plan, because they share one module layout under `model.`.

Every projection (`*_proj`: q/k/v/o, Phi-3's fused qkv_proj and gate_up_proj, DeepSeek's MLA
q_a/q_b/kv_a/kv_b, shared experts), the embedding and the LM head rotate as linear layers; fused
experts rotate in expert groups; norms, routers and attention sinks stay whole. A family whose
module differs from what its kind reproduces exactly (a Linear subclass with its own forward, say)
is refused at load with the module's name, never rotated with other math.
"""

from __future__ import annotations

from .base import Plan

_ROTATE = {
    "model.embed_tokens": "embedding",
    "model.layers.*.self_attn.*_proj*": "linear",  # and DeepSeek's kv_a_proj_with_mqa
    "model.layers.*.mlp.*_proj": "linear",  # dense MLPs and shared experts
    "model.layers.*.mlp.experts": "experts",
    "lm_head": "linear",
}
_REPLICATE = (
    "model.layers.*norm.*",  # input/post-attention/pre-/post-feedforward norms, q/k norms, MLA norms
    "model.norm.*",
    "model.layers.*.mlp.gate.*",  # routers (weight; DeepSeek's e_score_correction_bias)
    "model.layers.*.mlp.router.*",  # gpt-oss's router
    "model.layers.*.mlp.shared_expert_gate.weight",  # Qwen-MoE: one output, a gate on the shared expert
    "model.layers.*.self_attn.sinks",  # gpt-oss's attention sinks, one per head
    "score.*",  # sequence/token classification heads: num_labels rows of hidden_size
)

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "deepseek_v3",
    "gpt_oss",
)


def decoder_plan(name: str) -> Plan:
    return Plan(name=name, rotate=dict(_ROTATE), replicate=_REPLICATE)


# Image-text-to-text models whose language model is such a decoder under `model.language_model.`: the
# language model and the head rotate as above; the vision tower (a small share of the parameters, run once
# per image) and its projector stay whole on every rank.
VISION_LANGUAGE = {"qwen2_vl": ("model.visual.*",), "qwen2_5_vl": ("model.visual.*",)}


def vision_language_plan(name: str) -> Plan:
    inner = "model.language_model."
    rotate = {(k if k == "lm_head" else inner + k.removeprefix("model.")): v for k, v in _ROTATE.items()}
    replicate = tuple(inner + p.removeprefix("model.") for p in _REPLICATE if p.startswith("model."))
    return Plan(name=name, rotate=rotate, replicate=replicate + VISION_LANGUAGE[name])
