"""How one sequence is cut across a ring for context parallelism, and where its tokens sit in the ring.

The sequence of S tokens is cut into 2N chunks (sizes differ by at most one), and rank r
holds chunks r and 2N-1-r, in that order. Under a causal mask a token attends to the tokens before it,
so early chunks cost little and late ones much; pairing them gives every rank about the same work.

For the ring, a rank's tokens are its rows: `SpanLayout` lays them end to end, rank 0's first, so the
K/V blocks walk the ring through the same `forward_walk` / `backward_walk` as the weight pieces, with
a rank's rows where its own tokens are rather than where `torch.chunk` would put them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sharding import ChunkLayout, chunk_rows

Interval = tuple[int, int, int]
"""(first local row, first global position, length): a run of consecutive tokens"""


@dataclass(frozen=True)
class SequenceLayout:
    length: int
    """S: the tokens of the whole sequence"""
    size: int
    """N: the ranks it is cut across"""

    def _size(self, index: int) -> int:
        # the tokens left over go to chunks 0, 2N-1, 1, 2N-2, ...: rank by rank, so ranks differ by one at most
        base, extra = divmod(self.length, 2 * self.size)
        turn = 2 * min(index, 2 * self.size - 1 - index) + (index >= self.size)
        return base + (turn < extra)

    def chunk(self, index: int) -> tuple[int, int]:
        """Global positions [start, end) of chunk `index` of the 2N."""
        start = sum(self._size(i) for i in range(index))
        return start, start + self._size(index)

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.size - 1 - rank

    def local_length(self, rank: int) -> int:
        return sum(end - start for start, end in map(self.chunk, self.chunks_of(rank)))

    def intervals(self, rank: int) -> list[Interval]:
        """Rank `rank`'s tokens as runs of global positions, in its local order."""
        runs, row = [], 0
        for index in self.chunks_of(rank):
            start, end = self.chunk(index)
            if end > start:
                runs.append((row, start, end - start))
            row += end - start
        return runs

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """The global position of each of rank `rank`'s tokens."""
        spans = [torch.arange(g, g + n, device=device) for _, g, n in self.intervals(rank)]
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long, device=device)

    def shard(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s tokens of `tensor` along `dim` (a copy)."""
        if tensor.shape[dim] != self.length:
            raise ValueError(f"a buffer has {tensor.shape[dim]} tokens along dim {dim}, the sequence {self.length}")
        pieces = [tensor.narrow(dim, g, n) for _, g, n in self.intervals(rank)]
        return torch.cat(pieces, dim) if pieces else tensor.narrow(dim, 0, 0).clone()

    def unshard(self, shares, dim: int) -> torch.Tensor:
        """The whole sequence along `dim` from every rank's tokens (`shard`'s inverse): shares[r] holds rank r's
        tokens first along `dim`, padding after them allowed (an all-gather needs equal sizes)."""
        first = shares[0]
        whole = first.new_empty((*first.shape[:dim], self.length, *first.shape[dim + 1 :]))
        for rank, share in enumerate(shares):
            index = self.positions(rank, whole.device)
            whole.index_copy_(dim, index, share.narrow(dim, 0, self.local_length(rank)))
        return whole

    def rows(self, shapes: tuple[torch.Size, ...]) -> SpanLayout:
        """The ring layout of tensors whose dim 0 is every rank's tokens end to end (shapes: rank-independent
        trailing dims, dim 0 the whole sequence)."""
        starts = [0]
        for rank in range(self.size):
            starts.append(starts[-1] + self.local_length(rank))
        return SpanLayout(tuple(shapes), self.size, tuple(starts))

    def global_intervals(self, rows: tuple[int, int]) -> list[Interval]:
        """Runs of global positions of ring rows [start, end) (see `rows`), as (row, position, length)."""
        start, end = rows
        runs, offset = [], 0
        for rank in range(self.size):
            for local, position, length in self.intervals(rank):
                lo, hi = max(start, offset + local), min(end, offset + local + length)
                if hi > lo:
                    runs.append((lo, position + lo - offset - local, hi - lo))
            offset += self.local_length(rank)
        return runs


@dataclass(frozen=True)
class SpanLayout(ChunkLayout):
    """A ChunkLayout whose chunk r is rows [starts[r], starts[r+1]): ranks' token counts, not torch.chunk's."""

    starts: tuple[int, ...] = ()

    def _bounds(self, index: int) -> tuple[int, int]:
        return self.starts[index], self.starts[index + 1]

    def _longest(self) -> int:
        return max(self.starts[i + 1] - self.starts[i] for i in range(self.world_size))

    def _pieces_for(self, max_numel: int) -> int:
        rows = self._longest()
        per_row = sum(math.prod(shape[1:]) for shape in self.global_shapes)
        return max(1, min(rows, math.ceil(rows / max(1, max_numel // max(1, per_row)))))

    def max_piece_numel(self, pieces: int) -> int:
        rows = chunk_rows(self._longest(), pieces, 0)[1]
        return sum(rows * math.prod(shape[1:]) for shape in self.global_shapes)

    def max_numel(self) -> int:
        return self.max_piece_numel(1)
