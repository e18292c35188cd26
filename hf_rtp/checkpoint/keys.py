"""What each rank reads, under which stored format, and which names are ties.

Loading picks the first of the plan's stored formats that the checkpoint matches (see formats.py),
reads only this rank's rows (or experts), and the model remembers the format so that saving writes
the same names back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..mesh import Topology
from ..plans import Resolution
from ..sharding import chunk_rows
from .formats import Source, StoredFormat, source_for
from .safetensors_io import TensorEntry


def tie_targets(model: nn.Module) -> dict[str, str]:
    """target -> source for the weights this model ties (lm_head -> embed_tokens when tied)."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {t: s for t, s in tied.items() if t in names and s in names}


@dataclass(frozen=True)
class Want:
    shape: torch.Size
    """global shape the model expects"""
    rows: tuple[int, int] | None
    """this rank's dim-0 range, or None for the whole tensor"""
    source: Source


def wants_for(
    model: nn.Module,
    resolution: Resolution,
    topology: Topology,
    entries: dict[str, TensorEntry],
    formats: tuple[StoredFormat, ...],
) -> tuple[dict[str, Want], StoredFormat]:
    """What this rank reads for each parameter, under the first format the checkpoint matches."""
    targets = tie_targets(model)
    params = [(n, p.shape) for n, p in model.named_parameters(remove_duplicate=False) if n not in targets]
    candidates = ((), *formats)
    for stored_format in candidates:
        if all(all(s in entries for s in source_for(n, shape, stored_format).names) for n, shape in params):
            break
    else:
        stored_format = ()  # none fits: reading under the model's own names reports what is missing
    wants = {}
    for name, shape in params:
        rows = None
        if topology.world_size > 1 and name in resolution.rotated_params:
            rows = chunk_rows(shape[0], topology.world_size, topology.rank)
        wants[name] = Want(shape, rows, source_for(name, shape, stored_format))
    return wants, stored_format

