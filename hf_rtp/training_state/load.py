"""load_training_state: verified on every rank before anything is loaded, then read by DCP at this world
size."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict

from ..distributed.ranks.agreement import agreed
from ..errors import CheckpointError
from .dcp_io import control_group, keep_loaded_dtypes, named_waits, read_tensors, tensors
from .folder import StateFolder, normalised
from .metadata import read_state
from .rng import restore_rng
from .tensor_json import from_json
from .verify import verify


def load_training_state(directory: str, model: nn.Module, optimizer, scheduler=None) -> dict:
    """Collective. Restore what save_training_state wrote, at this world size; returns its `extra`.

    Nothing is loaded until every rank has verified the checkpoint: its files are all there, whole
    and as written, it covers every parameter and optimizer tensor of this model and optimizer, and
    it was saved from the same model class and plan. Otherwise every rank raises a CheckpointError
    naming what is wrong, and the model and optimizer are untouched.
    """
    directory = normalised(directory)
    group, rank = control_group(model), dist.get_rank() if dist.is_initialized() else 0
    with agreed(group, CheckpointError):
        if rank == 0:
            StateFolder(directory).recover()  # a swap a crash interrupted, finished: the load's recovery step
    model_sd, optim_sd, flat = tensors(model, optimizer)
    with agreed(group, CheckpointError):
        state = read_state(directory)
        verify(directory, state, flat, model, optim_sd)
        groups, scheduled = from_json(state.param_groups), from_json(state.scheduler)
    with named_waits("load_training_state", directory):
        read_tensors(flat, directory, group)
        optim_sd["param_groups"] = groups
        for fqn, kept in state.scalars.items():  # absent from checkpoints saved before it was kept
            optim_sd["state"].setdefault(fqn, {}).update(kept)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        keep_loaded_dtypes(model, optimizer, optim_sd)
        if scheduler is not None and scheduled is not None:
            scheduler.load_state_dict(scheduled)
    restore_rng(state.rng, state.world_size)
    return state.extra
