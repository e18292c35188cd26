"""nn.Embedding cut by vocabulary: each held chunk looks up the ids inside its range (sum).

Ranges are disjoint, so "sum" is a masked write. Backward needs no weights, only the travelling
gradient accumulator, so the embedding's weights do not rotate a second time. Where the forward moved the
tokens instead (few tokens: distributed/transport/weights_or_tokens.py), backward moves them too, with their output
gradients: each rank adds up its own chunk's gradient from every rank's tokens as they visit (Ring.visit_walk), N-1
hops of the tokens' gradients in place of N-1 hops of the chunk's accumulator, in pieces.

Which of a rank's tokens a piece holds is data, and selecting them by a boolean mask reads its size on
the host (on CUDA, a wait for the device) at every piece, forward and backward: 2 x pieces x ranks reads
a step. Instead the ids are sorted once per forward and their positions at every piece's boundaries read
in one transfer (`_Partition`): each piece then looks up exactly its tokens, by index, and backward adds
their gradients by the same indices with no read at all. Where tokens are so few that looking every token
up in every piece costs less than that one read (a decode step: tokens x pieces <= `_FEW`), each piece
looks every token up, folded into its rows, and `torch.where` keeps the rows it holds: no read. Both give
F.embedding's values bit for bit.

Subclasses that change the forward are refused, except one adaptation: the scaled word embedding of
Gemma 1/2/3 (`super().forward(ids) * self.embed_scale.to(self.weight.dtype)`), recognised by the
exact text of its forward, so an edited copy is refused rather than silently unscaled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.tensors.sharding import ChunkLayout
from ..distributed.transport.ring import Ring
from ..private.torch_names import assert_async
from .common import finish_weight_grads, local, rotate_forward, source_text


def _in_range(ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return (ids >= start) & (ids < end)


def _folded(ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Each id as a row of the piece [start, end): its own where the piece holds it, some row elsewhere."""
    return torch.remainder(ids - start, end - start)


def _add_held(acc: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, start: int, end: int) -> None:
    """Add the gradients `g` of the tokens `ids` whose rows [start, end) holds into `acc` (those rows), no read on the
    host: folded ids spread the misses' zeros over the rows, so no one row takes them all (CUDA atomics)."""
    hit = _in_range(ids, start, end).unsqueeze(-1)
    acc.index_add_(0, _folded(ids, start, end), torch.where(hit, g, 0).to(acc.dtype))


# Tokens x pieces up to which every piece looks up every token (no read on the host): at a 4096-wide float32
# embedding about 200 us of a GPU's memory bandwidth, a read's cost; beyond, the sorted partition costs less.
_FEW = 4096
_EDGES: dict[tuple, torch.Tensor] = {}  # every piece boundary of a layout, on a device: made once


