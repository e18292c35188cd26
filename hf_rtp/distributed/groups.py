"""hf_rtp's own process groups: made once per role and set of ranks, torn down before the world's.

hf_rtp never communicates on the world group: whoever made that (accelerate and Trainer give it
30 minutes), every collective hf_rtp issues runs on a group of its own carrying hf_rtp's timeout.
"""

from __future__ import annotations

import atexit
import contextlib
from datetime import timedelta

import torch.distributed as dist

_groups: dict[tuple, dist.ProcessGroup] = {}


def group(role: str, ranks: tuple, backend: str, timeout: timedelta) -> dist.ProcessGroup:
    """The group of `ranks` for `role`, made on first use (new_group is collective over the world:
    every rank must ask for every group in one order)."""
    key = (role, ranks, backend, timeout, id(dist.group.WORLD))
    if key not in _groups:
        if not _groups:
            atexit.register(_destroy_groups)
        _groups[key] = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout)
    return _groups[key]


def _destroy_groups() -> None:
    """Tear hf_rtp's groups down while the world group still exists: left to interpreter shutdown,
    a gloo group can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        for made in _groups.values():
            with contextlib.suppress(RuntimeError, ValueError):  # the user destroyed everything already
                dist.destroy_process_group(made)
    _groups.clear()
