"""Cross-entropy through the rotated LM head without the [tokens, vocab] logits.

The head's vocabulary pieces already travel the ring past every rank's own hidden states. Forward
folds each piece into a running log-sum-exp and picks the target logit where the piece holds it;
backward walks the ring again, recomputes each piece's logits, and turns them into the hidden-state
gradient and into the travelling gradient of that piece of the head. Each piece is cut into tiles of
tokens x rows, so at most one tile of logits (16 MiB on a CPU) exists at once. No collective: each
rank's loss is its own batch's, and the head's gradient arrives home summed over ranks, as for any
rotated weight.

Where a step's tokens are few (distributed/transport/weights_or_tokens.py, as for any rotated op), the tokens travel
instead of the head: forward each rank folds its own chunk's logits of every rank's hidden states into their
statistics, which travel home; backward the hidden states travel again with their log-sum-exps and loss
gradients, each rank's chunk gradient is complete where it is made, and the hidden states' gradient goes
home. No piece of the head moves in such a step (TRL's statistics still walk the weights).

The math is transformers' ForCausalLMLoss: logits in the head's compute dtype, the family's own
transform (`HeadTransform`) in that dtype too, then float32 for the softmax. For TRL's fused head it is
TRL's kernel instead: the family's transform on the float32 logits, then TRL's temperature; and, as
that kernel offers, per-token statistics of the whole distribution folded piece by piece (`EXTRAS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..distributed.tensors.sharding import ChunkLayout
from ..distributed.transport.pool import HEADER_BYTES
from ..distributed.transport.ring import Ring
from .common import add_matmul, add_matmul_summed, finish_weight_grads, rotate_forward, sum_dtype

BLOCK_BYTES = 16 * 2**20
"""float32 logits one tile may hold on a CPU: a few cache-sized tiles"""
ACCELERATOR_BLOCK_BYTES = 256 * 2**20
"""... and on an accelerator, where a tile must be large enough that its matmul, not the launches of its
dozen elementwise kernels, sets the time (measured on an H200: hf_rtp/tools/bench/cuda_loss.py)"""


ROW_ALIGN = 64


def block_bytes(device: torch.device) -> int:
    return BLOCK_BYTES if device.type == "cpu" else ACCELERATOR_BLOCK_BYTES


@dataclass(frozen=True)
class HeadTransform:
    """What a family does to the head's output before the loss: `logits * multiply`, `logits / divide`,
    then `cap * tanh(logits / cap)` (Cohere, Granite, Gemma 2/3), each in the logits' dtype as vanilla does,
    or on the float32 logits with `in_float32` (TRL's kernel); then TRL's `* (1 / temperature)`, in float32."""

    multiply: float | None = None
    divide: float | None = None
    softcap: float | None = None
    temperature: float = 1.0
    in_float32: bool = False

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self._family(z.float()) if self.in_float32 else self._family(z).float()
        return z if self.temperature == 1.0 else z * (1 / self.temperature)

    def _family(self, z: torch.Tensor) -> torch.Tensor:
        if self.multiply is not None:
            z = z * self.multiply
        if self.divide is not None:
            z = z / self.divide
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def backward(self, grad: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """d loss / d raw logits, from d loss / d transformed logits `grad` and the transformed `z` (in place)."""
        if self.temperature != 1.0:
            grad.mul_(1 / self.temperature)
            z = z * self.temperature  # the capped logits, whose cap's derivative comes next
        if self.softcap is not None:
            grad.mul_(1 - (z / self.softcap).square_())
        if self.divide is not None:
            grad.div_(self.divide)
        if self.multiply is not None:
            grad.mul_(self.multiply)
        return grad


def _logits(h: torch.Tensor, piece, transform: HeadTransform) -> torch.Tensor:
    return transform.forward(F.linear(h, *(t.to(h.dtype) for t in piece)))


def _tiles(tokens: int, rows: int, elements: int) -> list[tuple[int, int, int, int]]:
    """(row start, row end, token start, token end) tiles of at most `elements` logits, as square as the
    shape allows: a tile that is one token block wide re-reads the whole piece of the head per block
    (at 128k rows on a ring of one that is 32 tokens per read of 0.5 GB). Widths are multiples of
    ROW_ALIGN: the logits' row stride is the width, and cuBLAS falls back to kernels several times
    slower when it is not a multiple of 8 (seen on an H200: 21845 rows ran at 1/3 of 16384's speed)."""
    if rows == 0:
        return []
    wide = min(rows, max(math.isqrt(elements), elements // max(1, tokens), 1))
    if wide < rows:
        wide = max(ROW_ALIGN, wide // ROW_ALIGN * ROW_ALIGN)
    tall = max(1, min(tokens, elements // wide))
    return [
        (r, min(r + wide, rows), b, min(b + tall, tokens)) for r in range(0, rows, wide) for b in range(0, tokens, tall)
    ]


def _piece_blocks(h: torch.Tensor, targets: torch.Tensor, rows, piece, transform: HeadTransform):
    """For each tile of tokens x rows of this piece: its bounds (rows relative to the piece), its logits,
    which of its tokens' targets lie in its rows, and their column there (clamped where they do not)."""
    start, end = rows
    elements = block_bytes(h.device) // 4
    for r0, r1, b0, b1 in _tiles(h.shape[0], end - start, elements):
        t = targets[b0:b1]
        inside = (t >= start + r0) & (t < start + r1)
        column = (t - (start + r0)).clamp_(0, r1 - r0 - 1).unsqueeze(1)
        z = _logits(h[b0:b1], [p[r0:r1] for p in piece], transform)
        yield r0, r1, b0, b1, z, inside, column


EXTRAS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""TRL's optional per-token outputs, in the order its kernel returns them"""
_UNDER_MAX = frozenset(("entropy", "log_sum_sq_probs", "is_top1"))


class _Running:
    """Per-token sums over the vocabulary, folded as its pieces arrive (in ring order, not vocabulary order):
    of z (`mean_logits`), and of exp(z - best), exp(z - best) * z and exp(2 (z - best)) under the running max
    `best`, rescaled as it grows (TRL's kernel does the same): exact rescale factors, unlike a running lse's."""

    def __init__(self, tokens: int, device, extras: frozenset[str]):
        self.extras = extras
        zeros = [torch.zeros(tokens, dtype=torch.float32, device=device) for _ in range(4)]
        self.sum_z, self.sum_e, self.sum_ez, self.sum_ee = zeros
        self.best = torch.full((tokens,), -math.inf, dtype=torch.float32, device=device)
        self.best_at = torch.zeros(tokens, dtype=torch.long, device=device)

    def fold(self, b0: int, b1: int, z: torch.Tensor, first_row: int) -> None:
        """Fold tokens [b0, b1)'s logits `z` of the vocabulary rows from `first_row` on."""
        if "mean_logits" in self.extras:
            self.sum_z[b0:b1] += z.sum(1)
        if not self.extras & _UNDER_MAX:
            return
        value, at = z.max(dim=1)  # the first maximal column, as argmax
        at += first_row
        old = self.best[b0:b1]
        take = (value > old) | ((value == old) & (at < self.best_at[b0:b1]))  # a tie goes to the lower index
        new = torch.maximum(old, value)
        e = (z - new[:, None]).exp_()
        rescale = torch.exp(old - new)
        self.sum_e[b0:b1] = self.sum_e[b0:b1] * rescale + e.sum(1)
        if "log_sum_sq_probs" in self.extras:
            self.sum_ee[b0:b1] = self.sum_ee[b0:b1] * rescale.square() + e.square().sum(1)
        if "entropy" in self.extras:
            self.sum_ez[b0:b1] = self.sum_ez[b0:b1] * rescale + e.mul_(z).sum(1)
        self.best_at[b0:b1] = torch.where(take, at, self.best_at[b0:b1])
        self.best[b0:b1] = new

    def results(self, targets: torch.Tensor, vocab: int) -> list[torch.Tensor | None]:
        """EXTRAS as TRL's kernel computes them, None where not asked for."""
        log_sum_e = self.sum_e.log()
        found = {
            "entropy": lambda: self.best + log_sum_e - self.sum_ez / self.sum_e,
            "log_sum_sq_probs": lambda: self.sum_ee.log() - 2 * log_sum_e,
            "mean_logits": lambda: self.sum_z / vocab,
            "is_top1": lambda: self.best_at == targets,
        }
        return [found[name]() if name in self.extras else None for name in EXTRAS]


class _FusedCrossEntropyFn(torch.autograd.Function):
    """Per-token -log p(target), then TRL's EXTRAS, each None unless in `extras`: the entropy (with its
    gradient, as TRL's kernel has one), log sum p^2 and the mean logit (without, as in TRL's), and whether
    the target is the first argmax (TRL's `is_top1`)."""

    @staticmethod
    def forward(
        ctx, h, weight, bias, targets, ring: Ring, layout: ChunkLayout, transform: HeadTransform, extras: frozenset
    ):
        ctx.set_materialize_grads(False)  # an entropy logged but not trained on costs no backward term
        tokens, device = h.shape[0], h.device
        stats = torch.empty(tokens, 2, dtype=torch.float32, device=device)  # [log-sum-exp, target logit] per token
        _blank(stats)
        running = _Running(tokens, device, extras) if extras else None

        def compute(given, out, rows, piece):
            hh, tt = given
            lse, picked = out[:, 0], out[:, 1]
            for r0, _, b0, b1, z, inside, column in _piece_blocks(hh, tt, rows, piece, transform):
                lse[b0:b1] = torch.logaddexp(lse[b0:b1], torch.logsumexp(z, dim=1))
                picked[b0:b1] = torch.where(inside, z.gather(1, column).squeeze(1), picked[b0:b1])
                if running is not None:
                    running.fold(b0, b1, z, rows[0] + r0)

        bundle = [weight] if bias is None else [weight, bias]
        with torch.autocast(device.type, enabled=False):
            # few tokens: they travel instead of the head (rotate_forward decides, every rank alike), where backward's
            # larger message fits a slot too
            traffic = ring.traffic
            if running is None and traffic is not None and _tokens_fit(ring, h, weight, traffic.bound):
                moved = rotate_forward(
                    ring, bundle, layout, [h, targets], [0.0, -1], stats, compute, h.dtype, blank=_blank, fold=_fold
                )
            else:  # and TRL's statistics fold in vocabulary order within a piece: the weights walk for them
                moved = None
                ring.forward_walk(
                    bundle, layout, lambda rows, piece: compute([h, targets], stats, rows, piece), dtype=h.dtype
                )
        lse, picked = stats[:, 0].contiguous(), stats[:, 1]
        entropy, log_sum_sq, mean, top1 = [None] * 4 if running is None else running.results(targets, layout.rows)
        ctx.save_for_backward(h, weight, bias, targets, lse, entropy)
        ctx.ring, ctx.layout, ctx.transform, ctx.moved = ring, layout, transform, moved
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean, top1) if x is not None))
        return lse - picked, entropy, log_sum_sq, mean, top1

    @staticmethod
    def backward(ctx, grad_loss, grad_entropy, *_):
        h, weight, bias, targets, lse, entropy = ctx.saved_tensors
        ring, layout, transform = ctx.ring, ctx.layout, ctx.transform
        # every rank walks the ring whatever its gradients are: its neighbours walk too
        grad_loss = torch.zeros_like(lse) if grad_loss is None else grad_loss.float()
        grad_entropy = None if grad_entropy is None else grad_entropy.float()
        # the hidden states' gradient sums every tile's and piece's partial over the vocabulary: in float32 for bf16
        # or fp16 states, each partial unrounded, rounded to h's dtype once at the end as vanilla's one matmul rounds
        grad_h = torch.zeros_like(h, dtype=sum_dtype(h.dtype)) if ctx.needs_input_grad[0] else None
        wants_weight_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]

        if ctx.moved is not None and _tokens_fit(ring, h, weight, ctx.moved):  # never with TRL's statistics: no entropy
            return _moved_backward(ctx, h, weight, bias, targets, lse, grad_loss, grad_h, wants_weight_grad)

        def through_piece(rows, piece, acc):
            """Recompute this piece's logits tile by tile; add to grad_h and to the travelling `acc`."""
            for r0, r1, b0, b1, z, inside, column in _piece_blocks(h, targets, rows, piece, transform):
                g = grad_loss[b0:b1]
                log_p = z - lse[b0:b1, None]
                if grad_entropy is None:
                    dz = log_p.exp_().mul_(g[:, None])  # softmax * upstream grad
                else:  # d entropy / dz = -p * (log p + entropy), as TRL's kernel computes it
                    dz = log_p.exp().mul_(g[:, None] - grad_entropy[b0:b1, None] * log_p.add_(entropy[b0:b1, None]))
                dz.scatter_add_(1, column, -(g * inside).unsqueeze(1))  # minus the one-hot target
                dl = transform.backward(dz, z).to(h.dtype)
                if acc is not None:
                    add_matmul(acc[0][r0:r1], dl.t(), h[b0:b1])
                    if bias is not None:
                        acc[1][r0:r1].add_(dl.sum(0).to(acc[1].dtype))
                if grad_h is not None:
                    add_matmul_summed(grad_h[b0:b1], dl, piece[0][r0:r1].to(h.dtype))

        bundle = [weight] if bias is None else [weight, bias]
        # The whole tile's work happens where the weights are held: in `accumulate` when the head
        # trains (the gradient must be complete before it is sent on), else in `input_grad`.
        with torch.autocast(h.device.type, enabled=False):
            landed = ring.backward_walk(
                bundle,
                layout,
                through_piece if wants_weight_grad else None,
                (lambda rows, piece: None)
                if wants_weight_grad
                else (lambda rows, piece: through_piece(rows, piece, None)),
                dtype=h.dtype,
            )
        grad_weight, grad_bias = finish_weight_grads(ctx, landed, ring, (weight, bias))
        return _rounded(grad_h, h.dtype), grad_weight, grad_bias, None, None, None, None, None


def _rounded(grad_h: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The hidden states' gradient, summed in sum_dtype, in their own dtype: rounded once."""
    return grad_h if grad_h is None or grad_h.dtype == dtype else grad_h.to(dtype)


def _blank(stats: torch.Tensor) -> None:
    """Where a token's statistics start: no logit folded into its log-sum-exp, no target logit found."""
    stats[:, 0].fill_(-math.inf)
    stats[:, 1].zero_()


def _fold(stats: torch.Tensor, arrived: torch.Tensor) -> None:
    """The other ranks' statistics of this rank's tokens, come home (token_walk), joined to its own."""
    torch.logaddexp(stats[:, 0], arrived[:, 0], out=stats[:, 0])
    stats[:, 1].add_(arrived[:, 1])  # one chunk holds each target: the others' found nothing


def _tokens_fit(ring: Ring, h: torch.Tensor, weight: torch.Tensor, bound: int) -> bool:
    """Whether backward's token walk (the hidden states with their targets, log-sum-exps and loss gradients, and
    the hidden states' travelling gradient) fits a weights' slot as token_bound reckons one: from numbers every rank
    shares (`bound`, the hidden size and dtype, the pool's plan), so every rank walks the same way. The forward asks
    first, so its token walk, with smaller messages, fits too; backward asks again, for a forward whose walk learned
    of more tokens than its ranks agreed on and walked again with that larger bound."""
    # a token's hidden state, and its gradient in sum_dtype (float32 for bf16 states), target, log-sum-exp, loss grad
    row = h.shape[1] * (h.element_size() + sum_dtype(h.dtype).itemsize) + 8 + 4 + 4
    # a slot holds the largest piece in what the weights travel in (the narrower of theirs and the hidden states'),
    # not in the hidden states' dtype: TRL's float32 head over bf16 weights has half the bytes it would reckon
    slot = ring.pool.planned(h.device) * ring.travel_dtype([weight], h.dtype).itemsize
    regions = max(ring.size - 1, 3)  # each followed by a watched hop's header (pool.header_room), as token_bound counts
    return bound * (row + 8) * regions + 64 + (HEADER_BYTES + 8) * regions <= slot


def _moved_backward(ctx, h, weight, bias, targets, lse, grad_loss, grad_h, wants_weight_grad):
    """Backward where the forward moved the tokens: they travel again, with their log-sum-exps and loss gradients,
    and each rank recomputes its chunk's logits of every rank's tokens. The chunk's weight gradient is complete
    where it is made, and the hidden states' gradient travels home (token_walk): no piece of the head moves."""
    ring, layout, transform = ctx.ring, ctx.layout, ctx.transform
    summed = ring.reduce_dtype or weight.dtype
    homes = [t.new_zeros(t.shape, dtype=summed) for t in (weight, bias) if t is not None] if wants_weight_grad else []

    def compute(given, out, rows, piece):
        hh, tt, ll, gg = given
        for r0, r1, b0, b1, z, inside, column in _piece_blocks(hh, tt, rows, piece, transform):
            g = gg[b0:b1]
            dz = (z - ll[b0:b1, None]).exp_().mul_(g[:, None])  # softmax * upstream grad
            dz.scatter_add_(1, column, -(g * inside).unsqueeze(1))  # minus the one-hot target
            dl = transform.backward(dz, z).to(hh.dtype)
            if homes:
                add_matmul(homes[0][r0:r1], dl.t(), hh[b0:b1])
                if bias is not None:
                    homes[1][r0:r1].add_(dl.sum(0).to(summed))
            if grad_h is not None:  # else the zeros still travel home: every rank walks alike
                add_matmul_summed(out[b0:b1], dl, piece[0][r0:r1].to(hh.dtype))

    # the travelling gradient in sum_dtype (float32 for bf16 states: _tokens_fit counts it so), rounded once at home
    out = grad_h if grad_h is not None else torch.zeros_like(h, dtype=sum_dtype(h.dtype))
    bundle = [weight] if bias is None else [weight, bias]
    with torch.autocast(h.device.type, enabled=False):
        # every rank's count is at most the forward's bound, which it brought: no count is read on the host
        # padding rows: a log-sum-exp of +inf makes their probabilities exactly 0, whatever their logits (a large
        # bias): exp(z - 0) * 0 would be NaN where exp overflows, and NaN times their zero hidden state too
        walked = ring.token_walk(
            bundle, layout, [h, targets, lse, grad_loss], [0.0, -1, math.inf, 0.0], out, compute, ctx.moved, ctx.moved
        )
    assert walked is None  # the forward's walk already saw every rank's count within the bound
    ring.moved = None  # no later op walks these tokens: the ring need not keep them
    landed = [t if t.dtype == weight.dtype else t.to(weight.dtype) for t in homes] if homes else None
    grad_weight, grad_bias = finish_weight_grads(ctx, landed, ring, (weight, bias))
    return _rounded(grad_h, h.dtype), grad_weight, grad_bias, None, None, None, None, None


def fused_cross_entropy(
    h, weight, bias, targets, ring: Ring, layout: ChunkLayout, transform: HeadTransform
) -> torch.Tensor:
    """Per-token -log p(target) (float32) of hidden states `h` [tokens, hidden] through a rotated head."""
    return _FusedCrossEntropyFn.apply(h, weight, bias, targets, ring, layout, transform, frozenset())[0]


def fused_token_stats(
    h, weight, bias, targets, ring: Ring, layout: ChunkLayout, transform: HeadTransform, *, extras=EXTRAS
) -> dict[str, torch.Tensor]:
    """-log p(target) per token ("nll") and the `extras` (names in EXTRAS), all float32 but is_top1 (bool)."""
    nll, *found = _FusedCrossEntropyFn.apply(h, weight, bias, targets, ring, layout, transform, frozenset(extras))
    return {"nll": nll, **{name: x for name, x in zip(EXTRAS, found, strict=True) if x is not None}}
