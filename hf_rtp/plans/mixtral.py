"""Mixtral: attention as in Llama; the fused experts rotate in expert groups; the router stays whole.

transformers >= 5 holds experts fused (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]);
Hub checkpoints and transformers' own save_pretrained store one tensor per expert under
block_sparse_moe. Both load by slices (a rank reads only its experts); saving writes the names
the checkpoint had.
"""

from ..checkpoint.formats import PerExpert, Renamed
from .base import Plan
from .llama import LLAMA

_EXPERTS = ".block_sparse_moe.experts.{expert}"

MIXTRAL = Plan(
    name="mixtral",
    rotate={
        "model.embed_tokens": "embedding",
        "model.layers.*.self_attn.[qkvo]_proj": "linear",
        "model.layers.*.mlp.experts": "experts",
        "lm_head": "linear",
    },
    replicate=(*LLAMA.replicate, "model.layers.*.mlp.gate.weight"),
    stored_formats=(
        (
            PerExpert(".mlp.experts.gate_up_proj", (f"{_EXPERTS}.w1.weight", f"{_EXPERTS}.w3.weight")),
            PerExpert(".mlp.experts.down_proj", (f"{_EXPERTS}.w2.weight",)),
            Renamed(".mlp.gate.", ".block_sparse_moe.gate."),
        ),
    ),
)
