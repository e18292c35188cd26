"""Each rank's random number generators, recorded at a save and restored at a load at the same world size."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_rng(group) -> list[dict]:
    """Collective: every rank's CPU (and CUDA) generator state, in rank order."""
    mine = {"cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state().tolist()
    if not dist.is_initialized():
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def restore_rng(rng: list[dict[str, Any]], world_size: int) -> None:
    """This rank's generators as the same rank's were saved; at another world size the old per-rank streams mean
    nothing, and the generators are left as they are."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world_size == world:
        torch.set_rng_state(torch.tensor(rng[rank]["cpu"], dtype=torch.uint8))
        if torch.cuda.is_available() and rng[rank].get("cuda") is not None:
            torch.cuda.set_rng_state(torch.tensor(rng[rank]["cuda"], dtype=torch.uint8))
