"""Read what each rank keeps: its rows of rotated tensors, all of replicated ones (DESIGN.md I6)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from .. import faults
from ..distributed.ranks.agreement import agreed
from ..errors import CheckpointError
from ..folders.commit import recover_before_reading
from ..layers.common import local
from ..log import progress
from ..model.install import persistent_buffers
from ..model.state import rotated_module, state_of
from .digests import overlapped
from .files import find_weights
from .fingerprint import agree_on_read, prove_files, tensor_digest
from .keys import Want, wants_for
from .safetensors_io import TensorEntry


def read_proven(
    entries: dict[str, TensorEntry],
    wants: dict[str, Want],
    dtype: torch.dtype,
    topology,
    verify: str = "auto",
    transforms: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Collective. Every rank's tensors (or rows), once the ranks have proven they read one checkpoint's
    bytes: file by file before the read, replicated tensors' digests after it (fingerprint.py).
    `transforms`: name -> what to keep of a tensor as soon as it is read (its rows quantized)."""
    identities = prove_files(entries, topology.control, verify)
    with agreed(topology.control, CheckpointError):
        faults.point("load.read")
        tensors, read = read_local(
            entries, wants, dtype, topology.device, compare=topology.world_size > 1, transforms=transforms
        )
    agree_on_read(read, identities, entries, topology.control)
    return tensors


def read_local(
    entries: dict[str, TensorEntry],
    wants: dict[str, Want],
    dtype: torch.dtype,
    device: torch.device,
    compare: bool = False,
    transforms: dict | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read every wanted tensor (or its rows) from disk, checked against the model's shapes; and the
    SHA-256 of each tensor read whole (replicated ones), which every rank must share (with `compare`:
    alone, there is nobody to compare with)."""
    missing = sorted({name for want in wants.values() for name in want.source.names} - set(entries))
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
            + ". Its config.json does not describe these weights."
        )
    for want in wants.values():
        for name, shape in want.source.pieces:
            if not entries[name].dtype.is_floating_point and not want.buffer:  # a buffer may hold integers
                raise CheckpointError(
                    f"{name} is stored as {entries[name].dtype} in {entries[name].path}, but it is a floating-point "
                    "weight of the model: the file's header is damaged or the file holds quantized weights, which "
                    "hf_rtp does not load. Download or save the checkpoint again"
                )
            if entries[name].shape != shape:
                raise CheckpointError(
                    f"{name} has shape {list(entries[name].shape)} in {entries[name].path}, but config.json gives "
                    f"{list(shape)}: the weights and the config belong to different models"
                )
    # file order, then byte order: the reads walk each file front to back
    first = {n: entries[w.source.names[0]] for n, w in wants.items()}
    order = sorted(wants, key=lambda n: (first[n].path, first[n].offset))
    out, digests = {}, {}
    with overlapped():  # block digests are checked on worker threads while the next tensor is read
        for name in progress(order, desc="Loading checkpoint shards"):
            tensor = wants[name].source.read(entries, wants[name].rows)
            if compare and wants[name].rows is None:
                digests[name] = tensor_digest(tensor)
            wanted = wants[name].dtype or dtype
            if (tensor.is_floating_point() or wants[name].buffer) and tensor.dtype != wanted:
                tensor = tensor.to(wanted)
            out[name] = tensor.to(device)
            if transforms and name in transforms:
                out[name] = transforms[name](out[name])
    return out, digests


def load_into(model: nn.Module, directory: str) -> None:
    """Collective. Overwrite a rotated model's weights with those of a standard checkpoint (a Trainer's
    best checkpoint, say), each rank reading only its rows, as from_pretrained does."""
    base, state = rotated_module(model), state_of(model)
    assert isinstance(base, PreTrainedModel)  # state_of found it: a model hf_rtp loaded
    topology = state.topology
    recover_before_reading(directory, topology.control)  # a save_pretrained a crash interrupted, finished
    with agreed(topology.control, CheckpointError):
        entries = find_weights(directory).tensors()
        wants, _ = wants_for(base, state.resolution, topology, entries)
    tensors = read_proven(entries, wants, next(base.parameters()).dtype, topology)
    buffers = persistent_buffers(base)
    with torch.no_grad():
        for name, tensor in tensors.items():
            (buffers[name] if name in buffers else local(base.get_parameter(name))).copy_(tensor)
