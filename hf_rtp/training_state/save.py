"""save_training_state: every rank's chunks written by DCP into `<dir>.partial`, training_state.json last,
and the folder swapped in atomically."""

from __future__ import annotations

import json
import os

import torch.distributed as dist
from torch import nn

from .. import faults
from ..distributed.ranks.agreement import agreed
from ..errors import CheckpointError, KeywordError
from ..folders.ownership import FolderLock
from .dcp_io import control_group, named_waits, scalars, tensors, write_tensors
from .folder import StateFolder, normalised
from .metadata import Identity, TrainingStateMetadata, write_state
from .rng import gather_rng
from .tensor_json import to_json


def save_training_state(directory: str, model: nn.Module, optimizer, scheduler=None, extra: dict | None = None) -> None:
    """Collective. Write model, optimizer, scheduler, RNG and `extra` (step, data position) to `directory`.

    `directory` must be absent, empty, or a training state hf_rtp saved: a folder holding anything
    else, a file or a link is refused untouched. Every rank writes its chunks into
    `<directory>.partial`; rank 0 then records what was written (each file and its size, the model
    class and plan) in training_state.json, last, and swaps the folder in atomically (see
    folders/atomic.py). A crash at any point leaves the previous checkpoint loadable. `extra` must be
    JSON: it is kept apart from hf_rtp's own records, and load_training_state returns it as it was given.
    """
    target = StateFolder(normalised(directory))  # folders/storage.py's steps, on rank 0
    directory, partial = target.directory, target.partial
    rank = dist.get_rank() if dist.is_initialized() else 0
    group = control_group(model)
    held: FolderLock | None = None
    try:
        with agreed(group, CheckpointError):
            if rank == 0:
                _check_extra(extra)
                held = target.lock()
                target.stage()
        _, optim_sd, flat = tensors(model, optimizer)
        with named_waits("save_training_state", directory):
            write_tensors(flat, partial, group)
            faults.point("state.write")
            rng = gather_rng(group)
        with agreed(group, CheckpointError):
            if rank == 0:
                files = {f: os.path.getsize(os.path.join(partial, f)) for f in sorted(os.listdir(partial))}
                state = TrainingStateMetadata(
                    identity=Identity.of(model),
                    files=files,
                    param_groups=to_json(optim_sd["param_groups"]),
                    scalars=scalars(optim_sd),
                    scheduler=to_json(scheduler.state_dict()) if scheduler is not None else None,
                    rng=rng,
                    world_size=dist.get_world_size() if dist.is_initialized() else 1,
                    extra=dict(extra or {}),
                )
                write_state(partial, state)
                target.commit(partial)
    finally:
        if held is not None:
            held.release()


def _check_extra(extra) -> None:
    if extra is None:
        return
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise KeywordError(f"extra must be a dict with string keys, got {type(extra).__name__}")
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise KeywordError(f"extra must hold only JSON values (numbers, strings, lists, dicts): {err}") from None
