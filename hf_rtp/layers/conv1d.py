"""GPT-2's Conv1D ([in, out] weight) cut by input features: partials x[..., in_j] @ W_j are summed.

The fused c_attn therefore needs no q/k/v split. The bias belongs after the sum, so it stays
replicated and is added once, outside the rotation.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..distributed.tensors.sharding import ChunkLayout
from ..distributed.transport.ring import Ring
from .common import (
    add_matmul,
    add_matmul_summed,
    cast_for_matmul,
    finish_weight_grads,
    local,
    rotate_forward,
    sum_dtype,
)


class _RotatedConv1DFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ring: Ring, layout: ChunkLayout):
        x2 = x.reshape(-1, x.shape[-1])
        # a sum over the input features' chunks: in float32 for bf16 or fp16 inputs, each chunk's partial unrounded,
        # rounded to x's dtype once at the end as vanilla's one matmul rounds (a moved token walk carries it so)
        out = x2.new_zeros(x2.shape[0], layout.global_shapes[0][1], dtype=sum_dtype(x.dtype))

        def compute(tokens, out, rows, chunk):
            (x2,) = tokens
            start, end = rows
            add_matmul_summed(out, x2[:, start:end], chunk[0].to(x2.dtype))

        with torch.autocast(x.device.type, enabled=False):
            rotate_forward(ring, [weight], layout, [x2], [0.0], out, compute, dtype=x.dtype)
        ctx.save_for_backward(x, weight)
        ctx.ring, ctx.layout = ring, layout
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        layout = ctx.layout
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(x2) if ctx.needs_input_grad[0] else None

        def accumulate(rows, _chunk, acc):
            start, end = rows
            add_matmul(acc[0], x2[:, start:end].t(), g2)

        def input_grad(rows, chunk):
            start, end = rows
            assert grad_x is not None  # input_grad runs only when grad_x was made
            grad_x[:, start:end] = g2 @ chunk[0].to(g2.dtype).t()  # each chunk owns its input columns

        landed = ctx.ring.backward_walk(
            [weight],
            layout,
            accumulate if ctx.needs_input_grad[1] else None,
            input_grad if grad_x is not None else None,
            dtype=x.dtype,
        )
        grad_weight, _ = finish_weight_grads(ctx, landed, ctx.ring, (weight,))
        return (grad_x.view_as(x) if grad_x is not None else None), grad_weight, None, None


class RotatedConv1D(Conv1D):
    """A drop-in transformers Conv1D: Shard(0) DTensor weight over input features, plain bias."""

    def __init__(self, source: Conv1D, *, ring: Ring, weight: nn.Parameter, bias: nn.Parameter):
        nn.Module.__init__(self)  # Conv1D.__init__ would allocate a full weight
        self.nf, self.nx = source.nf, source.nx
        self.weight, self.bias = weight, bias
        self.ring = ring
        self.layout = ChunkLayout((weight.shape,), ring.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _RotatedConv1DFn.apply(cast_for_matmul(x), local(self.weight), self.ring, self.layout)
        return out + self.bias.to(out.dtype)  # vanilla's addmm casts the bias along under autocast
