"""save_pretrained / push_to_hub for rotated models: what vanilla transformers writes, gathered tensor by tensor.

Every rank calls it. Ring rank 0 of the first replica writes (Topology.is_writer); rotated tensors
reach it one at a time (dim-0 chunks streamed from their owners in its ring), so it holds at most
two foreign chunks beyond its own parameters, never a whole tensor, let alone the model (DESIGN.md I7).
The other replicas hold the same chunks and only wait for the verdict.
Files are staged in a hidden folder and committed as commit.py describes: at every instant
the folder holds the complete old or the complete new checkpoint (finished by the next hf_rtp load
or save when a crash hit the commit itself), never a mix.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import faults
from ..distributed.ranks.agreement import Attempts, agreed
from ..distributed.ranks.topology import Topology
from ..distributed.tensors.sharding import ChunkLayout
from ..errors import CollectiveMisuseError
from ..folders import commit
from ..folders.commit import INDEX_NAME, SINGLE_NAME
from ..log import info, progress
from ..model.state import state_of
from ..model.ties import tie_targets
from ..settings import parse_size
from .conversion import own
from .safetensors_io import CheckpointError, StreamingWriter


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Split in order exactly as huggingface_hub does, so files and index match a vanilla save.

    A tensor larger than the limit gets a file of its own, without closing the file being filled.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if nbytes > max_bytes:
            shards.append([name])
            continue
        if used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class _Stored:
    """One tensor of the written checkpoint: rows (and, for per-expert names, a dim-1 slice) of a parameter."""

    tensor: torch.Tensor
    shape: torch.Size
    rows: tuple[int, int]
    cols: slice | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.tensor.dtype.itemsize


def _stored_tensors(model, tensors: dict[str, torch.Tensor], original_format: bool = True) -> dict[str, _Stored]:
    """The checkpoint's tensors by stored name: in the format the model was loaded from, or with
    `original_format=False` (save_pretrained's `save_original_format`) under the model's own names."""
    sources = state_of(model).sources if original_format else {}
    out = {}
    for name, tensor in tensors.items():
        for stored_name, shape, rows, cols in (sources.get(name) or own(name, tensor.shape)).stored_parts(tensor.shape):
            out[stored_name] = _Stored(tensor, shape, rows, cols)
    return out


def _open_shard(staging: str, filename: str, layout: list) -> StreamingWriter:
    return StreamingWriter(os.path.join(staging, filename), layout, {"format": "pt"})


def _pieces_on_writer(stored: _Stored, topology: Topology):
    """The stored tensor as consecutive dim-0 pieces on the writer (streamed, never concatenated).

    Only the writer's ring collects: the other replicas hold the same chunks and send nothing."""
    tensor, (start, end) = stored.tensor, stored.rows
    if isinstance(tensor, DTensor) and topology.dp_rank == 0:
        layout = ChunkLayout((tensor.shape,), topology.rtp_size)
        pieces = topology.ring.collect(tensor.to_local(), layout, stored.rows)
    else:
        pieces = iter([tensor[start:end]] if topology.is_writer else [])
    return pieces if stored.cols is None else (piece[:, stored.cols] for piece in pieces)


def _tensors_to_save(model, state_dict) -> dict[str, torch.Tensor]:
    state_dict = model.state_dict() if state_dict is None else dict(state_dict)
    for target, source in tie_targets(model).items():
        if model.get_parameter(target) is model.get_parameter(source):
            state_dict.pop(target, None)  # stored once, under the name vanilla loads it from
    for pattern in getattr(model, "_keys_to_ignore_on_save", None) or []:
        for name in [n for n in state_dict if re.search(pattern, n)]:
            del state_dict[name]
    return state_dict


def _same_tensors_everywhere(tensors: dict[str, _Stored], topology: Topology) -> None:
    """Every rank's list of stored tensors (names, shapes, dtypes, rows, rotated or not) is the same, or every
    rank fails here: a rotated tensor is gathered by pairing its pieces in order, so ranks saving different
    lists (a `state_dict=` built per rank) would write one tensor's rows under another's name, or wait."""
    if topology.world_size == 1:
        return
    crc = 0
    for name in sorted(tensors):
        t = tensors[name]
        what = (name, tuple(t.tensor.shape), str(t.tensor.dtype), t.rows, t.cols, isinstance(t.tensor, DTensor))
        crc = zlib.crc32(repr(what).encode(), crc)
    mine = torch.tensor([crc, len(tensors)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(topology.world_size)]
    dist.all_gather(everyone, mine, group=topology.control)
    if len({tuple(t.tolist()) for t in everyone}) > 1:
        counts = ", ".join(f"rank {r}: {int(t[1])} tensors" for r, t in enumerate(everyone))
        raise CollectiveMisuseError(
            f"save_pretrained: ranks asked to save different tensors ({counts}; names, shapes or dtypes differ). "
            "Every rank's save gathers the same tensors together: pass every rank the same state_dict= (each "
            "rank's model.state_dict(), or a selection made alike on every rank), or none"
        )


def write(
    model,
    save_directory: str | os.PathLike,
    state_dict: dict | None,
    max_shard_size: int | str,
    original_format: bool = True,
) -> list[str]:
    """save_pretrained's collective write; returns, on the writer, the names of the files this save
    wrote into the folder (its whole checkpoint), and [] on every other rank."""
    topology: Topology = state_of(model).topology
    save_directory = os.fspath(save_directory)
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        raise CheckpointError(
            "this model's base was loaded with quantization_config (4- or 8-bit): hf_rtp does not save a quantized "
            "base. "
            "Save the adapter (Trainer.save_model, or PeftModel.save_pretrained), which vanilla PEFT loads onto "
            "the original checkpoint; to save merged weights, merge the adapter in vanilla on an unquantized base"
        )
    if os.path.isfile(save_directory):
        raise NotADirectoryError(f"{save_directory} is a file; save_pretrained needs a directory")
    writer_rank = topology.is_writer
    written: list[str] = []

    with agreed(topology.control, CheckpointError):  # a state_dict= one rank cannot save fails every rank here
        tensors = _stored_tensors(model, _tensors_to_save(model, state_dict), original_format)
    _same_tensors_everywhere(tensors, topology)
    names = sorted(tensors)  # vanilla splits files in sorted name order; same order, same files
    sizes = [(n, tensors[n].nbytes) for n in names]
    shards = plan_shards(sizes, parse_size(max_shard_size))
    filenames = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )

    # vanilla records these on save; every rank does it so configs stay identical
    model.config.dtype = str(next(model.parameters()).dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]

    staging, lock = None, None
    # The writer's file steps: after a failure (disk full, permissions) the rest are skipped but the
    # transfers go on, so no rank is left waiting for a writer that gave up; every rank hears at the end.
    attempts = Attempts()
    attempt = attempts.attempt

    target = commit.FilesInFolder(save_directory, filenames)  # folders/storage.py's steps, on the writer
    if writer_rank:
        lock = attempt(target.lock)
        staging = attempt(target.stage)
    bar = progress(None, desc="Saving model", total=len(names))
    try:
        for shard, filename in zip(shards, filenames, strict=True):
            writer = None
            if writer_rank:
                layout = [(n, tensors[n].tensor.dtype, tensors[n].shape) for n in shard]
                writer = attempt(_open_shard, staging, filename, layout)
            for name in shard:
                parts = _pieces_on_writer(tensors[name], topology)
                if writer is not None:
                    attempt(faults.point, "save.write")
                    attempt(writer.write, name, parts)
                for _ in parts:  # drain what a failed write left unread
                    pass
                bar.update(1)
            if writer is not None:
                attempt(writer.close)
        if writer_rank:
            attempt(_write_metadata, model, staging, shards, filenames, sizes)
            if attempts.error is None:
                written = sorted(n for n in os.listdir(staging) if commit.own_name(n))
            attempt(target.commit, staging)
            if attempts.error is None:
                info(f"Model weights saved in {save_directory}")
    finally:
        bar.close()
        if staging is not None:
            target.abandon(staging)  # unless its commit began: the next load or save finishes that
        if lock is not None:
            lock.release()
    with agreed(topology.control, CheckpointError):
        attempts.raise_first()
    return written


def _write_metadata(model, staging: str, shards, filenames, sizes) -> None:
    model.config.save_pretrained(staging)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(staging)
    if len(shards) > 1:
        weight_map = {name: filename for shard, filename in zip(shards, filenames, strict=True) for name in shard}
        index = {
            "metadata": {"total_parameters": model.num_parameters(), "total_size": sum(n for _, n in sizes)},
            "weight_map": weight_map,
        }
        with open(os.path.join(staging, INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
