"""transformers' private names hf_rtp uses (DESIGN.md, "Private names"). The Trainer methods hf_rtp
replaces are checked, with their signatures, where it replaces them (integrations/trainer.py), against
the same TESTED bounds."""

from __future__ import annotations

from typing import Any

import transformers

from .gate import check_version, lookup

TESTED = ">=5.23,<5.25"  # pyproject.toml's lower bound; newer releases are warned about (gate.py)


def _get(owner: Any, name: str) -> Any:
    return lookup(owner, name, "transformers", transformers.__version__, TESTED)


def check_trainer_methods_version() -> None:
    """The gate for the Trainer methods integrations/trainer.py replaces (their signatures are checked there)."""
    check_version(
        "transformers", transformers.__version__, TESTED, "Trainer methods (save_model, _load_best_model, ...)"
    )


def init_weights(model: Any, module: Any) -> None:
    """Vanilla's initialisation of `module`, as from_pretrained runs it for weights a checkpoint lacks."""
    _get(model, "_init_weights")(module)


def resized_embeddings(model: Any, embedding: Any, *args: Any, **kwargs: Any) -> Any:
    """What resize_token_embeddings builds for the input embedding (its random draws included)."""
    return _get(model, "_get_resized_embeddings")(embedding, *args, **kwargs)


def resized_lm_head(model: Any, head: Any, *args: Any, **kwargs: Any) -> Any:
    """What resize_token_embeddings builds for an untied LM head."""
    return _get(model, "_get_resized_lm_head")(head, *args, **kwargs)


def own_loss_function(model: Any) -> Any:
    """The loss function set on this model instance (by hf_rtp or its user), None if it uses its class's."""
    _get(type(model), "loss_function")  # the property that stores an instance's own in `_loss_function`
    return model.__dict__.get("_loss_function")


def experts_gate(experts: Any) -> Any:
    """A fused experts module's gate, bound: act(gate) * up, or gpt-oss's clamped GLU."""
    return _get(experts, "_apply_gate")


def attention_implementation(config: Any) -> str:
    return _get(config, "_attn_implementation")


def set_attention_implementation(config: Any, name: str) -> None:
    _get(config, "_attn_implementation")
    config._attn_implementation = name


def float32_patterns(model: Any, dtype: Any) -> list[str]:
    """The parameter patterns vanilla's from_pretrained keeps in float32 when loading in `dtype`
    (`PreTrainedModel._get_dtype_plan`'s rule): `_keep_in_fp32_modules` under float16, `_keep_in_fp32_modules_strict`
    under float16 and bfloat16; each matched as vanilla matches it, `*` any text, anywhere in the name."""
    import torch

    patterns = []
    if dtype == torch.float16:
        patterns += list(keep_in_fp32_modules(model) or ())
    if dtype in (torch.float16, torch.bfloat16):
        _get(type(model), "_keep_in_fp32_modules_strict")
        patterns += list(model._keep_in_fp32_modules_strict or ())
    return patterns


def no_split_modules(model: Any) -> tuple[str, ...]:
    """The module classes transformers never splits across devices (LlamaDecoderLayer, GPT2Block, ...)."""
    return tuple(getattr(model, "_no_split_modules", None) or ())


def keep_in_fp32_modules(model: Any) -> Any:
    """The modules a model class keeps in float32, which transformers' quantizers never convert."""
    _get(type(model), "_keep_in_fp32_modules")
    return model._keep_in_fp32_modules


def supports_sdpa(model: Any) -> bool:
    """Whether transformers offers SDPA attention for the model's class (`_supports_sdpa`)."""
    return bool(_get(type(model), "_supports_sdpa"))
