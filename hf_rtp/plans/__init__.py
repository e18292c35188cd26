"""Plan registry keyed by `config.model_type`, user registration, and the opt-in automatic plan."""

from __future__ import annotations

from ..errors import KeywordError, PlanError, UnsupportedModelError
from .base import Plan, Resolution
from .decoder import FAMILIES, VISION_LANGUAGE, decoder_plan, vision_language_plan
from .gpt2 import GPT2

_REGISTRY: dict[str, Plan] = {
    "gpt2": GPT2,
    **{family: decoder_plan(family) for family in FAMILIES},
    **{family: vision_language_plan(family) for family in VISION_LANGUAGE},
}


def supported() -> list[str]:
    return sorted(_REGISTRY)


def register(model_type: str, plan: Plan, *, overwrite: bool = False) -> None:
    """Make `plan` the one hf_rtp uses for checkpoints whose config.model_type is `model_type`."""
    if not isinstance(plan, Plan):
        raise KeywordError(f"register() needs an hf_rtp.plans.Plan, got {type(plan).__name__}")
    if model_type in _REGISTRY and not overwrite:
        raise PlanError(f"a plan for '{model_type}' is registered already; pass overwrite=True to replace it")
    _REGISTRY[model_type] = plan


def get(model_type: str) -> Plan:
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"hf_rtp has no plan for model_type '{model_type}'. Supported: {', '.join(supported())}. "
            "Register one with hf_rtp.plans.register(), pass plan=Plan(...), or try plan='auto'."
        ) from None


__all__ = ["Plan", "PlanError", "Resolution", "UnsupportedModelError", "get", "register", "supported"]
