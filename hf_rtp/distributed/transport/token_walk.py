"""Token walks: a rotated op that moves the tokens instead of the weights (a decode step, a short prefill).

Each rank applies its own chunk to every rank's tokens, and the outputs travel home in an accumulator, as the
weights' gradients do in backward (distributed/transport/ring.py). Which ops walk this way is decided per call by
distributed/transport/weights_or_tokens.py, from numbers every rank agreed, so every rank walks the same way.

The message: one per hop (gloo pays per message), carved from the ring's weight slots (a forward that moves
tokens moves no weights): each token tensor padded to the agreed `bound` rows, then [the largest count seen so
far, 1 if some rank did not read it], then after the first hop the travelling accumulator; each part at an offset
aligned to 8. An op on the same tokens as the op before (k_proj and v_proj after q_proj) sends its outputs only.
The hops themselves are the ring's (`Ring.exchange`); this file posts nothing itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ...errors import CollectiveMisuseError
from ...private.torch_names import ASSERT_MESSAGE_LIMIT, assert_async, version
from ..tensors.sharding import ChunkLayout
from .pending import Pending
from .pool import BufferPool, header_room

Bundle = Sequence[torch.Tensor]
Rows = tuple[int, int]
TOKEN_TAG = 192
OUTPUT_TAG = 224
TOKEN_GRAD_TAG = 96  # visit_walk's hops: tokens with their output gradients
# a token walk's count checked on the device where this rank did not read it (_largest); under CUDA's 255
_UNREAD_SHORT = (
    "hf_rtp: a rotated op{weights} saw more tokens on some rank than its forward's ranks agreed on; this rank did "
    'not read the count. Load with rotation_moves="weights", or give every rank inputs of one shape'
)


@functools.lru_cache(maxsize=256)
def _unread_message(global_shapes: tuple[torch.Size, ...]) -> str:
    """The device assertion's message for a walk of weights of these shapes, made once per layout: under CUDA's
    255 bytes, with the shapes where they fit."""
    weights = " and ".join(str(list(s)) for s in global_shapes)
    short = _UNREAD_SHORT.format(weights=f" (weights {weights})")
    return short if len(short.encode()) <= ASSERT_MESSAGE_LIMIT else _UNREAD_SHORT.format(weights="")


class Hops(Protocol):
    """What a token walk needs of its ring (distributed/transport/ring.py's Ring)."""

    rank: int
    size: int
    pool: BufferPool
    token_walks: int
    moved: tuple[Bundle, tuple | None, int, list[Bundle]] | None
    """the last tokens moved, their identities (None: not to be known again), the bound and the other ranks' that
    arrived with them"""

    def exchange(self, send: Bundle, recv: Bundle, tag: int) -> Pending: ...

    def own_piece(self, own: Bundle, layout: ChunkLayout, rows: Rows) -> list[torch.Tensor]: ...

    def walked(self) -> None: ...


def _message_bytes(specs) -> int:
    return sum(n + (-n) % 8 for n in (math.prod(shape) * dtype.itemsize for shape, dtype in specs))


def identities(tokens: Bundle) -> tuple | None:
    """What makes two token sets the same tokens: the same memory, seen the same way, unchanged since (each op
    reshapes its input afresh, so the tensor objects differ; an in-place change bumps its version). The ring holds
    the tokens it compares with, so their memory is not freed and reused by other tokens meanwhile. None for
    tensors made under torch.inference_mode, which have no version counter: such tokens are never known again, so
    each op on them moves them (layers/siblings.py walks them alone for the same reason)."""
    if any(t.is_inference() for t in tokens):
        return None
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, version(t)) for t in tokens)


