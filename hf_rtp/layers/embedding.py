"""nn.Embedding cut by vocabulary: each held chunk looks up the ids inside its range (sum).

Ranges are disjoint, so "sum" is a masked write. Backward needs no weights, only the travelling
gradient accumulator, so the embedding's weights do not rotate a second time.

Subclasses that change the forward are refused, except one adaptation: the scaled word embedding of
Gemma 1/2/3 (`super().forward(ids) * self.embed_scale.to(self.weight.dtype)`), recognised by the
exact text of its forward, so an edited copy is refused rather than silently unscaled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.ring import Ring
from ..distributed.sharding import ChunkLayout
from ..private.torch_names import assert_async
from .common import finish_weight_grads, local, rotate_forward, source_text


def _in_range(ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return (ids >= start) & (ids < end)


class _RotatedEmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, ring: Ring, layout: ChunkLayout, padding_idx: int | None):
        out = weight.new_zeros(*ids.shape, layout.global_shapes[0][1])

        def compute(tokens, out, rows, chunk):
            (flat,) = tokens
            start, end = rows
            hit = _in_range(flat, start, end)  # -1, the tokens' padding, is in no chunk's range
            out[hit] = F.embedding(flat[hit] - start, chunk[0])

        rotate_forward(ring, [weight], layout, [ids.reshape(-1)], [-1], out.view(-1, out.shape[-1]), compute)
        ctx.save_for_backward(ids, weight)
        ctx.ring, ctx.layout, ctx.padding_idx = ring, layout, padding_idx
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ids, weight = ctx.saved_tensors
        layout = ctx.layout
        flat_ids = ids.reshape(-1)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:
            # vanilla nn.Embedding never updates its padding row
            flat_ids = flat_ids.masked_fill(flat_ids == ctx.padding_idx, -1)

        def accumulate(rows, _chunk, acc):
            start, end = rows
            hit = _in_range(flat_ids, start, end)
            acc[0].index_add_(0, flat_ids[hit] - start, g[hit].to(acc[0].dtype))

        landed = None
        if ctx.needs_input_grad[1]:
            landed = ctx.ring.backward_walk([weight], layout, accumulate, None)
        grad_weight, _ = finish_weight_grads(ctx, landed, ctx.ring, (weight,))
        return None, grad_weight, None, None, None


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
