"""Causal attention over one sequence cut across the ring (context parallelism): ring attention.

Each rank holds the queries, keys and values of its own tokens (distributed.tensors.sequence: chunks r and
2N-1-r). The K/V blocks walk the ring as the weight pieces do (`Ring.forward_walk`: the next block in
flight while this one is computed, two foreign blocks at most, from the shared pool). Each block's
part of the attention comes from one of SDPA's fused kernels (attention_kernels: flash, memory-efficient or
cuDNN on CUDA, flash on the CPU, as SDPA would pick), which returns the block's output and its log-sum-exp;
merging them by their log-sum-exp, in float32 for half inputs, gives exactly softmax attention over all keys.

Backward walks the blocks again (`Ring.backward_walk`): the kernel's backward, given the merged output and
log-sum-exp, gives each block's exact share of dQ, dK and dV; dK and dV travel with their block and come home
summed, as weight gradients do.

Causality is decided per run of global positions (`_blocks`): a query sees the keys at its position
and before. A query run against a key run splits into a part that sees the whole run, a square that
is causal within itself (SDPA's `is_causal`, top-left aligned) and a part that sees none of it; neighbouring
parts are then joined where their union is one such block, so a hop of whole chunks is one kernel call.

Trust (`trust`): a kernel is used only after it has matched attention computed whole on this device. The first
ring attention per (device, dtype, kernel, head sizes, GQA) of a process runs the kernel on a probe of a few hundred
random tokens, cut as a ring of 3 cuts a sequence, merged and differentiated by the same code as the ring, and
compares output, dQ, dK and dV with the exact attention in float64; a gap beyond the dtype's rounding is refused by
name (SettingError). Milliseconds, on this rank alone; model/context/inputs.py runs it inside the agreement at
the start of each forward, so a refusal reaches every rank.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from .. import faults
from ..distributed.tensors.sequence import Interval, SequenceLayout
from ..distributed.transport.ring import Ring
from ..errors import SettingError
from .attention_kernels import Aux, Kernel, kernel_for, merge_dtype, takes_groups

Block = tuple[tuple[int, int], tuple[int, int], bool]
"""(query rows, key rows, causal): one call of the kernel"""


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
    return _fewer(blocks)


def _fewer(blocks: list[Block]) -> list[Block]:
    """The same mask in fewer kernel calls: neighbouring blocks whose union is one rectangle fully visible, or one
    square causal within itself, become that block. On a rank's tokens cut as distributed.tensors.sequence cuts them
    (chunks r and 2N-1-r), every hop of a whole block is one call: its own (a causal square over both chunks: the second
    sees all of the first), a rank before it (all queries, its first chunk) and one after it (the second chunk of
    queries, all keys). Each kernel call costs a launch, its log-sum-exp merge and, on the CPU, a pass of its own
    over the queries."""
    out: list[Block] = []
    for block in blocks:
        out.append(block)
        while True:
            if len(out) >= 3 and _causal_square(*out[-3:]):
                (rows, keys, _), (last_rows, last_keys, _) = out[-3], out[-1]
                out[-3:] = [((rows[0], last_rows[1]), (keys[0], last_keys[1]), True)]
            elif len(out) >= 2 and (joined := _rectangle(out[-2], out[-1])) is not None:
                out[-2:] = [joined]
            else:
                break
    return out


def _rectangle(a: Block, b: Block) -> Block | None:
    """Two fully visible blocks side by side (the same keys, rows adjacent; or the same rows, keys adjacent)."""
    (rows_a, keys_a, causal_a), (rows_b, keys_b, causal_b) = a, b
    if causal_a or causal_b:
        return None
    if keys_a == keys_b and rows_a[1] == rows_b[0]:
        return (rows_a[0], rows_b[1]), keys_a, False
    if rows_a == rows_b and keys_a[1] == keys_b[0]:
        return rows_a, (keys_a[0], keys_b[1]), False
    return None


def _causal_square(first: Block, middle: Block, last: Block) -> bool:
    """A causal square, the rows after it seeing all of its keys, and a causal square of those rows with the keys
    after it: together one causal square (row i of the whole sees its first i + 1 keys)."""
    (rows_a, keys_a, causal_a), (rows_b, keys_b, causal_b), (rows_c, keys_c, causal_c) = first, middle, last
    return (
        causal_a and causal_c and not causal_b
        and rows_a[1] - rows_a[0] == keys_a[1] - keys_a[0] and rows_c[1] - rows_c[0] == keys_c[1] - keys_c[0]
        and keys_b == keys_a and rows_b == rows_c and rows_a[1] == rows_c[0] and keys_a[1] == keys_c[0]
    )  # fmt: skip


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


def _heads(t: torch.Tensor, repeat: int) -> torch.Tensor:
    """[tokens, batch, kv_heads, dim] -> [batch, heads, tokens, dim], K/V heads repeated as repeat_kv does (1: the
    kernel takes fewer K/V heads itself)."""
    t = t.permute(1, 2, 0, 3)
    return t.repeat_interleave(repeat, dim=1) if repeat > 1 else t


def _unheads(t: torch.Tensor, repeat: int) -> torch.Tensor:
    """The gradient of `_heads`: [batch, heads, tokens, dim] -> [tokens, batch, kv_heads, dim]."""
    if repeat > 1:
        t = t.unflatten(1, (-1, repeat)).sum(2)
    return t.permute(2, 0, 1, 3)


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` with zero columns up to the kernel's head size: a kernel wants one head size for Q, K and V (and on CUDA
    a multiple of 8). Zero columns of Q and K change no dot product, zero columns of V give zero columns of the
    output, and none takes a gradient (DeepSeek's MLA: v_head_dim < qk's)."""
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


