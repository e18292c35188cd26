"""Cross-entropy through the rotated LM head without the [tokens, vocab] logits.

The head's vocabulary pieces already travel the ring past every rank's own hidden states. Forward
folds each piece into a running log-sum-exp and picks the target logit where the piece holds it;
backward walks the ring again, recomputes each piece's logits, and turns them into the hidden-state
gradient and into the travelling gradient of that piece of the head. Tokens go in blocks, so at most
[token block, piece rows] logits exist at once. No collective: each rank's loss is its own batch's,
and the head's gradient arrives home summed over ranks, as for any rotated weight.

The math is transformers' ForCausalLMLoss: logits in the head's compute dtype, the family's own
transform (`HeadTransform`) in that dtype too, then float32 for the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ring import Ring
from ..sharding import ChunkLayout
from .common import add_matmul, finish_weight_grads

BLOCK_BYTES = 16 * 2**20
"""float32 logits one block may hold: tokens per block = BLOCK_BYTES / (4 * piece rows)"""


@dataclass(frozen=True)
class HeadTransform:
    """What a family does to the head's output before the loss: `logits * multiply`, `logits / divide`,
    then `cap * tanh(logits / cap)` (Cohere, Granite, Gemma 2/3), each in the logits' dtype as vanilla does."""

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.multiply is not None:
            z = z * self.multiply
        if self.divide is not None:
            z = z / self.divide
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def backward(self, grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """d loss / d raw logits, from d loss / d transformed logits `grad` and the transformed `z` (in place)."""
        if self.softcap is not None:
            grad.mul_(1 - (z / self.softcap).square_())
        if self.divide is not None:
            grad.div_(self.divide)
        if self.multiply is not None:
            grad.mul_(self.multiply)
        return grad


def _logits(h: torch.Tensor, piece, transform: HeadTransform) -> torch.Tensor:
    return transform.forward(F.linear(h, *(t.to(h.dtype) for t in piece))).float()


def _blocks(tokens: int, rows: int):
    size = max(1, min(tokens, BLOCK_BYTES // (4 * max(1, rows))))
    return [(b, min(b + size, tokens)) for b in range(0, tokens, size)]


def _piece_blocks(h: torch.Tensor, targets: torch.Tensor, rows, piece, transform: HeadTransform):
    """For each block of tokens: its bounds, its logits over rows [start, end) of the vocabulary, which
    of its targets lie in those rows, and their column there (clamped where they do not)."""
    start, end = rows
    if start == end:
        return
    inside = (targets >= start) & (targets < end)
    column = (targets - start).clamp_(0, end - start - 1).unsqueeze(1)
    for b0, b1 in _blocks(h.shape[0], end - start):
        yield b0, b1, _logits(h[b0:b1], piece, transform), inside[b0:b1], column[b0:b1]


class _FusedCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, targets, ring: Ring, layout: ChunkLayout, transform: HeadTransform):
        tokens = h.shape[0]
        lse = torch.full((tokens,), -math.inf, dtype=torch.float32, device=h.device)
        picked = torch.zeros(tokens, dtype=torch.float32, device=h.device)

        def compute(rows, piece):
            for b0, b1, z, inside, column in _piece_blocks(h, targets, rows, piece, transform):
                lse[b0:b1] = torch.logaddexp(lse[b0:b1], torch.logsumexp(z, dim=1))
                picked[b0:b1] = torch.where(inside, z.gather(1, column).squeeze(1), picked[b0:b1])

        bundle = [weight] if bias is None else [weight, bias]
        with torch.autocast(h.device.type, enabled=False):
            ring.forward_walk(bundle, layout, compute)
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.ring, ctx.layout, ctx.transform = ring, layout, transform
        return lse - picked

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, bias, targets, lse = ctx.saved_tensors
        ring, layout, transform = ctx.ring, ctx.layout, ctx.transform
        grad_loss = grad_loss.float()
        grad_h = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        wants_weight_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]

        def through_piece(rows, piece, acc):
            """Recompute this piece's logits block by block; add to grad_h and to the travelling `acc`."""
            for b0, b1, z, inside, column in _piece_blocks(h, targets, rows, piece, transform):
                g = grad_loss[b0:b1]
                dz = torch.exp(z - lse[b0:b1, None]).mul_(g[:, None])  # softmax * upstream grad
                dz.scatter_add_(1, column, -(g * inside).unsqueeze(1))  # minus the one-hot target
                dl = transform.backward(dz, z).to(h.dtype)
                if acc is not None:
                    add_matmul(acc[0], dl.t(), h[b0:b1])
                    if bias is not None:
                        acc[1].add_(dl.sum(0).to(acc[1].dtype))
                if grad_h is not None:
                    grad_h[b0:b1].addmm_(dl, piece[0].to(h.dtype))

        bundle = [weight] if bias is None else [weight, bias]
        # The whole block's work happens where the weights are held: in `accumulate` when the head
        # trains (the gradient must be complete before it is sent on), else in `input_grad`.
        with torch.autocast(h.device.type, enabled=False):
            landed = ring.backward_walk(
                bundle,
                layout,
                through_piece if wants_weight_grad else None,
                (lambda rows, piece: None) if wants_weight_grad else (lambda rows, piece: through_piece(rows, piece, None)),
            )
        grad_weight, grad_bias = finish_weight_grads(ctx, landed, ring.size)
        return grad_h, grad_weight, grad_bias, None, None, None, None


def fused_cross_entropy(h, weight, bias, targets, ring: Ring, layout: ChunkLayout, transform: HeadTransform) -> torch.Tensor:
    """Per-token -log p(target) (float32) of hidden states `h` [tokens, hidden] through a rotated head."""
    return _FusedCrossEntropyFn.apply(h, weight, bias, targets, ring, layout, transform)
