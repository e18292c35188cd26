"""Checkpoint I/O: safetensors slices in, standard Hugging Face files out."""

from ..errors import CheckpointError

__all__ = ["CheckpointError"]