@dataclass(frozen=True)
class Call:
    """How one ring attention calls its kernel: chosen once per forward, kept for its backward."""

    kernel: Kernel
    scale: float
    repeat: int
    """K/V heads repeated this many times before the kernel (1: none, or the kernel takes GQA)"""
    width: int
    """the head size the kernel is called with"""


def _attend(call: Call, q, held, queries, keys, row_groups, out, lse) -> Aux | None:
    """This rank's queries (`q` widened, runs `queries`) against the keys and values `held` (tokens first, runs
    `keys`): each block's output merged into `out` by its log-sum-exp, `lse` the merged one (both in the merge
    dtype). Returns what the kernel's backward takes back (the same for every block), None without blocks."""
    aux = None
    for starts, b in row_groups:
        for (qa, qb), (ka, kb), causal in _blocks(queries, keys, starts):
            k = _widened(_heads(held[0][ka:kb, b], call.repeat), call.width)
            v = _widened(_heads(held[1][ka:kb, b], call.repeat), call.width)
            o, m, aux = call.kernel.forward(q[b, :, qa:qb], k, v, causal, call.scale)
            o = o[..., : out.shape[-1]].to(out.dtype)
            before = lse[b, :, qa:qb]
            total = torch.logaddexp(before, m)
            out[b, :, qa:qb] = out[b, :, qa:qb] * (before - total).exp().unsqueeze(-1) + o * (
                m - total
            ).exp().unsqueeze(-1)
            lse[b, :, qa:qb] = total
    return aux


def _attend_backward(call: Call, aux, grad_out, q, out, lse, held, acc, grad_q, queries, keys, row_groups) -> None:
    """`_attend`'s backward: each block's share of dQ added to `grad_q`, of dK and dV to `acc` (tokens first), given
    the merged output and log-sum-exp (grad_out, q and out widened, in the kernel's dtype)."""
    for starts, b in row_groups:
        for (qa, qb), (ka, kb), causal in _blocks(queries, keys, starts):
            k = _widened(_heads(held[0][ka:kb, b], call.repeat), call.width)
            v = _widened(_heads(held[1][ka:kb, b], call.repeat), call.width)
            dq, dk, dv = call.kernel.backward(
                grad_out[b, :, qa:qb], q[b, :, qa:qb], k, v, out[b, :, qa:qb], lse[b, :, qa:qb], aux, causal,
                call.scale,
            )  # fmt: skip
            grad_q[b, :, qa:qb] += dq[..., : grad_q.shape[-1]]
            acc[0][ka:kb, b] += _unheads(dk[..., : acc[0].shape[-1]], call.repeat)
            acc[1][ka:kb, b] += _unheads(dv[..., : acc[1].shape[-1]], call.repeat)