def _edges(layout: ChunkLayout, pieces: int, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """The rows where a piece of the weight walk starts or ends, on the host and on `device`."""
    edges = sorted({row for j in range(layout.world_size) for p in range(pieces) for row in layout.piece(j, p, pieces)})
    key = (tuple(edges), device)
    if key not in _EDGES:  # non_blocking from the host: the copy does not wait for the device's queue
        _EDGES[key] = torch.tensor(edges, dtype=torch.int64).to(device, non_blocking=True)
    return edges, _EDGES[key]


class _Partition:
    """A rank's tokens sorted by id, and where each piece boundary falls among them (one read on the host): the
    tokens of rows [start, end) are `order[at[start]:at[end]]`."""

    def __init__(self, flat: torch.Tensor, layout: ChunkLayout, pieces: int):
        edges, on_device = _edges(layout, pieces, flat.device)
        self.sorted, self.order = torch.sort(flat)
        self.at = dict(zip(edges, torch.searchsorted(self.sorted, on_device).tolist(), strict=True))

    def tokens(self, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions among the rank's tokens, their ids) of the tokens rows [start, end) hold; None for rows
        that are not a span between piece boundaries."""
        lo, hi = self.at.get(rows[0]), self.at.get(rows[1])
        if lo is None or hi is None:
            return None
        return self.order[lo:hi], self.sorted[lo:hi]


class _RotatedEmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, ring: Ring, layout: ChunkLayout, padding_idx: int | None):
        out = weight.new_zeros(*ids.shape, layout.global_shapes[0][1])
        flat, pieces = ids.reshape(-1), ring.pieces(layout, weight)
        whole = (0, layout.rows)
        partition: list[_Partition] = []  # made at the first piece that uses it: a walk that moves tokens does not

        def compute(tokens, out, rows, chunk):
            (given,) = tokens
            start, end = rows
            if end <= start:  # an empty piece (uneven chunks) holds no token's row
                return
            if rows == whole:  # a ring of one: every token is this chunk's
                out.copy_(F.embedding(given - start, chunk[0]))
                return
            if given is flat and flat.numel() * layout.world_size * pieces > _FEW:
                if not partition:
                    partition.append(_Partition(flat, layout, pieces))
                found = partition[0].tokens(rows)
                if found is not None:
                    where, held = found
                    out.index_copy_(0, where, F.embedding(held - start, chunk[0]))
                    return
            hit = _in_range(given, start, end)  # -1, the tokens' padding, is in no chunk's range
            looked = F.embedding(_folded(given, start, end), chunk[0])
            torch.where(hit.unsqueeze(-1), looked, out, out=out)  # ranges are disjoint: zeros where it hits

        moved = rotate_forward(ring, [weight], layout, [flat], [-1], out.view(-1, out.shape[-1]), compute)
        ctx.save_for_backward(ids, weight)
        ctx.ring, ctx.layout, ctx.padding_idx, ctx.moved = ring, layout, padding_idx, moved
        ctx.partition = partition[0] if partition else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ids, weight = ctx.saved_tensors
        layout, partition = ctx.layout, ctx.partition
        flat_ids = ids.reshape(-1)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:  # vanilla nn.Embedding never updates its padding row: its tokens add zeros
            g = g.masked_fill((flat_ids == ctx.padding_idx).unsqueeze(-1), 0)

        def accumulate(rows, _chunk, acc):
            start, end = rows
            if end <= start:
                return
            found = partition.tokens(rows) if partition is not None else None
            if found is not None:  # the forward's partition: the pieces of a weight walk, no read
                where, held = found
                acc[0].index_add_(0, held - start, g.index_select(0, where).to(acc[0].dtype))
                return
            _add_held(acc[0], flat_ids, g, start, end)

        landed = None
        if ctx.needs_input_grad[1] and ctx.moved is not None:
            landed = [_visited(ctx.ring, layout, weight, flat_ids, g, ctx.moved)]
        elif ctx.needs_input_grad[1]:
            landed = ctx.ring.backward_walk([weight], layout, accumulate, None)
        grad_weight, _ = finish_weight_grads(ctx, landed, ctx.ring, (weight,))
        return None, grad_weight, None, None, None


def _visited(ring: Ring, layout: ChunkLayout, weight, ids: torch.Tensor, g: torch.Tensor, bound: int) -> torch.Tensor:
    """This rank's chunk's summed gradient, added up here from every rank's ids and output gradients as they visit
    (Ring.visit_walk): where the forward moved the tokens (every rank did, padded to the same `bound`), their
    gradients are smaller than the chunk, and none of them has to come home."""
    start, end = layout.bounds(ring.rank)
    home = weight.new_zeros(weight.shape, dtype=ring.reduce_dtype or weight.dtype)

    def visit(tokens):
        if end > start:  # an empty chunk (uneven chunks) holds no token's row
            given, grads = tokens
            _add_held(home, given, grads, start, end)  # the padding's -1 is in no chunk's range

    ring.visit_walk([ids, g], [-1, 0.0], bound, visit)
    return home if home.dtype == weight.dtype else home.to(weight.dtype)


class RotatedEmbedding(nn.Embedding):
    """A drop-in nn.Embedding whose weight is a Shard(0) DTensor over the vocabulary."""

    def __init__(self, source: Any, *, ring: Ring, weight: nn.Parameter):  # an nn.Embedding, maybe scaled (Gemma)
        nn.Module.__init__(self)
        if source.max_norm is not None or source.scale_grad_by_freq or source.sparse:
            raise NotImplementedError(
                "hf_rtp rotates plain embeddings only; max_norm, scale_grad_by_freq and sparse are not supported"
            )
        self.num_embeddings, self.embedding_dim = source.num_embeddings, source.embedding_dim
        self.padding_idx = source.padding_idx
        self.max_norm, self.norm_type = None, source.norm_type
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = weight
        self.ring = ring
        self.layout = ChunkLayout((weight.shape,), ring.size)
        if _is_scaled(source):  # a non-persistent buffer, as in the source: same buffers and state_dict
            self.register_buffer("embed_scale", source.embed_scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Vanilla fails on such ids; here they would silently embed to zeros. Async: no GPU sync.
        assert_async(
            ((ids >= 0) & (ids < self.num_embeddings)).all(),
            f"token ids must lie in [0, {self.num_embeddings}): check the tokenizer matches the model",
        )
        out = _RotatedEmbeddingFn.apply(ids, local(self.weight), self.ring, self.layout, self.padding_idx)
        embed_scale = getattr(self, "embed_scale", None)
        return out if embed_scale is None else out * embed_scale.to(out.dtype)


_SCALED_FORWARD = (
    "def forward(self, input_ids):\n    return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)"
)


def _is_scaled(module: nn.Module) -> bool:
    return (
        isinstance(getattr(module, "embed_scale", None), torch.Tensor)
        and source_text(type(module).forward) == _SCALED_FORWARD
    )


def embedding_refusal(module: nn.Module) -> str | None:
    """Why the embedding kind cannot reproduce this module exactly, or None when it can."""
    if not isinstance(module, nn.Embedding):
        return "it is not an nn.Embedding"
    if type(module).forward is nn.Embedding.forward or _is_scaled(module):
        return None
    return f"{type(module).__name__} overrides nn.Embedding.forward with math hf_rtp does not reproduce"
