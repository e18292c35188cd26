"""Plan registry keyed by `config.model_type`."""

from __future__ import annotations

from .base import Plan, PlanError, Resolution
from .llama import LLAMA

_REGISTRY: dict[str, Plan] = {"llama": LLAMA}


class UnsupportedModelError(PlanError):
    """No plan is registered for this model_type."""


def supported() -> list[str]:
    return sorted(_REGISTRY)


def get(model_type: str) -> Plan:
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"hf_rtp has no plan for model_type '{model_type}'. Supported: {', '.join(supported())}."
        ) from None


__all__ = ["Plan", "PlanError", "Resolution", "UnsupportedModelError", "get", "supported"]
