"""Rotated ops, one file each, and the kinds a plan names them by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from transformers.pytorch_utils import Conv1D

from .conv1d import RotatedConv1D
from .embedding import RotatedEmbedding
from .experts import RotatedExperts, is_fused_experts
from .linear import RotatedLinear


@dataclass(frozen=True)
class LayerKind:
    fits: Callable[[nn.Module], bool]
    rotated: type[nn.Module]
    rotated_leaves: tuple[str, ...]
    """parameters cut along dim 0; the module's other parameters stay replicated (Conv1D's bias)"""
    replaces: str
    """what it rotates, for error messages"""


LAYERS: dict[str, LayerKind] = {
    "linear": LayerKind(lambda m: isinstance(m, nn.Linear), RotatedLinear, ("weight", "bias"), "nn.Linear"),
    "embedding": LayerKind(lambda m: isinstance(m, nn.Embedding), RotatedEmbedding, ("weight",), "nn.Embedding"),
    "conv1d": LayerKind(lambda m: isinstance(m, Conv1D), RotatedConv1D, ("weight",), "transformers Conv1D"),
    "experts": LayerKind(
        is_fused_experts, RotatedExperts, ("gate_up_proj", "down_proj"), "fused experts (gate_up_proj, down_proj)"
    ),
}

__all__ = ["LAYERS", "LayerKind", "RotatedConv1D", "RotatedEmbedding", "RotatedExperts", "RotatedLinear"]
