"""How a rotated tensor is cut: dim 0, `torch.chunk` sizes, the same rule DTensor's Shard(0) uses.

`torch.chunk` gives every chunk ceil(n / N) rows except the tail, which may be short or empty
(n=10, N=4 -> 3, 3, 3, 1; n=2, N=3 -> 1, 1, 0). Loader, layers and saver all use this one rule
(DESIGN.md I2), so rank r's rows on disk, in memory and in the ring always agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunk_rows(n: int, world_size: int, index: int) -> tuple[int, int]:
    """Row range [start, end) of chunk `index` when `n` rows are cut into `world_size` chunks."""
    size = math.ceil(n / world_size) if n else 0
    start = min(index * size, n)
    return start, min(start + size, n)


PIECE_ROWS = 8
"""Pieces hold a multiple of this many rows where a chunk allows: a piece's rows are the leading dimension of its
matmul's output and the column offsets of the output's gradient, and cuBLAS runs its fast kernels only on 16-byte
aligned operands (8 bf16 values): llama-1b's gate/up pieces of 1639 rows ran Turing-era align1 kernels at 70-100
TFLOP/s on an H200, where aligned ones run at 500-650."""


def piece_rows(n: int, pieces: int) -> int:
    """Rows per piece when `n` rows are cut into `pieces`: torch.chunk's ceil(n / pieces), rounded up to a multiple
    of PIECE_ROWS unless that would leave a piece empty."""
    size = math.ceil(n / pieces) if n else 0
    aligned = -(-size // PIECE_ROWS) * PIECE_ROWS
    return aligned if (pieces - 1) * aligned < n else size


@dataclass(frozen=True)
class ChunkLayout:
    """Chunk shapes of a bundle: tensors cut together along dim 0 (a weight and its bias)."""

    global_shapes: tuple[torch.Size, ...]
    world_size: int

    def __post_init__(self):
        rows = {shape[0] for shape in self.global_shapes}
        if len(rows) != 1:
            raise ValueError(f"tensors rotated together must share dim 0, got {self.global_shapes}")

    @property
    def rows(self) -> int:
        return self.global_shapes[0][0]

    def _memo(self) -> dict:
        """What a walk asks of the layout at every hop (bounds, pieces, shapes), computed once per layout: a layout
        never changes (frozen), and a training step asks thousands of times (`hf-rtp bench --hop-cost`). Kept
        beside the fields, so equality and hashing ignore it."""
        memo = self.__dict__.get("_walk_memo")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_walk_memo", memo)
        return memo

    def bounds(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.world_size:
            return self._bounds(index)
        memo = self._memo()
        every = memo.get("bounds")
        if every is None:
            every = memo["bounds"] = tuple(self._bounds(i) for i in range(self.world_size))
        return every[index]

    def _bounds(self, index: int) -> tuple[int, int]:
        return chunk_rows(self.rows, self.world_size, index)

    def walk(self, pieces: int) -> tuple[tuple[tuple[tuple[int, int], tuple[torch.Size, ...]], ...], ...]:
        """`[p][index]`: piece p of chunk `index`, its global rows and the bundle's shapes for them, when every chunk
        is cut into `pieces` (`piece`, `shapes_of`): all a walk's hops ask, once per layout."""
        memo = self._memo()
        known = memo.get(("walk", pieces))
        if known is None:
            cuts = [[self.piece(i, p, pieces) for i in range(self.world_size)] for p in range(pieces)]
            known = memo[("walk", pieces)] = tuple(tuple((r, tuple(self.shapes_of(r))) for r in cut) for cut in cuts)
        return known

    def shapes(self, index: int) -> list[torch.Size]:
        if not 0 <= index < self.world_size:
            return self.shapes_of(self.bounds(index))
        return list(self.walk(1)[0][index][1])

    def shapes_of(self, rows: tuple[int, int]) -> list[torch.Size]:
        """Shapes of the bundle's rows [start, end)."""
        start, end = rows
        return [torch.Size((end - start, *shape[1:])) for shape in self.global_shapes]

    def piece(self, index: int, piece: int, pieces: int) -> tuple[int, int]:
        """Global rows of piece `piece` when chunk `index` is cut again into `pieces`: the same rule, each piece's
        rows rounded up to a multiple of PIECE_ROWS where every piece keeps a row (`piece_rows`)."""
        start, end = self.bounds(index)
        size = piece_rows(end - start, pieces)
        lo = min(piece * size, end - start)
        return start + lo, start + min(lo + size, end - start)

    # The torch.chunk rule makes chunk 0 the largest chunk, and its piece 0 the largest piece.
    def pieces_for(self, max_numel: int) -> int:
        """How many pieces keep every chunk's pieces within `max_numel` elements (the same on every rank)."""
        memo = self._memo()
        known = memo.get(("pieces", max_numel))
        if known is None:
            known = memo[("pieces", max_numel)] = self._pieces_for(max_numel)
        return known

    def _pieces_for(self, max_numel: int) -> int:
        rows = self.bounds(0)[1]
        per_row = sum(math.prod(shape[1:]) for shape in self.global_shapes)
        most = max(1, max_numel // max(1, per_row))  # rows a piece may hold
        pieces = max(1, min(rows, math.ceil(rows / most)))
        while pieces < rows and piece_rows(rows, pieces) > most:  # rounded up past the cap: one piece more
            pieces += 1
        return pieces

    def max_piece_numel(self, pieces: int) -> int:
        return sum(math.prod(s) for s in self.shapes_of(self.piece(0, 0, pieces)))

    def max_numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes(0))


@dataclass(frozen=True)
class StackedLayout(ChunkLayout):
    """Layouts of tensors that take the same input (q, k and v; gate and up) walked as one: chunk r is every
    member's chunk r, one after another, so one hop carries them all and one matmul computes them.

    Its rows are virtual and chunk-major: chunk r starts where chunk r-1 ends, and within it come the members'
    chunks r in turn. A walk's arithmetic (pieces, shapes, slots) then holds as for one tensor; `columns` maps
    each member's rows back. Every member must share the trailing shapes (one input width, all with a bias or
    none) and the world size."""

    members: tuple[ChunkLayout, ...] = ()

    @classmethod
    def of(cls, members: tuple[ChunkLayout, ...]) -> StackedLayout:
        trailing = {tuple(tuple(s[1:]) for s in m.global_shapes) for m in members}
        worlds = {m.world_size for m in members}
        if len(trailing) != 1 or len(worlds) != 1:
            raise ValueError(f"stacked layouts must share trailing shapes and world size, got {members}")
        total = sum(m.rows for m in members)
        shapes = tuple(torch.Size((total, *s[1:])) for s in members[0].global_shapes)
        return cls(shapes, members[0].world_size, tuple(members))

    def _size(self, index: int) -> int:
        return sum(b - a for a, b in (m.bounds(index) for m in self.members))

    def _bounds(self, index: int) -> tuple[int, int]:
        start = sum(self._size(i) for i in range(index))
        return start, start + self._size(index)

    def columns(self, member: int) -> list[int]:
        """The virtual rows holding member `member`'s rows, in its own order (chunk 0's first)."""
        out: list[int] = []
        for index in range(self.world_size):
            start = self.bounds(index)[0] + sum(self.members[m].bounds(index)[1] - self.members[m].bounds(index)[0]
                                                for m in range(member))  # fmt: skip
            first, last = self.members[member].bounds(index)
            out.extend(range(start, start + last - first))
        return out

    def own_sizes(self, index: int) -> list[int]:
        """How many rows each member has in chunk `index`, in order."""
        return [b - a for a, b in (m.bounds(index) for m in self.members)]
