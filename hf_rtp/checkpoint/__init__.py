"""Checkpoint I/O: safetensors slices in, standard Hugging Face files out."""

from .safetensors_io import CheckpointError

__all__ = ["CheckpointError"]
