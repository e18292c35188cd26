"""Rotated linears on the same input walked as one (layers/siblings.py decides when): q, k and v, or gate and up.

Every rotated linear walks the ring on its own, a hop and a matmul per chunk forward and again backward. Linears
that take the same tensor can share the walk: each rank stacks its chunks of all of them (distributed/sharding.py's
StackedLayout: chunk r is every member's chunk r in turn), so a hop carries one stacked piece and one matmul computes
every member's rows of it. A Llama layer's seven linears then walk as four. Each member's output is its columns of
the stacked output, in the input's dtype, as its own walk gives (F.linear, the bias inside); backward scatters the
members' output gradients back into the stacked order, and the weight gradients that come home are split by member
and finished as each member's own would be (layers/common.py's finish_weight_grads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.ring import Ring
from ..distributed.sharding import StackedLayout
from .common import finish_weight_grads, rotate_forward
from .linear import walk_backward

_FIXED = 4  # the Function's inputs before the members' weights: x, ring, layout, columns


class _StackedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ring: Ring, layout: StackedLayout, columns: list[torch.Tensor], *params):
        count = len(layout.members)
        weights, biases = params[:count], params[count:]
        out = x.new_empty(*x.shape[:-1], layout.rows)

        def compute(tokens, out, rows, chunk):
            out[:, rows[0] : rows[1]] = F.linear(tokens[0], *(t.to(tokens[0].dtype) for t in chunk))

        with torch.autocast(x.device.type, enabled=False):
            own = _own(weights, biases)
            flat = out.view(-1, layout.rows)
            rotate_forward(ring, own, layout, [x.reshape(-1, x.shape[-1])], [0.0], flat, compute, x.dtype)
            outputs = tuple(out.index_select(-1, cols) for cols in columns)  # new tensors, not views of `out`
        ctx.save_for_backward(x, *params)
        ctx.ring, ctx.layout, ctx.columns, ctx.count = ring, layout, columns, count
        return outputs

    @staticmethod
    def backward(ctx, *grad_outs):
        x, *params = ctx.saved_tensors
        ring, layout, count = ctx.ring, ctx.layout, ctx.count
        weights, biases = params[:count], params[count:]
        tokens = x.reshape(-1, x.shape[-1]).shape[0]
        like = next((g for g in grad_outs if g is not None), None)
        g2 = x.new_zeros(tokens, layout.rows, dtype=like.dtype if like is not None else x.dtype)
        for cols, g in zip(ctx.columns, grad_outs, strict=True):
            if g is not None:  # an output nothing used: no gradient, zeros
                g2.index_copy_(1, cols, g.reshape(tokens, g.shape[-1]))  # tokens may be 0 (an empty tile)
        grad_x, landed = walk_backward(ctx, _own(weights, biases), x, g2)
        sizes = layout.own_sizes(ring.rank)
        split = [t.split(sizes) for t in landed] if landed is not None else None
        weight_grads, bias_grads = [], []
        for m in range(count):
            mine = None if split is None else [parts[m] for parts in split]
            positions = (_FIXED + m, _FIXED + count + m) if biases else (_FIXED + m,)
            inputs = (weights[m], biases[m]) if biases else (weights[m],)
            grads = finish_weight_grads(ctx, mine, ring, inputs, positions)
            weight_grads.append(grads[0])
            if biases:
                bias_grads.append(grads[1])
        return grad_x, None, None, None, *weight_grads, *bias_grads


def _own(weights, biases) -> list[torch.Tensor]:
    """This rank's stacked chunk: every member's chunk in turn (a copy, made once per walk)."""
    own = [torch.cat(weights)]
    if biases:
        own.append(torch.cat(biases))
    return own


def stacked_linear(
    x: torch.Tensor,
    ring: Ring,
    layout: StackedLayout,
    columns: list[torch.Tensor],
    weights: list[torch.Tensor],
    biases: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, ...]:
    """Every member's `F.linear(x, weight, bias)` by one walk: `weights` and `biases` are this rank's chunks
    (layers.common.local), `columns` each member's rows of the stacked output (StackedLayout.columns, on x's
    device)."""
    return _StackedLinearFn.apply(x, ring, layout, columns, *weights, *(biases or []))
