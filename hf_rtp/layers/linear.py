"""nn.Linear cut by output features: each held chunk fills its slice of the output (concatenate).

Also the LM head, tied or not: a vocabulary-split linear whose chunks are the embedding's chunks.

Subclasses that change the forward are refused, except those whose forward is a plain linear map
written out, recognised by the exact text of that forward (Falcon's `FalconLinear`: `input @ W.T`,
then `+ bias`), so an edited copy is refused rather than computed with other math. Such a module is
computed as its code does: the matmul, then the bias added outside it, so under autocast the sum is
promoted to the bias's float32 as vanilla's is (F.linear would return bf16 with a bf16 bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.tensors.sharding import ChunkLayout
from ..distributed.transport.ring import Ring
from .common import (
    add_matmul,
    add_matmul_summed,
    cast_for_matmul,
    finish_weight_grads,
    local,
    own_bundle,
    rotate_forward,
    source_text,
    sum_dtype,
)


class _RotatedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ring: Ring, layout: ChunkLayout, bias_after: bool = False, head: bool = False):
        # bias_after: `x @ W.T + bias` written out (FalconLinear): the sum in the promoted dtype, as its code
        added = bias_after and bias is not None
        out = x.new_empty(*x.shape[:-1], layout.rows, dtype=torch.promote_types(x.dtype, bias.dtype) if added else None)

        def compute(tokens, out, rows, chunk):
            (x2,) = tokens
            start, end = rows
            if added:
                out[:, start:end] = x2 @ chunk[0].to(x2.dtype).T + chunk[1]
            else:
                out[:, start:end] = F.linear(x2, *(t.to(x2.dtype) for t in chunk))

        with torch.autocast(x.device.type, enabled=False):
            # an added bias keeps its own dtype, so the bundle travels in the parameters' dtype
            own = own_bundle(weight, bias)
            rotate_forward(
                ring,
                own,
                layout,
                [x.reshape(-1, x.shape[-1])],
                [0.0],
                out.view(-1, layout.rows),
                compute,
                None if added else x.dtype,
                head=head,
            )
        # Only the input is kept for backward; the weights are fetched again by the backward walk.
        ctx.save_for_backward(x, weight, bias)
        ctx.ring, ctx.layout = ring, layout
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        grad_x, landed = walk_backward(ctx, own_bundle(weight, bias), x, grad_out.reshape(-1, grad_out.shape[-1]))
        grad_weight, grad_bias = finish_weight_grads(ctx, landed, ctx.ring, (weight, bias))
        return grad_x, grad_weight, grad_bias, None, None, None, None


def walk_backward(
    ctx,
    own: list[torch.Tensor],
    x: torch.Tensor,
    g2: torch.Tensor,
    members: tuple[tuple[tuple[int, int], ...], ...] | None = None,
    grad_dtype: torch.dtype | None = None,
):
    """Backward of `x @ W.T (+ b)` over the ring (ctx.ring, ctx.layout; `own`: this rank's weight and bias rows):
    the input's gradient (None unless ctx.needs_input_grad[0]) and the summed weight and bias gradients that came
    home (Ring.backward_walk; None unless some later input wants one), from `g2` [tokens, rows], the output's.

    The input's gradient is a sum over the walk's chunks, `sum_c g[:, c] @ W_c`, where vanilla's one matmul sums over
    every row in float32 and rounds once: a bf16 or fp16 input's is summed here in float32, each chunk's partial
    unrounded (common.matmul_float32), and rounded to x's dtype once at the end. `members` (stacked linears,
    layers/stacked.py: each member's runs of the stacked rows): each member's sum apart, rounded apart as its own
    matmul rounds, then added in `grad_dtype` (the dtype of the input before autocast's cast, default x's) as
    autograd adds vanilla's separate linears' gradients, the last member's first. float32 and float64 inputs sum
    in place in their own dtype, as before."""
    x2 = x.reshape(-1, x.shape[-1])
    gm = g2.to(x.dtype)  # what reaches the matmul: autograd casts a promoted sum's gradient back to its dtype
    summed = sum_dtype(x.dtype)
    apart = members if members is not None and summed != x.dtype else None
    # a float32 accumulator of the input's size per member (one for a single linear): summed until the walk ends
    sums = [x2.new_zeros(x2.shape, dtype=summed) for _ in apart or (None,)] if ctx.needs_input_grad[0] else None
    biased = len(own) > 1

    def accumulate(rows, _chunk, acc):
        start, end = rows
        add_matmul(acc[0], gm[:, start:end].t(), x2)
        if biased:
            acc[1].add_(g2[:, start:end].sum(0))

    def input_grad(rows, chunk):
        start, end = rows
        assert sums is not None  # input_grad runs only when the sums were made
        weight = chunk[0].to(gm.dtype)
        if apart is None:
            add_matmul_summed(sums[0], gm[:, start:end], weight)
            return
        for acc, runs in zip(sums, apart, strict=True):
            for a, b in runs:
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    add_matmul_summed(acc, gm[:, lo:hi], weight[lo - start : hi - start])

    landed = ctx.ring.backward_walk(
        own,
        ctx.layout,
        accumulate if any(ctx.needs_input_grad[1:]) else None,
        input_grad if sums is not None else None,
        dtype=x.dtype,
    )
    if sums is None:
        return None, landed
    into = grad_dtype or x.dtype
    grad_x = sums[-1].to(x.dtype).to(into)  # rounded once to the matmul's dtype, as vanilla's GEMM rounds
    for acc in reversed(sums[:-1]):
        grad_x = grad_x + acc.to(x.dtype).to(into)
    return grad_x.view(x.shape), landed


class RotatedLinear(nn.Linear):
    """A drop-in nn.Linear whose weight (and bias) is a Shard(0) DTensor rotated around the ring.

    It stays an nn.Linear (global in/out features, vanilla parameter names) so PEFT, Trainer and
    `named_parameters()` see what they expect.
    """

    is_head = False  # the model's LM head (model.install): generate calls it on each sequence's last token only

    def __init__(self, source: nn.Linear, *, ring: Ring, weight: nn.Parameter, bias: nn.Parameter | None = None):
        nn.Module.__init__(self)  # nn.Linear.__init__ would allocate a full weight
        self.in_features, self.out_features = source.in_features, source.out_features
        self.weight = weight
        self.bias = bias  # type: ignore[assignment]  # nn.Linear declares a Parameter, holds None without bias
        self.ring = ring
        shapes = (weight.shape,) if bias is None else (weight.shape, bias.shape)
        self.layout = ChunkLayout(tuple(shapes), ring.size)
        # a forward in PLAIN_LINEAR_FORWARDS (linear_refusal let it through) adds its bias after the matmul
        self.bias_after_matmul = type(source).forward is not nn.Linear.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        siblings = self.__dict__.get("siblings")  # layers.siblings: q, k and v on the same tokens, say
        if siblings is not None:
            found = siblings.forward(self, x)
            if found is not None:
                return found
        return _RotatedLinearFn.apply(
            cast_for_matmul(x),
            local(self.weight),
            local(self.bias),
            self.ring,
            self.layout,
            self.bias_after_matmul,
            self.is_head,
        )


# forwards of nn.Linear subclasses that compute exactly nn.Linear's map, by their code (layers.common.source_text)
PLAIN_LINEAR_FORWARDS = {
    "FalconLinear": "def forward(self, input):\n    hidden_states = input @ self.weight.T\n    if self.bias is None:\n"
    "        return hidden_states\n    return hidden_states + self.bias",
}


def linear_refusal(module: nn.Module) -> str | None:
    """Why the linear kind cannot reproduce this module exactly, or None when it can."""
    if not isinstance(module, nn.Linear):
        return "it is not a Linear"
    forward = type(module).forward
    if forward is nn.Linear.forward or source_text(forward) in PLAIN_LINEAR_FORWARDS.values():
        return None
    return f"{type(module).__name__} overrides Linear.forward, which hf_rtp does not reproduce"
