"""Which checkpoint tensors a rank reads, and which names are ties (stored once, under the source name)."""

from __future__ import annotations

from torch import nn

from ..mesh import Topology
from ..plans import Resolution
from ..sharding import chunk_rows
from .load import Want


def tie_targets(model: nn.Module) -> dict[str, str]:
    """target -> source for the weights this model ties (lm_head -> embed_tokens when tied)."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {t: s for t, s in tied.items() if t in names and s in names}


def wants_for(model: nn.Module, resolution: Resolution, topology: Topology) -> dict[str, Want]:
    targets = tie_targets(model)
    wants = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in targets:
            continue
        rows = None
        if topology.world_size > 1 and name.rpartition(".")[0] in resolution.rotated:
            rows = chunk_rows(param.shape[0], topology.world_size, topology.rank)
        wants[name] = Want(param.shape, rows)
    return wants
