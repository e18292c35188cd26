"""The checks a training state passes before any of it is loaded: its files are all there, whole and as
written, and its tensors cover every parameter and optimizer tensor of this model and optimizer, saved from
the same model class and plan."""

from __future__ import annotations

import math
import os
import re

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..checkpoint.safetensors_io import read_header
from ..errors import CheckpointError
from .dcp_io import stored_tensors
from .metadata import STATE_FILE, Identity, TrainingStateMetadata, read_state

# 8-bit optimizer state's block scales (distributed/tensors/blockwise.py): bitsandbytes' and torchao's
_BLOCK_SCALES = re.compile(r"^optim\..*\.((absmax|qmap)[12]|(exp_avg|exp_avg_sq|max_exp_avg_sq)_scale)$")


def is_complete(folder: str) -> bool:
    try:
        check_files(folder, read_state(folder))
        return True
    except CheckpointError:
        return False


def check_files(directory: str, state: TrainingStateMetadata) -> None:
    """Every file the save recorded is there with the size it was written with, and nothing else."""
    files = state.files
    if files is None:
        return  # written before hf_rtp recorded files: the coverage check still holds
    present = {f for f in os.listdir(directory) if f != STATE_FILE}
    missing, extra = sorted(set(files) - present), sorted(present - set(files))
    if missing:
        raise CheckpointError(
            f"{directory} is incomplete: {', '.join(missing)} missing. Every rank's file is needed to resume; "
            "copy the whole folder again, or resume from an earlier checkpoint-* folder"
        )
    if extra:
        raise CheckpointError(
            f"{directory} holds file(s) its save did not write ({', '.join(extra)}); they would be read as part of "
            "the checkpoint. Remove them, or resume from an earlier checkpoint-* folder"
        )
    for name, size in files.items():
        path = os.path.join(directory, name)
        if os.path.getsize(path) != size:
            raise CheckpointError(
                f"{path} has {os.path.getsize(path)} bytes but was saved with {size}: it is truncated or was "
                "overwritten. Copy the folder again, or resume from an earlier checkpoint-* folder"
            )
        if name.endswith(".safetensors"):
            read_header(path)


def verify(directory: str, state: TrainingStateMetadata, flat: dict, model: nn.Module, optim_sd: dict) -> None:
    check_files(directory, state)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if state.world_size == world and len(state.rng) != world:
        raise CheckpointError(f"{directory}/{STATE_FILE} records {len(state.rng)} RNG states for {world} ranks")
    saved_groups = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in state.param_groups]
    groups = [len(g["params"]) for g in optim_sd["param_groups"]]
    if saved_groups != groups:
        raise CheckpointError(
            f"{directory} was saved from an optimizer whose parameter groups hold {saved_groups} parameters, but this "
            f"optimizer's hold {groups}: build the optimizer as the run that saved it did"
        )
    saved_as, this = state.identity, Identity.of(model)
    if saved_as is not None and saved_as != this:
        raise CheckpointError(
            f"{directory} was saved from a {saved_as.model_class} with plan '{saved_as.plan}', but this model is a "
            f"{this.model_class} with plan '{this.plan}': load the model (and plan) it was saved from"
        )
    stored = stored_tensors(directory)
    missing = sorted(set(flat) - set(stored))
    unknown = sorted(set(stored) - set(flat))
    if any(_BLOCK_SCALES.search(k) for k in missing + unknown):
        raise CheckpointError(
            f"{directory} holds 8-bit optimizer state (bitsandbytes' or torchao's) in another form than this run "
            "keeps it: "
            + (f"it lacks {_listing(missing)}" if missing else f"it holds {_listing(unknown)}")
            + ". hf_rtp keeps a parameter's 8-bit state only where every rank's rows start on one of the optimizer's "
            "blocks (256 elements), unquantized state elsewhere, and that depends on the world size: resume at the "
            f"world size it was saved at ({state.world_size}), or at one where the same parameters align (or it "
            "was saved with another optimizer class or optim_bits: resume with the one it was saved with)"
        )
    if missing or unknown:
        raise CheckpointError(
            f"{directory} does not match this model and optimizer: "
            + (f"it lacks {_listing(missing)}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"it holds {_listing(unknown)}, which they do not have" if unknown else "")
            + ". A file of the checkpoint is missing, or it was saved from another model, plan or optimizer class: "
            "copy the whole folder again, resume with what it was saved with, or from an earlier checkpoint-* folder"
        )
    for key, tensor in flat.items():
        meta, shape = stored[key], tuple(tensor.shape)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{directory} stores {key} as bytes, not as a tensor: it belongs to another model")
        covered = sum(math.prod(c.sizes) for c in {(tuple(c.offsets), tuple(c.sizes)): c for c in meta.chunks}.values())
        # DCP would cast into it: bitsandbytes' uint8 codes read as float32 moments
        if meta.properties.dtype.is_floating_point != tensor.dtype.is_floating_point:
            raise CheckpointError(
                f"{directory} stores {key} as {meta.properties.dtype}, but this optimizer keeps it as {tensor.dtype}: "
                "it was saved with other optimizer settings (optim_bits, or another world size where bitsandbytes' "
                "blocks align differently). Resume with the settings and world size it was saved with"
            )
        if tuple(meta.size) != shape or covered != math.prod(shape):
            raise CheckpointError(
                f"{directory} holds {covered} of the {math.prod(shape)} elements of {key} (shape {list(meta.size)}, "
                f"the model has {list(shape)}): a shard is missing or belongs to another model. Resume from an "
                "earlier checkpoint-* folder"
            )


def _listing(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
