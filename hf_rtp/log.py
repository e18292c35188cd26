"""Rank-0-only logging and progress bars, following transformers' verbosity switches."""

from __future__ import annotations

import logging

import torch.distributed as dist
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

logger = logging.getLogger("hf_rtp")


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def info(message: str) -> None:
    if is_rank0():
        logger.info(message)


def warning(message: str) -> None:
    if is_rank0():
        logger.warning(message)


def progress(iterable, desc: str, total: int | None = None):
    """A tqdm bar on rank 0 only, silenced like transformers' own (disable_progress_bar())."""
    enabled = is_rank0() and hf_logging.is_progress_bar_enabled()
    return tqdm(iterable, desc=desc, total=total, disable=not enabled)
