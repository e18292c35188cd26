"""Which stored tensors make each model parameter: transformers' own conversion mapping.

Vanilla from_pretrained maps checkpoint names through `get_model_conversion_mapping`: renames
(GPT-NeoX's `embed_out`, Mixtral's `block_sparse_moe`), the base-model prefix (GPT-2's original
files), and converters that merge per-expert tensors into fused experts (Mixtral, Qwen2/3-MoE,
DeepSeek-V3). Vanilla materialises the merged tensor; we apply the same rules to names only and
record which stored piece fills which rows, so each rank reads only its own experts, and saving
writes the pieces back under the names the checkpoint had, as vanilla's revert does.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from ..errors import CheckpointError
from ..model.install import persistent_buffers
from .safetensors_io import TensorEntry, read_rows


@dataclass(frozen=True)
class Source:
    """The stored tensors one parameter is made of: `per_row` consecutive pieces per dim-0 row
    (0: one tensor holding every row, as stored under the model's own layout). `saved_names` are
    what saving writes them as (the stored names, with the base-model prefix as vanilla writes it)."""

    pieces: list[tuple[str, torch.Size]]
    per_row: int = 0
    saved_names: tuple[str, ...] | None = None

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.pieces]

    def read(self, entries: dict[str, TensorEntry], rows: tuple[int, int] | None) -> torch.Tensor:
        if not self.per_row:
            return read_rows(entries[self.pieces[0][0]], *(rows or (None, None)))
        start, end = rows or (0, len(self.pieces) // self.per_row)
        first = entries[self.pieces[0][0]]
        width = sum(shape[0] for _, shape in self.pieces[: self.per_row])
        # each stored piece is read straight into its place: no concatenated or stacked copies
        out = torch.empty((end - start, width, *first.shape[1:]), dtype=first.dtype)
        for r in range(start, end):
            offset = 0
            for name, shape in self.pieces[r * self.per_row : (r + 1) * self.per_row]:
                read_rows(entries[name], out=out[r - start, offset : offset + shape[0]])
                offset += shape[0]
        return out

    def stored_parts(self, shape: torch.Size):
        """(saved name, stored shape, dim-0 rows of the parameter, slice of dim 1) for saving."""
        names = self.saved_names or tuple(self.names)
        if not self.per_row:
            yield names[0], shape, (0, shape[0]), None
            return
        for index, (name, (_, piece)) in enumerate(zip(names, self.pieces, strict=True)):
            row, part = divmod(index, self.per_row)
            offset = sum(s[0] for _, s in self.pieces[row * self.per_row : row * self.per_row + part])
            yield name, piece, (row, row + 1), slice(offset, offset + piece[0])


@dataclass(frozen=True)
class Transposed(Source):
    """A parameter stored transposed: a GPT-2 Conv1D weight [in, out] that becomes a linear's [out, in], as
    vanilla's bitsandbytes quantizes it (integrations/bitsandbytes.py). A rank's rows are columns of the stored
    tensor, which no byte range holds: it reads the stored rows in bands of about `BAND_BYTES` and keeps its
    columns of each, so it holds at most one band besides its own rows."""

    BAND_BYTES = 16 << 20

    def read(self, entries: dict[str, TensorEntry], rows: tuple[int, int] | None) -> torch.Tensor:
        entry = entries[self.pieces[0][0]]
        inner, outer = entry.shape
        start, end = rows or (0, outer)
        out = torch.empty((end - start, inner), dtype=entry.dtype)
        step = max(1, self.BAND_BYTES // max(entry.row_bytes, 1))
        for first in range(0, inner, step):
            last = min(inner, first + step)
            out[:, first:last] = read_rows(entry, first, last)[:, start:end].t()
        return out

    def stored_parts(self, shape: torch.Size):
        raise CheckpointError(f"{self.names[0]} was read transposed (a quantized Conv1D), which hf_rtp does not save")


def own(name: str, shape: torch.Size) -> Source:
    """A parameter stored under its own name."""
    return Source([(name, shape)])


def stored_sources(model: PreTrainedModel, stored: list[str]) -> dict[str, Source]:
    """Parameter (or persistent buffer) name -> its Source, for every one the stored names provide (others:
    absent)."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix: str = model.base_model_prefix
    known = dict.fromkeys(model.state_dict(keep_vars=True), True)
    shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    shapes.update({n: b.shape for n, b in persistent_buffers(model).items()})

    merged: dict[str, dict[str, list[tuple[str, str]]]] = defaultdict(lambda: defaultdict(list))
    sources: dict[str, Source] = {}
    for key in sorted(stored, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if target not in shapes:
            continue
        saved = _as_vanilla_saves(key, target, rename_source_key(key, renamings, converters)[0], prefix)
        if pattern is None:
            sources.setdefault(target, Source([(key, shapes[target])], saved_names=(saved,)))
        else:
            merged[target][pattern].append((key, saved))
    for target, groups in merged.items():
        converter = by_pattern[next(iter(groups))]
        sources[target] = _merged(target, shapes[target], converter, groups)
    return sources


def _as_vanilla_saves(key: str, target: str, unprefixed: str, prefix: str) -> str:
    """Vanilla saves the model's own prefix: a key that needed it added (GPT-2's original files) is
    written with it, one that needed it dropped without it."""
    if target == f"{prefix}.{unprefixed}":
        return f"{prefix}.{key}"
    if unprefixed == f"{prefix}.{target}":
        return key.removeprefix(f"{prefix}.")
    return key


def _merged(target: str, shape: torch.Size, converter: WeightConverter, groups) -> Source:
    """Per-expert tensors stacked along dim 0 (MergeModulelist), several concatenated along dim 1."""
    ops = converter.operations
    supported = (
        len(ops) in (1, 2)
        and isinstance(ops[0], MergeModulelist)
        and ops[0].dim == 0
        and (len(ops) == 1 or (isinstance(ops[1], Concatenate) and ops[1].dim == 1))
        and (len(ops) == 2 or len(converter.source_patterns) == 1)
    )
    if not supported:
        raise CheckpointError(
            f"{target} is stored through transformers' conversion {[type(op).__name__ for op in ops]}, which "
            "hf_rtp cannot read by rows. Load it once with vanilla transformers and save it with "
            "save_pretrained(..., save_original_format=False) to store the model's own layout"
        )
    patterns = converter.source_patterns
    per_pattern = [groups.get(p, []) for p in patterns]
    experts = shape[0]
    if any(len(keys) != experts for keys in per_pattern):
        counts = ", ".join(f"{p}: {len(keys)}" for p, keys in zip(patterns, per_pattern, strict=True))
        raise CheckpointError(
            f"{target} has {experts} experts, but the checkpoint stores a different number of per-expert "
            f"tensors ({counts}): the weights and the config belong to different models"
        )
    piece = torch.Size((shape[1] // len(patterns), *shape[2:]))
    pieces, saved = [], []
    for e in range(experts):
        for keys in per_pattern:
            pieces.append((keys[e][0], piece))
            saved.append(keys[e][1])
    return Source(pieces, per_row=len(patterns), saved_names=tuple(saved))
