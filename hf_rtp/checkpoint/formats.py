"""Stored formats: how a model parameter maps to the tensors a checkpoint stores.

Most checkpoints store parameters under the model's own names. Some do not: GPT-2's original
files drop the `transformer.` prefix, and Mixtral checkpoints store one tensor per expert
(`block_sparse_moe.experts.{e}.w1/w2/w3.weight`) where transformers 5 holds fused
`mlp.experts.gate_up_proj` / `down_proj`. A plan lists such formats as tuples of rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .safetensors_io import TensorEntry, read_rows


@dataclass(frozen=True)
class Renamed:
    """Stored under another name: `model` replaced by `stored` (only at the start if `prefix`)."""

    model: str
    stored: str
    prefix: bool = False

    def source(self, name: str, shape: torch.Size) -> "Source | None":
        if self.prefix:
            return Source([(self.stored + name[len(self.model) :], shape)]) if name.startswith(self.model) else None
        return Source([(name.replace(self.model, self.stored), shape)]) if self.model in name else None


@dataclass(frozen=True)
class PerExpert:
    """A fused [E, ...] parameter stored as one tensor per expert; several are stacked along dim 1.

    `stored` are name endings with an `{expert}` field, replacing `model_suffix`, in the order they
    are concatenated (Mixtral's gate_up_proj = [w1; w3]).
    """

    model_suffix: str
    stored: tuple[str, ...]

    def source(self, name: str, shape: torch.Size) -> "Source | None":
        if not name.endswith(self.model_suffix):
            return None
        stem = name[: -len(self.model_suffix)]
        width = shape[1] // len(self.stored)
        pieces = [
            (stem + template.format(expert=e), torch.Size((width, *shape[2:])))
            for e in range(shape[0])
            for template in self.stored
        ]
        return Source(pieces, per_row=len(self.stored))


@dataclass(frozen=True)
class Source:
    """The stored tensors one parameter is made of: `per_row` consecutive pieces per dim-0 row
    (0: one tensor holding every row, as stored under the model's own layout)."""

    pieces: list[tuple[str, torch.Size]]
    per_row: int = 0

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
        """(stored name, stored shape, dim-0 rows of the parameter, slice of dim 1) for saving."""
        if not self.per_row:
            name, _ = self.pieces[0]
            yield name, shape, (0, shape[0]), None
            return
        for index, (name, piece) in enumerate(self.pieces):
            row, part = divmod(index, self.per_row)
            offset = sum(s[0] for _, s in self.pieces[row * self.per_row : row * self.per_row + part])
            yield name, piece, (row, row + 1), slice(offset, offset + piece[0])


StoredFormat = tuple  # of Renamed / PerExpert rules; the empty format stores the model's own names


def source_for(name: str, shape: torch.Size, stored_format: StoredFormat) -> Source:
    for rule in stored_format:
        found = rule.source(name, shape)
        if found is not None:
            return found
    return Source([(name, shape)])
