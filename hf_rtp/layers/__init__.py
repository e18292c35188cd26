"""Rotated ops, one file each, and the kinds a plan names them by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers.pytorch_utils import Conv1D

from .conv1d import RotatedConv1D
from .embedding import RotatedEmbedding, embedding_refusal
from .experts import RotatedExperts, experts_refusal
from .linear import RotatedLinear, linear_refusal


@dataclass(frozen=True)
class LayerKind:
    refusal: Callable[[nn.Module], str | None]
    """why this kind cannot reproduce a module's forward exactly; None when it can"""
    rotated: type[RotatedLinear | RotatedEmbedding | RotatedConv1D | RotatedExperts]
    rotated_leaves: tuple[str, ...]
    """parameters cut along dim 0; the module's other parameters stay replicated (Conv1D's bias)"""
    replaces: str
    """what it rotates, for error messages"""


def _plain(base: type[nn.Module]) -> Callable[[nn.Module], str | None]:
    """Instances of `base` whose class keeps base's forward: a subclass with its own math is refused."""

    def refusal(module: nn.Module) -> str | None:
        if not isinstance(module, base):
            return f"it is not a {base.__name__}"
        if type(module).forward is not base.forward:
            return f"{type(module).__name__} overrides {base.__name__}.forward, which hf_rtp does not reproduce"
        return None

    return refusal


LAYERS: dict[str, LayerKind] = {
    "linear": LayerKind(linear_refusal, RotatedLinear, ("weight", "bias"), "nn.Linear"),
    "embedding": LayerKind(embedding_refusal, RotatedEmbedding, ("weight",), "nn.Embedding"),
    "conv1d": LayerKind(_plain(Conv1D), RotatedConv1D, ("weight",), "transformers Conv1D"),
    "experts": LayerKind(
        experts_refusal,
        RotatedExperts,
        ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"),
        "fused experts declared through transformers' use_experts_implementation",
    ),
}

__all__ = ["LAYERS", "LayerKind", "RotatedConv1D", "RotatedEmbedding", "RotatedExperts", "RotatedLinear"]
