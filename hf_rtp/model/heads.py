"""Which transformers model classes hf_rtp loads, and the heads a checkpoint does not hold yet.

A causal LM's backbone is what every head shares; the heads people fine-tune on it (a reward model's
or classifier's `score`, a token classifier's `classifier`) are a few rows of `hidden_size`, so plans
replicate them. Loading a causal LM's checkpoint into such a class leaves the head to initialise, as
vanilla does: here on rank 0 with vanilla's `_init_weights` and then sent to every rank, which is what
DDP does with any replicated parameter at construction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM_TYPES,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT_TO_TEXT_TYPES,
)

from .. import log
from ..errors import UnsupportedModelError
from ..private.transformers_names import init_weights

# the auto classes hf_rtp loads
SUPPORTED = (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoModelForImageTextToText,
)
# architectures whose checkpoints are not causal LMs, by suffix, and what loads them in hf_rtp
_OTHER_HEADS = {
    "ForSequenceClassification": "hf_rtp.AutoModelForSequenceClassification",
    "ForTokenClassification": "hf_rtp.AutoModelForTokenClassification",
    "ForQuestionAnswering": None,
}


def model_class(auto_class, config):
    """The auto class to build `config` with: `auto_class` when hf_rtp supports it (default: causal LM).
    A causal LM asked of a checkpoint saved as another head fails here, naming what loads it."""
    if auto_class is None:
        stored = next(iter(getattr(config, "architectures", None) or []), "")
        for suffix, loader in _OTHER_HEADS.items():
            if stored.endswith(suffix):
                how = (
                    f"load it with {loader}.from_pretrained(...)" if loader else f"hf_rtp does not load {suffix} heads"
                )
                raise UnsupportedModelError(
                    f"this checkpoint is a {stored} (config.architectures), not a causal LM: {how}. "
                    f"Supported classes: {supported_names()}"
                )
        model_type = getattr(config, "model_type", None)
        if model_type not in CAUSAL_LM_TYPES and model_type in IMAGE_TEXT_TO_TEXT_TYPES:
            raise UnsupportedModelError(  # vanilla's AutoModelForCausalLM fails later, naming no class that loads it
                f"this checkpoint's model_type {model_type!r} has no causal-LM class in transformers: load it with "
                "hf_rtp.AutoModelForImageTextToText.from_pretrained(...) (the language model rotated, the vision "
                f"tower whole). Supported classes: {supported_names()}"
            )
        return AutoModelForCausalLM
    if auto_class not in SUPPORTED:
        raise UnsupportedModelError(
            f"hf_rtp does not load {getattr(auto_class, '__name__', auto_class)}; supported classes: "
            f"{supported_names()}"
        )
    return auto_class


def supported_names() -> str:
    return ", ".join(c.__name__ for c in SUPPORTED)


def is_causal_lm(model: nn.Module) -> bool:
    """Built by AutoModelForCausalLM (some families' class for it is ...ForConditionalGeneration)."""
    return not any(type(model).__name__.endswith(suffix) for suffix in _OTHER_HEADS)


def fresh_head(model: nn.Module, missing: list[str], rotated: set[str]) -> list[str]:
    """Of the parameters the checkpoint lacks, those vanilla initialises as a new head: outside the base
    model, replicated, on a model that is not a causal LM. Empty when any lacking one is not such (the
    load then fails naming them all)."""
    prefix = f"{model.base_model_prefix}."
    if is_causal_lm(model) or not missing:
        return []
    if any(name.startswith(prefix) or name in rotated for name in missing):
        return []
    return missing


def initialise_head(
    model: PreTrainedModel, names: list[str], dtype: torch.dtype, device: torch.device, control
) -> None:
    """Collective. Vanilla's initialisation of `names` (meta parameters) on rank 0, sent to every rank."""
    log.warning(
        f"Some weights of {type(model).__name__} were not initialized from the model checkpoint and are newly "
        f"initialized: {names}. You should probably TRAIN this model on a down-stream task to be able to use it "
        "for predictions and inference."
    )
    owners = {name.rpartition(".")[0] for name in names}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        meta = model.get_parameter(name)
        setattr(model.get_submodule(owner), leaf, nn.Parameter(torch.empty(meta.shape, dtype=dtype)))
    with torch.no_grad():
        for owner in sorted(owners):
            init_weights(model, model.get_submodule(owner))
        for name in names:
            param = model.get_parameter(name)
            if control is not None:
                dist.broadcast(param.data, src=0, group=control)
            param.data = param.data.to(device)
