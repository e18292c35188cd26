"""Read what each rank keeps: its rows of rotated tensors, all of replicated ones (I6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..log import progress
from .safetensors_io import CheckpointError, TensorEntry, read_rows


@dataclass(frozen=True)
class Want:
    shape: torch.Size
    """global shape the model expects"""
    rows: tuple[int, int] | None
    """this rank's dim-0 range, or None for the whole tensor"""


def read_local(
    entries: dict[str, TensorEntry], wants: dict[str, Want], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Read every wanted tensor (or its rows) from disk, checked against the model's shapes."""
    missing = sorted(set(wants) - set(entries))
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
            + ". Its config.json does not describe these weights."
        )
    for name, want in wants.items():
        if entries[name].shape != want.shape:
            raise CheckpointError(
                f"{name} has shape {list(entries[name].shape)} in {entries[name].path}, but config.json gives "
                f"{list(want.shape)}: the weights and the config belong to different models"
            )
    # file order, then byte order: the reads walk each file front to back
    order = sorted(wants, key=lambda n: (entries[n].path, entries[n].offset))
    out = {}
    for name in progress(order, desc="Loading checkpoint shards"):
        rows = wants[name].rows
        tensor = read_rows(entries[name], *(rows or (None, None)))
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        out[name] = tensor.to(device)
    return out
