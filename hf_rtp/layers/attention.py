"""Causal attention over one sequence cut across the ring (context parallelism): ring attention.

Each rank holds the queries, keys and values of its own tokens (distributed.sequence: chunks r and
2N-1-r). The K/V blocks walk the ring as the weight pieces do (`Ring.forward_walk`: the next block in
flight while this one is computed, two foreign blocks at most, from the shared pool). Each block's
part of the attention comes from SDPA's flash kernel, which returns the block's output and its
log-sum-exp; merging them by their log-sum-exp gives exactly softmax attention over all keys.

Backward walks the blocks again (`Ring.backward_walk`): the flash kernel's backward, given the merged
output and log-sum-exp, gives each block's exact share of dQ, dK and dV; dK and dV travel with their
block and come home summed, as weight gradients do.

Causality is decided per run of global positions (`_blocks`): a query sees the keys at its position
and before. A query run against a key run splits into a part that sees the whole run, a square that
is causal within itself (SDPA's `is_causal`, top-left aligned) and a part that sees none of it.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import torch

from ..distributed.ring import Ring
from ..distributed.sequence import Interval, SequenceLayout
from ..private.torch_names import flash_attention_cpu, flash_attention_cpu_backward

Block = tuple[tuple[int, int], tuple[int, int], bool]
"""(query rows, key rows, causal): one call of the flash kernel"""


def _documents(runs: list[Interval], starts: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """Runs cut where a document starts (packed sequences), each tagged with its document's index."""
    out = []
    for row, pos, n in runs:
        inside = starts[bisect.bisect_right(starts, pos) : bisect.bisect_left(starts, pos + n)]
        for a, b in itertools.pairwise([pos, *inside, pos + n]):
            out.append((row + a - pos, a, b - a, bisect.bisect_right(starts, a) - 1))
    return out


def _blocks(queries: list[Interval], keys: list[Interval], starts: tuple[int, ...] = (0,)) -> list[Block]:
    """Kernel calls that cover causal attention of `queries` to `keys` (runs of (row, position, length)),
    each a rectangle fully visible or a square causal within itself; with `starts`, the positions where packed
    documents start, a query sees only its own document's keys."""
    blocks: list[Block] = []
    by_document: dict[int, list[tuple[int, int, int, int]]] = {}
    for run in _documents(keys, starts):
        by_document.setdefault(run[3], []).append(run)
    for q_row, q0, q_len, q_doc in _documents(queries, starts):
        q1 = q0 + q_len
        for k_row, k0, k_len, _ in by_document.get(q_doc, ()):
            k1 = k0 + k_len
            lo, hi = max(q0, k0), min(q1, k1)  # queries inside the key run: causal square, plus keys before it
            if hi > lo:
                rows = (q_row + lo - q0, q_row + hi - q0)
                if lo > k0:
                    blocks.append((rows, (k_row, k_row + lo - k0), False))
                blocks.append((rows, (k_row + lo - k0, k_row + hi - k0), True))
            after = max(q0, k1)  # queries after the key run see all of it
            if q1 > after:
                blocks.append(((q_row + after - q0, q_row + q_len), (k_row, k_row + k_len), False))
    return blocks


def _row_groups(docs: tuple[tuple[int, ...], ...] | None, device) -> list[tuple[tuple[int, ...], Any]]:
    """Batch rows packed alike, each group with its document starts and its rows (a slice when all rows are)."""
    if docs is None:
        return [((0,), slice(None))]
    by: dict[tuple[int, ...], list[int]] = {}
    for row, starts in enumerate(docs):
        by.setdefault(starts, []).append(row)
    if len(by) == 1:
        return [(next(iter(by)), slice(None))]
    return [(starts, torch.tensor(rows, device=device)) for starts, rows in by.items()]


def _heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[tokens, batch, kv_heads, dim] -> [batch, heads, tokens, dim], K/V heads repeated as repeat_kv does."""
    t = t.permute(1, 2, 0, 3)
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _unheads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `_heads`: [batch, heads, tokens, dim] -> [tokens, batch, kv_heads, dim]."""
    if groups > 1:
        t = t.unflatten(1, (-1, groups)).sum(2)
    return t.permute(2, 0, 1, 3)


def _merge_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _widened(v: torch.Tensor, width: int) -> torch.Tensor:
    """V with zero columns up to the query/key head size: the flash kernel wants one head size, and zero
    columns of V give zero columns of the output and take no gradient (DeepSeek's MLA: v_head_dim < qk's)."""
    return v if v.shape[-1] == width else torch.nn.functional.pad(v, (0, width - v.shape[-1]))