class RingAttentionFn(torch.autograd.Function):
    """softmax(Q K^T * scale + causal) V over the whole sequence, for this rank's queries."""

    @staticmethod
    def forward(ctx, q, k, v, call: Call, ring: Ring, layout: SequenceLayout, docs=None):
        row_groups = _row_groups(docs, q.device)
        own = [k.permute(2, 0, 1, 3).contiguous(), v.permute(2, 0, 1, 3).contiguous()]  # tokens first: ring rows
        rows = layout.rows(tuple(torch.Size((layout.length, *t.shape[1:])) for t in own))
        queries = layout.intervals(ring.rank)
        merged = merge_dtype(q.dtype)
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=merged)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=merged)
        # the kernels get the layout the probe checked them in (contiguous [batch, heads, tokens, dim]), not the
        # model's (a q_proj output viewed as heads: tokens before heads in memory)
        wide = _widened(q.contiguous(), call.width)
        auxes: list[Aux] = []

        def compute(span, held):
            keys = [(row - span[0], pos, n) for row, pos, n in layout.global_intervals(span)]
            aux = _attend(call, wide, held, queries, keys, row_groups, out, lse)
            if aux is not None:
                auxes[:] = [aux]

        with torch.autocast(q.device.type, enabled=False):
            ring.forward_walk(own, rows, compute)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.call, ctx.ring, ctx.layout, ctx.docs, ctx.aux = call, ring, layout, docs, auxes[0] if auxes else None
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        call, ring, layout = ctx.call, ctx.ring, ctx.layout
        own = [k.permute(2, 0, 1, 3).contiguous(), v.permute(2, 0, 1, 3).contiguous()]
        rows = layout.rows(tuple(torch.Size((layout.length, *t.shape[1:])) for t in own))
        queries = layout.intervals(ring.rank)
        summed = merge_dtype(q.dtype)
        grad_out, out, wide = (_widened(t.contiguous(), call.width) for t in (grad_out, out, q))
        grad_q = torch.zeros(q.shape, dtype=summed, device=q.device)
        row_groups = _row_groups(ctx.docs, q.device)

        def accumulate(span, held, acc):
            keys = [(row - span[0], pos, n) for row, pos, n in layout.global_intervals(span)]
            _attend_backward(call, ctx.aux, grad_out, wide, out, lse, held, acc, grad_q, queries, keys, row_groups)

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
    `docs`: per batch row, the positions where its packed documents start (None: one document per row).
    Under autocast the inputs run in autocast's dtype, as SDPA's do (it is on autocast's lower-precision list)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k.shape[1]} key/value heads evenly")
    if v.shape[-1] > q.shape[-1]:
        raise ValueError(f"values of {v.shape[-1]} per head, wider than queries and keys ({q.shape[-1]})")
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = (t.to(dtype) if t.dtype != torch.float64 else t for t in (q, k, v))  # autocast leaves float64
    groups = q.shape[1] // k.shape[1]
    kernel = trusted(q.device, q.dtype, q.shape[-1], v.shape[-1], groups)
    repeat = 1 if takes_groups(kernel) else groups
    call = Call(kernel, q.shape[-1] ** -0.5 if scale is None else scale, repeat, kernel.width(q.shape[-1]))
    return RingAttentionFn.apply(q, k, v, call, ring, layout, docs)


PROBE_TOKENS, PROBE_RANKS = 203, 3
"""the probe's sequence: 6 chunks of 33 or 34 tokens (uneven, and query runs the efficient kernel pads to 64)"""
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
"""the largest gap to exact attention, relative to its largest value, that a dtype's rounding explains"""
_TRUSTED: set[tuple] = set()


def trusted(device: torch.device, dtype: torch.dtype, head: int, value_head: int, groups: int) -> Kernel:
    """The kernel ring attention uses for these heads now (SDPA's pick, attention_kernels.kernel_for), after its
    probe passed once in this process; SettingError naming the kernel and what to do when it does not."""
    kernel = kernel_for(device, dtype, head)
    key = (str(device), dtype, kernel.name, head, value_head, groups > 1)
    if key not in _TRUSTED:
        probe(kernel, device, dtype, head, value_head, groups > 1)
        _TRUSTED.add(key)  # a refusal is not kept: the probe runs again next time (milliseconds)
    return kernel


def probe(kernel: Kernel, device: torch.device, dtype: torch.dtype, head: int, value_head: int, grouped: bool):
    """`kernel` on a probe sequence of PROBE_TOKENS random tokens (a private generator: the user's RNG is untouched),
    blockwise as a ring of PROBE_RANKS computes it, against exact attention in float64 (the math SDPA's reference
    kernel does, written out so that no `sdpa_kernel` context or inference mode changes it): output, dQ, dK, dV.
    SettingError naming the kernel, dtype and gap when one differs beyond the dtype's rounding, or the kernel fails.
    `grouped`: 4 query heads share 2 K/V heads (GQA, repeated for a kernel that does not take it), else 4 each.
    The fault point "attention.probe" ("corrupt") shifts the merged output, as a wrong log-sum-exp layout would."""
    generator = torch.Generator(device=device).manual_seed(0)
    kv = 2 if grouped else 4
    shapes = [(2, 4, head), (2, kv, head), (2, kv, value_head), (2, 4, value_head)]
    drawn = [
        torch.randn(b, h, PROBE_TOKENS, d, generator=generator, device=device, dtype=torch.float64).to(dtype)
        for b, h, d in shapes
    ]
    call = Call(kernel, head**-0.5, 1 if takes_groups(kernel) else 4 // kv, kernel.width(head))
    where = f"the {kernel.name} kernel on {device} in {str(dtype).removeprefix('torch.')} (heads of {head}"
    where += f", values of {value_head})" if value_head != head else ")"
    corrupt = faults.point("attention.probe")
    try:
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            got = _blockwise(call, drawn, corrupt)
            want = _exact(call.scale, *(t.double() for t in drawn))
    except RuntimeError as err:
        raise SettingError(f"context parallelism: {where} failed on a probe: {err}. {_advice(kernel)}") from err
    gaps = {name: _gap(a, b) for name, a, b in zip(("output", "dQ", "dK", "dV"), got, want, strict=True)}
    worst = max(gaps, key=lambda name: gaps[name])
    if not gaps[worst] <= TOLERANCE[dtype]:  # NaN fails too
        raise SettingError(
            f"context parallelism: {where} does not compute attention: its blocks merged by their log-sum-exp "
            f"differ from attention computed whole by {gaps[worst]:.3g} of the largest value in {worst} (the "
            f"rounding of {str(dtype).removeprefix('torch.')} allows {TOLERANCE[dtype]:g}), on a probe of "
            f"{PROBE_TOKENS} random tokens. Training would be silently wrong, so it is refused. {_advice(kernel)}"
        )


def _advice(kernel: Kernel) -> str:
    switch = {"flash": "flash", "efficient": "mem_efficient", "cudnn": "cudnn"}.get(kernel.name)
    if switch is None:  # the CPU's only kernel
        return "Please report it to hf_rtp with your torch version"
    return (
        f"Use another kernel: torch.backends.cuda.enable_{switch}_sdp(False), or torch.nn.attention.sdpa_kernel "
        "naming the others around the block; and please report it to hf_rtp with your torch version and GPU"
    )


def _blockwise(call: Call, drawn: list[torch.Tensor], corrupt: bool = False):
    """Output, dQ, dK, dV of causal attention computed as the ring does: every rank's queries against every rank's
    keys held tokens first in ring order, each block merged by its log-sum-exp, then each block's backward.
    `drawn`: Q, K, V and the output's gradient. `corrupt`: the first rank's merged output shifted in one row by its
    largest value (a fault's)."""
    q, k, v, grad = drawn
    layout = SequenceLayout(q.shape[2], PROBE_RANKS)
    order = torch.cat([layout.positions(rank, q.device) for rank in range(PROBE_RANKS)])
    held = [t[:, :, order].permute(2, 0, 1, 3).contiguous() for t in (k, v)]
    keys = layout.global_intervals((0, layout.length))
    merged = merge_dtype(q.dtype)
    acc = [torch.zeros(t.shape, dtype=merged, device=q.device) for t in held]
    outs, grads = torch.zeros_like(grad), torch.zeros_like(q)
    row_groups = _row_groups(None, q.device)
    for rank in range(PROBE_RANKS):
        mine, queries = layout.positions(rank, q.device), layout.intervals(rank)
        wide = _widened(q[:, :, mine], call.width)
        out = q.new_zeros((*wide.shape[:-1], v.shape[-1]), dtype=merged)
        lse = q.new_full(wide.shape[:-1], float("-inf"), dtype=merged)
        aux = _attend(call, wide, held, queries, keys, row_groups, out, lse)
        if corrupt and rank == 0:
            out[..., 0, :] += out.abs().amax()
        result = out.to(q.dtype)
        grad_q = torch.zeros((*wide.shape[:-1], q.shape[-1]), dtype=merged, device=q.device)
        widened = [_widened(t, call.width) for t in (grad[:, :, mine].contiguous(), result)]
        _attend_backward(call, aux, widened[0], wide, widened[1], lse, held, acc, grad_q, queries, keys, row_groups)
        outs[:, :, mine], grads[:, :, mine] = result, grad_q.to(q.dtype)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=q.device)
    return (outs, grads, *(a.permute(1, 2, 0, 3)[:, :, back] for a in acc))


def _exact(scale: float, q, k, v, grad):
    """Output, dQ, dK, dV of causal attention, written out (in the inputs' dtype: float64 here)."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(groups, 1) for t in (k, v))
    position = torch.arange(q.shape[2], device=q.device)
    scores = (q @ kk.transpose(-1, -2) * scale).masked_fill(position[None, :] > position[:, None], float("-inf"))
    p = scores.softmax(-1)
    out = p @ vv
    ds = p * (grad @ vv.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
    fold = lambda t: t.unflatten(1, (-1, groups)).sum(2)  # noqa: E731  the gradient of repeat_interleave
    return out, ds @ kk * scale, fold(ds.transpose(-1, -2) @ q * scale), fold(p.transpose(-1, -2) @ grad)


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().amax() / want.abs().amax().clamp_min(1e-30)).item()
