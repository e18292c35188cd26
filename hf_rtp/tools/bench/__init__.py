"""Measurements, side by side with DDP, FSDP2 and transformers' tensor parallelism: `main(argv)` is
`hf-rtp bench` (a list of its command-line arguments; returns the results it writes as results.json)."""

from .run import main

__all__ = ["main"]
