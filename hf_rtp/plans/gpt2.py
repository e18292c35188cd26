"""GPT-2: Conv1D projections rotate by input features (summed partials), so the fused c_attn needs
no q/k/v split; wte and the tied lm_head rotate by vocabulary; norms, Conv1D biases and wpe stay whole.

wpe is replicated on purpose: it is 0.6% of GPT-2 small (1024 x 768) and is looked up by position,
so rotating it would add two latency-bound ring walks per step to save almost no memory.
The original openai-community/gpt2 files store the base model's names (no "transformer."): they
load through transformers' base-model prefix rule, as in vanilla.
"""

from .base import Plan

GPT2 = Plan(
    name="gpt2",
    rotate={
        "transformer.wte": "embedding",
        "transformer.h.*.attn.c_attn": "conv1d",
        "transformer.h.*.attn.c_proj": "conv1d",
        "transformer.h.*.mlp.c_fc": "conv1d",
        "transformer.h.*.mlp.c_proj": "conv1d",
        "lm_head": "linear",
    },
    replicate=(
        "transformer.wpe.weight",
        "transformer.h.*.ln_1.*",
        "transformer.h.*.ln_2.*",
        "transformer.ln_f.*",
        "score.*",  # sequence classification's head, and token classification's below: num_labels rows
        "classifier.*",
    ),
)