def token_walk(
    ring: Hops,
    own: Bundle,
    layout: ChunkLayout,
    tokens: Bundle,
    fill: Sequence[float],
    out: torch.Tensor,
    compute: Callable[[Bundle, torch.Tensor, Rows, Bundle], None],
    bound: int,
    brought: int | None = None,
    blank: Callable[[torch.Tensor], None] | None = None,
    fold: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> int | None:
    """Move the tokens instead of the weights: `compute(tokens, out, rows, chunk)` adds this rank's chunk's
    share of the output of `tokens` into `out` (zeros where it has none: other rows, other experts).
    An output that is not a sum of the chunks' shares (the fused loss's log-sum-exp) says how its accumulator
    starts (`blank`, zeros by default) and how the one that came home joins `out` (`fold(out, acc)`, added).

    `tokens` are this rank's token tensors (dim 0: its t tokens); they travel padded to `bound` rows with
    `fill` (one value per tensor, chosen to contribute nothing), so every rank knows what it receives
    without asking. `out` [t, ...], zeros, gets this rank's own share first; the other ranks' shares
    gather in an accumulator that starts at the next rank and travels with the tokens, arriving home
    after N-1 hops, where it is added: the same shares as the weight walk, each computed by the rank
    that holds the chunk.

    Returns None when done, or, when some rank brought more tokens than `bound` (an op that sees more
    than its forward's new tokens: DeepSeek's MLA expands its cached latents), the most any rank brought,
    which every rank learns by the end of the walk (each token hop carries the largest count seen so
    far), so every rank then walks again, the same way; `out` is then not filled.

    Learning it is a read on the host, which on CUDA waits for the device, so a rank reads only where the
    answer can differ from `bound`: where it brings more itself, or more than `brought`, what its own forward
    brought to the op (its tokens; its sequences to a head) or, walking again, the largest count the walk
    before learned (None: read). An op that sees more than its forward brought (MLA's cached latents, a
    head on every token) does so on every rank, which all read then. Every other op reads nothing. The hops
    also carry whether some rank did not read: a rank that reads a larger count and finds one raises at
    once, since that rank will not walk again, and the rank that did not read fails its device assertion
    (`_largest`); an error on every rank, never a walk some ranks make alone.
    """
    held = ring.own_piece(own, layout, layout.bounds(ring.rank))
    rows = layout.bounds(ring.rank)
    count = tokens[0].shape[0]
    if ring.size == 1:
        compute(tokens, out, rows, held)
        return None
    ring.token_walks += 1
    moved, ids = ring.moved, identities(tokens)
    # the identities recorded when the tokens moved, not the held tensors' own now: those share the caller's
    # version counter, so an in-place change since would go unseen
    if moved is not None and ids is not None and moved[2] == bound and moved[1] == ids:
        _walk_outputs(ring, moved[3], out, compute, rows, held, tokens, count, bound, blank, fold)
        return None
    fits = min(count, bound)  # an overflowing rank sends what fits; its count says the walk is void
    reads = count > bound or brought is None or count > brought
    # One message per hop (gloo pays per message), in the pool's weight slots: gloo pays several times more to
    # send from or receive into memory it has not seen. The tokens padded to `bound`, the largest count and
    # whether some rank does not read it, then (after the first hop) the accumulator.
    ring.moved = None  # the arrivals below overwrite the tokens kept from the op before
    specs = [((bound, *t.shape[1:]), t.dtype) for t in tokens] + [((2,), torch.int64)]
    hop = [*specs, ((bound, *out.shape[1:]), out.dtype)]  # after the first hop: the accumulator too
    acc_bytes = bound * math.prod(out.shape[1:]) * out.element_size()
    # slot 0: what this rank sends, the accumulator and where the last one lands; slot 1: what arrives at
    # each hop, kept for the next op on the same tokens
    message, acc_region, landing_region = _carve(ring, 0, [_message_bytes(hop), acc_bytes, acc_bytes], out)
    arrivals = _carve(ring, 1, [_message_bytes(specs)] + [_message_bytes(hop)] * (ring.size - 2), out)
    first = _views(message, specs)
    for view, t, f in zip(first[:-1], tokens, fill, strict=True):
        view[:fits] = t[:fits]
        view[fits:] = f
    most = first[-1]  # [count, 1 if this rank does not read]: filled on the device, no copy from the host
    most[0].fill_(count)
    most[1].fill_(0 if reads else 1)
    sent = message[: _message_bytes(specs)]
    pending = ring.exchange([sent], [arrivals[0]], TOKEN_TAG)
    if count <= bound:
        compute(tokens, out, rows, held)  # this rank's share of its own tokens stays home
    pending.wait()
    *others, seen = _views(arrivals[0], specs)
    acc = acc_region.view(out.dtype).view(bound, *out.shape[1:])
    (blank or torch.Tensor.zero_)(acc)
    seen_tokens: list[Bundle] = []
    for step in range(1, ring.size):
        seen_tokens.append(others)
        most = torch.maximum(seen, most)
        compute(others, acc, rows, held)
        if step == ring.size - 1:
            landing = landing_region.view(out.dtype).view(acc.shape)
            ring.exchange([acc], [landing], TOKEN_TAG).wait()
        else:
            for view, t in zip(_views(message, hop), [*others, most, acc], strict=True):
                view.copy_(t)
            ring.exchange([message], [arrivals[step]], TOKEN_TAG).wait()
            *others, seen, landing = _views(arrivals[step], hop)
        acc = landing
    ring.walked()
    largest = _largest(ring, most, reads, layout, bound, count)  # every rank's, after N-1 token hops
    if largest > bound:
        return largest
    (fold or torch.Tensor.add_)(out, acc[:count])
    ring.moved = (tuple(tokens), ids, bound, seen_tokens)  # held: their memory cannot become other tokens
    return None


def _largest(ring: Hops, most: torch.Tensor, reads: bool, layout: ChunkLayout, bound: int, count: int) -> int:
    """The most tokens any rank brought to a token walk (`most`: [that count, 1 if some rank does not read it]),
    read on the host where this rank `reads`; else `bound`, which a device assertion checks without a read."""
    if not reads:
        assert_async(most[0] <= bound, _unread_message(layout.global_shapes))
        return bound
    largest, some_unread = divmod(int(most[0] * 2 + most[1]), 2)  # one read for both
    if largest > bound and some_unread:
        weights = " and ".join(str(list(s)) for s in layout.global_shapes)
        raise CollectiveMisuseError(
            f"a rotated op (weights {weights}) that moves tokens saw more tokens on some rank than the {bound} "
            f"its forward's ranks agreed on (rank {ring.rank}: {count}), and on another no more than that rank's "
            "own forward brought, so that rank did not read the count and cannot walk the op again with the "
            'others. Load with rotation_moves="weights", or give every rank inputs of one shape'
        )
    return largest


def _walk_outputs(
    ring: Hops, seen: list[Bundle], out, compute, rows: Rows, held: Bundle, tokens, count, bound, blank, fold
) -> None:
    """token_walk for tokens every rank already holds from the op before (`seen`: the others', in the order
    they arrived): only the accumulators travel, on tags of their own, so ranks that disagree on whether the
    tokens are held wait and fail by the timeout instead of reading one message as another."""
    compute(tokens, out, rows, held)
    shape = (bound, *out.shape[1:])
    regions = _carve(ring, 0, [math.prod(shape) * out.element_size()] * 2, out)  # slot 1 holds `seen`
    buffers = [r.view(out.dtype).view(shape) for r in regions]
    acc = buffers[0]
    (blank or torch.Tensor.zero_)(acc)
    for step, others in enumerate(seen, 1):
        compute(others, acc, rows, held)
        landing = buffers[step % 2]
        ring.exchange([acc], [landing], OUTPUT_TAG).wait()
        acc = landing
    ring.walked()
    (fold or torch.Tensor.add_)(out, acc[:count])


def visit_walk(ring: Hops, tokens: Bundle, fill: Sequence[float], bound: int, visit: Callable[[Bundle], None]) -> None:
    """Every rank's tokens visit every rank, and nothing goes home: `visit(tokens)` runs on this rank's own tokens,
    then on each other rank's as they arrive, N-1 hops (a backward whose products all stay where they are made: an
    embedding's weight gradient, which a chunk's rank adds up from every rank's ids and output gradients, where the
    weights' walk would move a travelling accumulator of the whole chunk). The tokens travel padded to `bound` rows
    with `fill`, as in token_walk; every rank's count is at most `bound` (its forward walked with that bound), so
    nothing is read on the host. Each hop sends on what arrived at the hop before while this rank visits it."""
    if ring.size == 1:
        visit(tokens)
        return
    ring.moved = None  # the weights' slots, where the last tokens that moved are kept, are overwritten
    specs = [((bound, *t.shape[1:]), t.dtype) for t in tokens]
    size = _message_bytes(specs)
    like = next((t for t in tokens if t.is_floating_point()), tokens[0])  # what the slots are sized by
    slots = [_carve(ring, slot, [size], like)[0] for slot in (0, 1)]
    count = tokens[0].shape[0]
    for view, t, f in zip(_views(slots[0], specs), tokens, fill, strict=True):
        view[:count] = t
        view[count:] = f
    for step in range(1, ring.size):
        sending, landing = slots[(step - 1) % 2], slots[step % 2]
        pending = ring.exchange([sending], [landing], TOKEN_GRAD_TAG)
        visit(tokens if step == 1 else _views(sending, specs))  # this rank's own first, then what came last hop
        pending.wait()
    ring.walked()
    visit(_views(slots[(ring.size - 1) % 2], specs))


def _carve(ring: Hops, slot: int, sizes: Sequence[int], like: torch.Tensor) -> list[torch.Tensor]:
    """uint8 regions of `sizes` bytes (each at an offset aligned to 8) from the weights' slot `slot`: a forward
    that moves tokens moves no weights, so their buffers hold the tokens (Traffic keeps them small enough).
    Taken as `like`'s dtype (the matmuls'), which sizes a slot as the weights' walks size it. Each region is
    followed by its header's room (pool.header_room), so a watched ring sends it with its header as one message;
    the first hop's message, a prefix of `message`, puts its header in the accumulator's part, unused until
    later hops copy the accumulator there."""
    padded = [header_room(n) for n in sizes]
    (flat,) = ring.pool.take("weights", slot, [torch.Size((-(-sum(padded) // like.element_size()),))], like)
    raw, regions, offset = flat.view(torch.uint8), [], 0
    for n, room in zip(sizes, padded, strict=True):
        regions.append(raw[offset : offset + n])
        offset += room
    return regions


def _views(message: torch.Tensor, specs) -> list[torch.Tensor]:
    """Views of `specs` (shape, dtype) one after another in a message's bytes, each at an offset aligned to 8."""
    views, offset = [], 0
    for shape, dtype in specs:
        n = math.prod(shape) * dtype.itemsize
        views.append(message[offset : offset + n].view(dtype).view(shape))
        offset += n + (-n) % 8
    return views
