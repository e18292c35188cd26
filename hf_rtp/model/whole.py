"""A plain transformers copy of a rotated model with every weight whole: for a generation phase.

Decoding walks every rotated weight around the ring once per new token, whatever the batch, so at
small batches it runs far below a whole model's speed (docs/benchmarks.md, "Decoding"). When the whole model fits
beside the rotated one, a phase that mostly decodes can run on this copy instead, at data-parallel
speed and with no communication per token, then drop it. Each rank builds its own copy; weights are
gathered one tensor at a time, so the peak is the copy plus one tensor in the source's dtype.
"""

from __future__ import annotations

import copy

import torch
from accelerate import init_empty_weights
from transformers import PreTrainedModel

from .. import log
from ..distributed.tensors.rotated import RotatedTensor
from ..errors import RotatedStateError
from .state import rotated_module, state_of


def whole_model(model: PreTrainedModel, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A vanilla transformers model of `model`'s class with every weight whole, in eval mode. Collective.

    `dtype` (e.g. torch.bfloat16) halves the copy of float32 weights. The copy shares nothing with
    `model`: training it does not train `model`; refresh it after optimizer steps by calling again.
    """
    state = state_of(model)
    base = rotated_module(model)
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        raise RotatedStateError(
            "hf_rtp.whole_model: this model's base is 4-bit or 8-bit (quantization_config), which a vanilla copy would "
            "have to re-quantize whole on every rank. Generate on the ring (model.generate), or load the checkpoint "
            "with transformers' from_pretrained(quantization_config=...) and your adapter for a decode-heavy phase"
        )
    config = copy.deepcopy(model.config)
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers (rotary) computed for real
        whole = type(model)(config)
    tensors, gathered = {}, {}
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) not in gathered:  # a tied weight is gathered once, under its first name
                value = param.full_tensor() if isinstance(param, RotatedTensor) else param
                gathered[id(param)] = value.detach().to(dtype=dtype or value.dtype, copy=True)
            tensors[name] = gathered[id(param)]
    whole.load_state_dict(tensors, strict=False, assign=True)
    whole.tie_weights()
    for name, buffer in model.named_buffers():  # persistent or not (rotary frequencies, Gemma's embed_scale)
        # the model's own tensor, copied, not its values into the copy's: those were made in torch's default dtype,
        # and a float64 model's embed_scale would be rounded to float32
        owner, _, leaf = name.rpartition(".")
        setattr(whole.get_submodule(owner), leaf, buffer.detach().clone())
    missing = [n for n, p in whole.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"hf_rtp.whole_model: no weights for {', '.join(missing[:5])}")
    whole.to(state.topology.device)
    if getattr(model, "generation_config", None) is not None:
        whole.generation_config = copy.deepcopy(model.generation_config)
    size = sum(p.numel() * p.element_size() for p in whole.parameters())
    log.info(f"hf_rtp.whole_model: a whole copy of {type(model).__name__} on every rank, {size / 1e9:.2f} GB each")
    return whole.eval()
