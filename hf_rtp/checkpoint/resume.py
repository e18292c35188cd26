"""Resumable training state: model chunks and optimizer state through torch.distributed.checkpoint,
written as safetensors (one file per rank, no pickle), plus a JSON file for everything else.

Loading reshards: a checkpoint saved by N ranks loads on M, because DCP records each chunk's place
in the global tensor and every rank reads the rows it now owns. A save is atomic: ranks write into
`<dir>.partial`, and rank 0 renames it only once everything, the JSON last, is on disk.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..mesh import raise_if_any_failed
from ..errors import CheckpointError
from ..state import state_of

STATE_FILE = "training_state.json"


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer):
    """The state dicts DCP fills in place, and their tensors under flat names (the writer wants tensors)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # creates optimizer state with the right layout
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                flat[f"optim.{fqn}.{key}"] = value
    return model_sd, optim_sd, flat


def save_training_state(directory: str, model: nn.Module, optimizer, scheduler=None, extra: dict | None = None) -> None:
    """Collective. Write model, optimizer, scheduler, RNG and `extra` (step, data position) to `directory`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    partial = f"{directory}.partial"
    if rank == 0 and os.path.exists(partial):
        shutil.rmtree(partial)  # a save that was killed
    _barrier(model)
    _, optim_sd, flat = _tensors(model, optimizer)
    writer = dcp.HuggingFaceStorageWriter(partial, save_distributed=True)
    dcp.save(flat, storage_writer=writer, process_group=_control(model))  # hf_rtp's timeout, not the world's
    rng = _gather_rng(_control(model))
    error = None
    if rank == 0:
        try:
            state = {
                "param_groups": optim_sd["param_groups"],
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng,
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                **(extra or {}),
            }
            _write_json(os.path.join(partial, STATE_FILE), state)
            if os.path.exists(directory):
                shutil.rmtree(directory)
            os.replace(partial, directory)
        except Exception as err:
            error = err
    raise_if_any_failed(error, _control(model), CheckpointError)


def load_training_state(directory: str, model: nn.Module, optimizer, scheduler=None) -> dict:
    """Collective. Restore what save_training_state wrote, at this world size; returns its `extra`."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        raise CheckpointError(
            f"{directory} is not a complete training checkpoint (no {STATE_FILE}); a save may have been interrupted: "
            "resume from an earlier checkpoint-* folder"
        )
    with open(path) as f:
        state = json.load(f)
    model_sd, optim_sd, flat = _tensors(model, optimizer)
    dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(directory), process_group=_control(model))
    optim_sd["param_groups"] = state.pop("param_groups")
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    rng = state.pop("rng")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if state.get("world_size") == world:  # at another world size the old per-rank streams mean nothing
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.set_rng_state(torch.tensor(rng[rank]["cpu"], dtype=torch.uint8))
        if torch.cuda.is_available() and rng[rank].get("cuda") is not None:
            torch.cuda.set_rng_state(torch.tensor(rng[rank]["cuda"], dtype=torch.uint8))
    return state


def _gather_rng(group) -> list[dict]:
    mine = {"cpu": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        mine["cuda"] = torch.cuda.get_rng_state().tolist()
    if not dist.is_initialized():
        return [mine]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def _control(model: nn.Module):
    """hf_rtp's gloo group with hf_rtp's timeout, whoever made the world group."""
    state = state_of(model, required=False)
    return None if state is None else state.topology.control


def _barrier(model: nn.Module) -> None:
    if dist.is_initialized():
        dist.barrier(group=_control(model))
