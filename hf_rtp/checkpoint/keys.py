"""What each rank reads, from which stored tensors, and which names are ties.

Stored names map to parameters as vanilla maps them (conversion.py); each rank reads only its rows
(or experts), and the model remembers the sources so that saving writes the same names back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from ..distributed.ranks.topology import Topology
from ..distributed.tensors.sharding import chunk_rows
from ..log import warning
from ..model.install import persistent_buffers
from ..model.ties import tie_targets
from ..plans import Resolution
from .conversion import Source, Transposed, own, stored_sources
from .safetensors_io import TensorEntry, read_rows


def untie_stored_apart(model: PreTrainedModel, entries: dict[str, TensorEntry], topology: Topology) -> list[str]:
    """Collective. Untie the ties whose two names the checkpoint stores with different values, as
    vanilla from_pretrained does (with its warning): the config says tied, the file says otherwise,
    and the file wins. Each rank compares only its own rows; one all-reduce makes the verdict common.
    """
    pairs = [(t, s) for t, s in tie_targets(model).items() if t in entries and s in entries]
    if not pairs:
        return []
    differ = torch.tensor([int(not _same_rows(entries[t], entries[s], topology)) for t, s in pairs])
    if topology.world_size > 1:
        dist.all_reduce(differ, op=dist.ReduceOp.MAX, group=topology.control)
    untied = []
    for (target, source), different in zip(pairs, differ.tolist(), strict=True):
        if not different:
            continue
        warning(
            f"The tied weights mapping and config for this model specifies to tie {source} to {target}, but both "
            "are present in the checkpoints with different values, so we will NOT tie them. You should update the "
            "config with `tie_word_embeddings=False` to silence this warning."
        )
        owner, _, leaf = target.rpartition(".")
        tied = model.get_parameter(target)
        setattr(model.get_submodule(owner), leaf, nn.Parameter(torch.empty_like(tied, device="meta")))
        model.all_tied_weights_keys.pop(target)
        untied.append(target)
    return untied


def _same_rows(a: TensorEntry, b: TensorEntry, topology: Topology) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    rows = chunk_rows(a.shape[0], topology.rtp_size, topology.rtp_rank) if a.shape else (None, None)
    step = max(1, (64 << 20) // max(a.row_bytes, 1))  # compare in 64 MB slices: no whole copy of the head
    start, end = rows if rows[0] is not None else (0, a.shape[0] if a.shape else 1)
    for first in range(start, end, step):
        last = min(end, first + step)
        if not torch.equal(read_rows(a, first, last), read_rows(b, first, last)):
            return False
    return True


@dataclass(frozen=True)
class Want:
    shape: torch.Size
    """global shape the model expects"""
    rows: tuple[int, int] | None
    """this rank's dim-0 range, or None for the whole tensor"""
    source: Source
    dtype: torch.dtype | None = None
    """the dtype the model keeps it in (a float32 router in a bfloat16 model, as vanilla's load keeps it)"""
    buffer: bool = False
    """a persistent buffer (any dtype, cast to `dtype` as load_state_dict copies it), not a parameter"""


def wants_for(
    model: PreTrainedModel, resolution: Resolution, topology: Topology, entries: dict[str, TensorEntry]
) -> tuple[dict[str, Want], dict[str, Source]]:
    """What this rank reads for each parameter and each persistent buffer stored; and each one's source, for
    saving."""
    targets = tie_targets(model)
    sources = stored_sources(model, list(entries))
    wants = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in targets:
            continue
        rows = None
        if topology.rtp_size > 1 and name in resolution.rotated_params:
            rows = chunk_rows(param.shape[0], topology.rtp_size, topology.rtp_rank)
        # a name no stored tensor provides reads under its own name, which reports it missing
        source = sources.get(name) or own(name, param.shape)
        if name in resolution.transposed and source.names[0] in entries:
            stored = source.names[0]
            source = Transposed([(stored, entries[stored].shape)], saved_names=source.saved_names)
        wants[name] = Want(param.shape, rows, source, param.dtype if param.is_floating_point() else None)
    for name, buffer in persistent_buffers(model).items():
        # a buffer the checkpoint stores (a router's correction bias) is read whole, in the dtype the model keeps
        # it in; one it lacks keeps the value the model was built with, as in vanilla
        source = sources.get(name) or own(name, buffer.shape)
        if all(stored in entries for stored in source.names):
            wants[name] = Want(buffer.shape, None, source, buffer.dtype, buffer=True)
    return wants, {name: want.source for name, want in wants.items()}
