"""Rotated linears on the same input walked as one (layers/siblings.py decides when): q, k and v, or gate and up.

Every rotated linear walks the ring on its own, a hop and a matmul per chunk forward and again backward. Linears
that take the same tensor can share the walk: each rank stacks its chunks of all of them
(distributed/tensors/sharding.py's StackedLayout: chunk r is every member's chunk r in turn), so a hop carries one
stacked piece and one matmul computes every member's rows of it. A Llama layer's seven linears then walk as four. Each
member's output is its columns of the stacked output, in the input's dtype, as its own walk gives (F.linear, the bias
inside); backward scatters the members' output gradients back into the stacked order, and the weight gradients that
come home are split by member and finished as each member's own would be (layers/common.py's finish_weight_grads).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..distributed.tensors.sharding import StackedLayout
from ..distributed.transport.ring import Ring
from .common import cast_for_matmul, finish_weight_grads, rotate_forward
from .linear import walk_backward

_FIXED = 4  # the Function's inputs before the members' weights: x, ring, layout, spans

Spans = tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=64)
def member_spans(layout: StackedLayout) -> tuple[Spans, ...]:
    """Each member's columns of the stacked output as runs [start, end), in its own order: one run per chunk
    (StackedLayout.columns, made contiguous). A copy by slices runs at memory speed, where indexing the last
    dimension by a column tensor (index_select, index_copy_) gathered element by element: 7 ms for a 2 MB output
    of llama-90m's gate and up, 12 of them a step, on this project's CPU."""
    spans = []
    for m in range(len(layout.members)):
        runs: list[list[int]] = []
        for column in layout.columns(m):
            if runs and runs[-1][1] == column:
                runs[-1][1] += 1
            else:
                runs.append([column, column + 1])
        spans.append(tuple((a, b) for a, b in runs))
    return tuple(spans)


@functools.lru_cache(maxsize=64)
def _in_stacked_order(spans: tuple[Spans, ...]) -> tuple[tuple[int, int, int], ...]:
    """Every member's runs in the stacked output's column order: (member, start in the member's own columns, width),
    so one torch.cat of its gradients' slices is the stacked gradient (one copy, where a copy per run launches
    members x ranks kernels on a GPU)."""
    runs = []
    for m, member in enumerate(spans):
        at = 0
        for a, b in member:
            runs.append((a, m, at, b - a))
            at += b - a
    return tuple((m, at, width) for _, m, at, width in sorted(runs))


def _gathered(out: torch.Tensor, spans: Spans) -> torch.Tensor:
    """A member's columns of `out`, a new tensor (not a view of `out`)."""
    if len(spans) == 1:
        return out[..., spans[0][0] : spans[0][1]].clone(memory_format=torch.contiguous_format)
    return torch.cat([out[..., a:b] for a, b in spans], dim=-1)


class _StackedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, given, ring: Ring, layout: StackedLayout, spans: tuple[Spans, ...], *params):
        # autocast's cast here, not before the Function: backward adds the members' input gradients in the
        # input's own dtype, as vanilla's members, each with its own cast, have autograd add them
        x = cast_for_matmul(given)
        count = len(layout.members)
        weights, biases = params[:count], params[count:]
        out = x.new_empty(*x.shape[:-1], layout.rows)

        def compute(tokens, out, rows, chunk):
            out[:, rows[0] : rows[1]] = F.linear(tokens[0], *(t.to(tokens[0].dtype) for t in chunk))

        with torch.autocast(x.device.type, enabled=False):
            own = _own(weights, biases)
            flat = out.view(-1, layout.rows)
            rotate_forward(ring, own, layout, [x.reshape(-1, x.shape[-1])], [0.0], flat, compute, x.dtype)
            outputs = tuple(_gathered(out, member) for member in spans)  # new tensors, not views of `out`
        ctx.save_for_backward(x, *params)
        ctx.ring, ctx.layout, ctx.spans, ctx.count, ctx.given = ring, layout, spans, count, given.dtype
        return outputs

    @staticmethod
    def backward(ctx, *grad_outs):
        x, *params = ctx.saved_tensors
        ring, layout, count = ctx.ring, ctx.layout, ctx.count
        weights, biases = params[:count], params[count:]
        tokens = x.reshape(-1, x.shape[-1]).shape[0]
        like = next((g for g in grad_outs if g is not None), None)
        dtype = like.dtype if like is not None else x.dtype
        member_grads = [  # an output nothing used: no gradient, zeros; tokens may be 0 (an empty tile)
            g.reshape(tokens, g.shape[-1])
            if g is not None
            else x.new_zeros(tokens, sum(b - a for a, b in member), dtype=dtype)
            for member, g in zip(ctx.spans, grad_outs, strict=True)
        ]
        g2 = torch.cat([member_grads[m][:, at : at + width] for m, at, width in _in_stacked_order(ctx.spans)], dim=1)
        # each member's input gradient summed apart (its runs of the stacked rows), added as autograd adds vanilla's
        grad_x, landed = walk_backward(ctx, _own(weights, biases), x, g2, ctx.spans, ctx.given)
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
    weights: list[torch.Tensor],
    biases: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, ...]:
    """Every member's `F.linear(x, weight, bias)` by one walk: `weights` and `biases` are this rank's chunks
    (layers.common.local)."""
    return _StackedLinearFn.apply(x, ring, layout, member_spans(layout), *weights, *(biases or []))
