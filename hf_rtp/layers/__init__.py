"""Rotated ops, one file each; `LAYERS` maps a plan's layer kind to its module and the vanilla type it replaces."""

from torch import nn

from .embedding import RotatedEmbedding
from .linear import RotatedLinear

LAYERS: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {
    "linear": (nn.Linear, RotatedLinear),
    "embedding": (nn.Embedding, RotatedEmbedding),
}

__all__ = ["LAYERS", "RotatedEmbedding", "RotatedLinear"]