class RingAttentionFn(torch.autograd.Function):
    """softmax(Q K^T * scale + causal) V over the whole sequence, for this rank's queries."""

    @staticmethod
    def forward(ctx, q, k, v, scale, ring: Ring, layout: SequenceLayout, docs=None):
        groups, width = q.shape[1] // k.shape[1], q.shape[-1]
        row_groups = _row_groups(docs, q.device)
        own = [k.permute(2, 0, 1, 3).contiguous(), v.permute(2, 0, 1, 3).contiguous()]  # tokens first: ring rows
        rows = layout.rows(tuple(torch.Size((layout.length, *t.shape[1:])) for t in own))
        queries = layout.intervals(ring.rank)
        merged = _merge_dtype(q.dtype)
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=merged)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=merged)

        def compute(span, held):
            keys = [(row - span[0], pos, n) for row, pos, n in layout.global_intervals(span)]
            for starts, b in row_groups:
                for (qa, qb), (ka, kb), causal in _blocks(queries, keys, starts):
                    o, m = flash_attention_cpu(
                        q[b, :, qa:qb], _heads(held[0][ka:kb, b], groups),
                        _widened(_heads(held[1][ka:kb, b], groups), width), 0.0, causal, scale=scale,
                    )  # fmt: skip
                    o, m = o[..., : v.shape[-1]].to(merged), m.to(merged)
                    before = lse[b, :, qa:qb]
                    total = torch.logaddexp(before, m)
                    out[b, :, qa:qb] = out[b, :, qa:qb] * (before - total).exp().unsqueeze(-1) + o * (
                        m - total
                    ).exp().unsqueeze(-1)
                    lse[b, :, qa:qb] = total

        with torch.autocast(q.device.type, enabled=False):
            ring.forward_walk(own, rows, compute)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.scale, ctx.ring, ctx.layout, ctx.docs = scale, ring, layout, docs
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, layout, scale = ctx.ring, ctx.layout, ctx.scale
        groups, width = q.shape[1] // k.shape[1], q.shape[-1]
        own = [k.permute(2, 0, 1, 3).contiguous(), v.permute(2, 0, 1, 3).contiguous()]
        rows = layout.rows(tuple(torch.Size((layout.length, *t.shape[1:])) for t in own))
        queries = layout.intervals(ring.rank)
        summed = _merge_dtype(q.dtype)
        grad_out, out = _widened(grad_out.contiguous(), width), _widened(out, width)
        grad_q = torch.zeros(q.shape, dtype=summed, device=q.device)
        kernel_lse = lse.to(torch.float32) if q.dtype in (torch.bfloat16, torch.float16) else lse
        row_groups = _row_groups(ctx.docs, q.device)

        def accumulate(span, held, acc):
            keys = [(row - span[0], pos, n) for row, pos, n in layout.global_intervals(span)]
            for starts, b in row_groups:
                for (qa, qb), (ka, kb), causal in _blocks(queries, keys, starts):
                    dq, dk, dv = flash_attention_cpu_backward(
                        grad_out[b, :, qa:qb], q[b, :, qa:qb], _heads(held[0][ka:kb, b], groups),
                        _widened(_heads(held[1][ka:kb, b], groups), width), out[b, :, qa:qb],
                        kernel_lse[b, :, qa:qb].contiguous(), 0.0, causal, scale=scale,
                    )  # fmt: skip
                    grad_q[b, :, qa:qb] += dq
                    acc[0][ka:kb, b] += _unheads(dk, groups)
                    acc[1][ka:kb, b] += _unheads(dv[..., : held[1].shape[-1]], groups)

        with torch.autocast(q.device.type, enabled=False):
            home = ring.backward_walk(own, rows, accumulate, lambda span, held: None, accumulate_dtype=summed)
        assert home is not None  # accumulate was given
        grad_k, grad_v = (h.permute(1, 2, 0, 3).to(k.dtype) for h in home)
        return grad_q.to(q.dtype), grad_k, grad_v, None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale, ring: Ring, layout: SequenceLayout, docs=None
):
    """Causal attention of this rank's queries [batch, heads, tokens, dim] to the whole sequence's keys and
    values ([batch, kv_heads, tokens, dim], heads a multiple of kv_heads); returns [batch, heads, tokens, dim].
    `docs`: per batch row, the positions where its packed documents start (None: one document per row)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k.shape[1]} key/value heads evenly")
    if v.shape[-1] > q.shape[-1]:
        raise ValueError(f"values of {v.shape[-1]} per head, wider than queries and keys ({q.shape[-1]})")
    return RingAttentionFn.apply(q, k, v, scale, ring, layout, docs)
