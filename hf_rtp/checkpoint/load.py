"""Read what each rank keeps: its rows of rotated tensors, all of replicated ones (I6)."""

from __future__ import annotations

import torch

from ..log import progress
from .keys import Want
from .safetensors_io import CheckpointError, TensorEntry


def read_local(
    entries: dict[str, TensorEntry], wants: dict[str, Want], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Read every wanted tensor (or its rows) from disk, checked against the model's shapes."""
    missing = sorted({name for want in wants.values() for name in want.source.names} - set(entries))
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
            + ". Its config.json does not describe these weights."
        )
    for want in wants.values():
        for name, shape in want.source.pieces:
            if entries[name].shape != shape:
                raise CheckpointError(
                    f"{name} has shape {list(entries[name].shape)} in {entries[name].path}, but config.json gives "
                    f"{list(shape)}: the weights and the config belong to different models"
                )
    # file order, then byte order: the reads walk each file front to back
    first = {n: entries[w.source.names[0]] for n, w in wants.items()}
    order = sorted(wants, key=lambda n: (first[n].path, first[n].offset))
    out = {}
    for name in progress(order, desc="Loading checkpoint shards"):
        tensor = wants[name].source.read(entries, wants[name].rows)
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        out[name] = tensor.to(device)
    return out
