"""The ring: the hop, and the walks of weights and gradients. Only this file posts point-to-point messages.

Rank r sends to r+1 and receives from r-1 on a process group of its own (DESIGN.md I5). A rotated op
walks the ring through `forward_walk` / `backward_walk` and supplies the math as callbacks, so the
overlap (transfer of the next chunk while computing on the held one), the double buffering and the
travelling gradient accumulator live here once, not in every layer. `exchange` is one hop, posted the way
the group's backend wants (distributed/transport/backends.py) and watched where waits do not raise
(distributed/transport/watch.py).

Beside it, each alone: distributed/transport/pool.py (the slots foreign pieces land in, shared by every layer:
DESIGN.md I3), distributed/transport/token_walk.py (ops that move the tokens instead of the weights: their message
and mechanism, on this file's hops) and distributed/transport/weights_or_tokens.py (which of the two an op does).

A chunk larger than `piece_bytes` (16 MB by default) walks the ring as several pieces, one full
walk per piece (rows cut again by the torch.chunk rule). The pool is then sized by the largest
piece rather than the largest chunk. That matters because the largest chunks are the embedding
and the LM head: at 2 ranks their slots alone would cost a 90M Llama about 15% of its per-rank
memory, for transfers that are no faster whole than in 16 MB pieces.

Weights travel in the dtype their matmuls run in (`dtype`: autocast's bf16 over float32 weights),
each rank casting its own piece once per walk, so the wire and the weight slots carry half the
bytes; the cast commutes with the transfer, so every matmul sees the values it saw before. Pieces
are still cut by the parameter's dtype, so the rows per piece do not change with autocast.
Gradient accumulators travel in `reduce_dtype` (the parameter's dtype unless from_pretrained's
reduce_dtype says otherwise) and come home cast to the parameter's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ... import faults
from ...settings import DEFAULT_PIECE_SIZE, parse_size
from ..tensors.replicas import ReplicaSum
from ..tensors.sharding import ChunkLayout
from .backends import Transport, transport_for
from .pending import WAITED, Pending
from .pool import BufferPool
from .token_walk import OUTPUT_TAG, TOKEN_GRAD_TAG, TOKEN_TAG, Bundle, Rows
from .token_walk import token_walk as _token_walk
from .token_walk import visit_walk as _visit_walk
from .watch import Watch
from .weights_or_tokens import Traffic

_CPU = torch.device("cpu")
_WEIGHT_TAG = 0
_GRAD_TAG = 64
_COLLECT_TAG = 128
_FOLD_EVERY = 64  # hops between two header checks at most, where a walk is longer
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # odd: digest * _MIX + header mixes every header in, in order (as int64)
_SIGN, _WRAP = 1 << 63, 1 << 64
_KINDS = {
    _WEIGHT_TAG: "weights",
    _GRAD_TAG: "gradients",
    TOKEN_GRAD_TAG: "tokens' gradients",
    TOKEN_TAG: "tokens",
    OUTPUT_TAG: "outputs",
}
# After the watch names a failure on NCCL, how long the script has to reach the ring again (and raise it) before the
# watch ends the process; the ring's NCCL group waits this much longer than HF_RTP_TIMEOUT, so NCCL's watchdog,
# which would abort with a message about a SEND or RECV, never comes first (topology.py).
WATCH_GRACE_S = 30.0
DEFAULT_PIECE_BYTES = parse_size(DEFAULT_PIECE_SIZE)  # from_pretrained's rotation_piece_size default


def _land(landings: list, then: Callable[[], None] | None) -> None:
    """A staged hop's arrivals copied from host memory to where the ring wanted them, then `then`."""
    for t, wire in landings:
        t.copy_(wire)
    if then is not None:
        then()


class Ring:
    """Neighbour exchange on `group` (None: a ring of one, which never communicates)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
        replicas: dist.ProcessGroup | None = None,
        replica_count: int = 1,
        reduce_dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        timeout_s: float | None = None,
        transport: Transport | None = None,
        watched: bool | None = None,
    ):
        """`device`: where the ring's tensors live; with the group's backends it decides the `transport`
        (distributed/transport/backends.py; given: forced, as tests do). `watched` (default: on NCCL, "batched") puts
        a header on every hop and a watch on the hops in flight (distributed/transport/watch.py), so a rank that dies or
        walks differently fails within `timeout_s` by name where waits do not raise and tags are ignored; a
        watched ring sends no tags, as NCCL would ignore them, so a test over gloo shows the headers alone."""
        self.group = group
        self.device = device or _CPU
        self.piece_bytes = piece_bytes
        """chunks larger than this walk the ring in pieces (from_pretrained's rotation_piece_size)"""
        self.replica_sum = ReplicaSum(replicas, replica_count) if replicas is not None else None
        """on a 2-D grid (`replicas`: this ring's rank in every other replica, the same chunk with other
        data), what sums rotated gradients over them after autograd accumulates them (distributed.tensors.replicas)"""
        self.reduce_dtype = reduce_dtype
        """the dtype gradient accumulators travel and are summed in (None: the parameter's)"""
        if group is None:
            self.rank, self.size = 0, 1
            self._next = self._prev = 0
            self.transport: Transport = "plain"
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
            self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
            self.transport = transport or transport_for(dist.get_backend_config(group), (device or _CPU).type)
        # what a failed wait on a hop names (made once: a hop builds no string)
        if self._prev == self._next:
            self._waited = f"waited for its ring neighbour (global rank {self._prev})"
        else:
            self._waited = f"waited for its ring neighbours (global ranks {self._prev} and {self._next})"
        self._watch: Watch | None = None
        if group is not None and (self.transport == "batched" if watched is None else watched):
            nccl = self.transport == "batched"  # a test's watched gloo ring is neither aborted nor ended
            self._watch = Watch(
                timeout_s if timeout_s is not None else 600.0,
                abort=getattr(group, "abort", None) if nccl else None,
                grace_s=WATCH_GRACE_S if nccl else None,
                device=self.device,
            )
        self._plain = self._watch is None and self.transport == "plain"  # posted by `exchange` itself, directly
        self._next_in_group, self._prev_in_group = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self._likes: dict[tuple, torch.Tensor] = {}
        # A watched ring's header check: each header is the sender's digest of every hop it made so far (digest * M +
        # kind and count, int64, in order), computed on the host; the receiver's own digest after the same hop is what
        # must arrive (every rank makes the same hops in the same order). A header holds the sender's whole history, so
        # the last one to arrive tells for every hop before it: `walked` compares that one alone, once a walk, into
        # `_mismatch`, which the watch reads without waiting. No kernel a hop beside the header's fill, one a walk; a
        # hop out of place or of another kind changes every digest after it (M is odd: a difference never cancels).
        self._expected = 0
        self._arrived: tuple[int, torch.Tensor, int] | None = None  # the newest hop waited: (count, header, expected)
        self._unchecked = 0  # hops since the last `walked`
        self._in_flight = 0  # headers sent whose hop was not waited for yet
        self._checked_kinds: set[int] = set()
        self._mismatch: torch.Tensor | None = None
        self._whats = {k: f"a hop of {kind} from global rank {self._prev}" for k, kind in _KINDS.items()}
        self.pool = BufferPool()
        self.moves = "auto"
        """from_pretrained's rotation_moves: what a forward's ops move ("auto": what costs less)"""
        self._traffic: Traffic | None = None
        # the last tokens moved, and the other ranks' that arrived with them: an op on the same tokens (k_proj and
        # v_proj after q_proj, up_proj after gate_proj) moves only its outputs (distributed/transport/token_walk.py)
        self.moved: tuple[Bundle, tuple | None, int, list[Bundle]] | None = None
        self.token_walks = 0  # how many ops moved tokens instead of weights: tests and the bench read it
        # Bytes this rank sent to its neighbour (and replica_sum.reduced_bytes: all-reduced over its replicas),
        # what hf_rtp/tools/cost.py models
        self.sent_bytes = 0
        self.exchanges = 0  # hops this rank posted (each a send to the next rank and a receive from the previous)
        self.messages = 0  # messages this rank posted, sends and receives: two a hop where the hop is one message

    @property
    def traffic(self) -> Traffic | None:
        """Set at each forward's start by model/traffic.py (None outside a forward: ops move weights)."""
        return self._traffic

    @traffic.setter
    def traffic(self, value: Traffic | None) -> None:
        self._traffic, self.moved = value, None

    def __deepcopy__(self, memo):
        # process groups and buffers, not data: a copied rotated layer (PEFT's modules_to_save) walks this ring
        return self

    def _global_rank(self, ring_rank: int) -> int:
        assert self.group is not None  # only rings of two or more address a peer
        return dist.get_global_rank(self.group, ring_rank)

    def exchange(self, send: Bundle, recv: Bundle, tag: int) -> Pending:
        """Start sending `send` to the next rank and receiving `recv` from the previous one."""
        faults.point("ring.hop")  # one environment lookup when HF_RTP_FAULT is unset
        # Both ends derive chunk sizes from the same layout, so an empty chunk is skipped on both.
        if self._plain:  # gloo on the CPU, unwatched: the messages and nothing else (the hop's host time, bench)
            # The group's own send and recv, which dist.isend and dist.irecv call after checks that hold for the
            # ring's whole life (its group, the peers' ranks in it, plain real tensors): made once, in __init__.
            self.exchanges += 1
            group, works = self.group, []
            assert group is not None  # a ring of one never exchanges
            for i, t in enumerate(send):
                nbytes = t.nbytes
                if nbytes:
                    self.sent_bytes += nbytes
                    works.append(group.send([t.contiguous()], self._next_in_group, tag + i))
            for i, t in enumerate(recv):
                if t.nbytes:
                    works.append(group.recv([t], self._prev_in_group, tag + i))
            self.messages += len(works)
            return Pending(works, self._waited)
        if self._watch is not None:
            out, into = self.pool.wire(send), self.pool.wire(recv)
            if out is not None and into is not None:  # a walk's hop: its tensors and header as one message
                self.exchanges += 1
                self.sent_bytes += sum(t.numel() * t.element_size() for t in send)
                value = self._header(tag)
                out[1].fill_(value)  # a fill's value is the kernel's argument: nothing copied from the host
                peers = [(dist.isend, out[0], self._next, 0), (dist.irecv, into[0], self._prev, 0)]
                after = functools.partial(self._landed, self.exchanges, into[1], value)
                return self._post(peers, self._whats[tag], after, self._waited)
        sends = [(t.contiguous(), tag + i) for i, t in enumerate(send) if t.numel()]
        recvs = [(t, tag + i) for i, t in enumerate(recv) if t.numel()]
        self.sent_bytes += sum(t.numel() * t.element_size() for t, _ in sends)
        self.exchanges += 1
        what = ""  # what names a hop only to a watch: no string built per hop otherwise
        after_check: Callable[[], None] | None = None
        if self._watch is not None:  # tensors not carved by the pool (a test's): the header as a message of its own
            what = self._whats[tag]
            value = self._header(tag)
            header = torch.empty(1, dtype=torch.int64, device=self.device).fill_(value)
            arrived = torch.empty_like(header)
            sends, recvs = [*sends, (header, tag)], [*recvs, (arrived, tag)]
            after_check = functools.partial(self._landed, self.exchanges, arrived, value)
        peers = [(dist.isend, t, self._next, k) for t, k in sends] + [(dist.irecv, t, self._prev, k) for t, k in recvs]
        return self._post(peers, what, after_check, self._waited)

    def _post(self, peers: list, what: str, after: Callable[[], None] | None = None, waited: str = WAITED) -> Pending:
        """Post `peers` ((isend or irecv, tensor, global rank, tag)) the way the transport wants; `after` runs once
        they are waited for; `waited` names the peers in a failed wait's error."""
        watch = self._watch
        if watch is not None:
            watch.check()  # a failure the watch named: raised here, at the ring's next message
            # watched from before the post: NCCL connects a pair at its first message, blocking the host until the
            # neighbour comes; a neighbour that never does is named after HF_RTP_TIMEOUT like a hop in flight
            entry = watch.begin(what)
        self.messages += len(peers)
        try:
            if self.transport == "batched":  # NCCL: a hop's sends and receives posted together, or a ring deadlocks
                ops = [dist.P2POp(op, t, peer, self.group, k) for op, t, peer, k in peers]
                works = dist.batch_isend_irecv(ops) if ops else []
                landings: list = []
            else:
                works, landings = self._one_by_one(peers)
        except BaseException:  # KeyboardInterrupt too: no entry left unposted, to time out and end the process later
            if watch is not None:
                watch.check()  # the watch aborted the group under a blocked post: its error, not NCCL's
                watch.posted(entry, [])  # a post that failed by itself leaves nothing in flight to time out
            raise
        if watch is not None:
            watch.posted(entry, works)
        if landings:  # staged: what arrived in host memory goes to the device once it is there
            after = functools.partial(_land, landings, after)
        return Pending(works, waited, after=after, failed=watch.check if watch is not None else None)

    def _one_by_one(self, peers: list) -> tuple[list, list]:
        """Plain isend/irecv (gloo's batched path has been seen to hang), each message copied through host memory
        where the backend cannot send the device's tensors ("staged"): the works, and (tensor, host copy) for each
        message that lands in host memory first."""
        tagged = self._watch is None  # a watched ring sends no tags: NCCL would ignore them, headers tell instead
        staged = self.transport == "staged"
        group = self.group
        assert group is not None  # a ring of one posts nothing
        works, landings = [], []
        for op, t, peer, k in peers:
            if not staged and peer in (self._next, self._prev):  # a neighbour: on the group itself, as `exchange` posts
                inner = self._next_in_group if peer == self._next else self._prev_in_group
                tag = k if tagged else 0
                works.append(group.send([t], inner, tag) if op is dist.isend else group.recv([t], inner, tag))
                continue
            wire = t
            if staged:
                wire = t.to("cpu") if op is dist.isend else torch.empty(t.shape, dtype=t.dtype)
                if op is dist.irecv:
                    landings.append((t, wire))
            works.append(op(wire, peer, group=self.group, tag=k if tagged else 0))
        return works, landings

    def _header(self, tag: int) -> int:
        """What a watched hop carries beside its tensors: this rank's digest of every hop it made, this one included
        (each hop's kind and how many hops came before it, as one int64: the kinds' tags are below 256). Known on the
        host, so it is written by a fill (its value is the kernel's argument: nothing is copied from the host), and it
        is also what this rank expects to receive on the same hop."""
        value = (self.exchanges << 8) | tag
        self._expected = (self._expected * _MIX + value + _SIGN) % _WRAP - _SIGN  # int64 arithmetic
        self._checked_kinds.add(tag)
        self._unchecked += 1
        self._in_flight += 1
        return self._expected

    def _landed(self, count: int, arrived: torch.Tensor, expected: int) -> None:
        """After a watched hop: its header kept for `walked` to compare (a reference, no kernel). The newest hop's
        stays, should hops be waited out of order (its digest holds the others')."""
        if self._arrived is None or count > self._arrived[0]:
            self._arrived = (count, arrived, expected)
        self._in_flight -= 1
        if self._unchecked >= _FOLD_EVERY:  # a long walk (many pieces, many ranks) is checked on the way
            self.walked()

    def walked(self) -> None:
        """The end of a walk: on a watched ring, the newest header that arrived (the sender's digest of all its hops)
        compared with this rank's own digest after the same hop (every rank makes the same hops in the same order),
        into the mismatch flag, which the watch reads without waiting (Watch.flag): one compare, one flag copy and one
        event a walk, not a hop. Every walk calls it (token walks too); elsewhere it does nothing."""
        count, arrived = self._unchecked, self._arrived
        if not count or arrived is None or self._in_flight:  # a hop in flight: checked with the walk that waits for it
            return
        assert self._watch is not None  # watched hops only
        _, header, expected = arrived
        if self._mismatch is None:
            self._mismatch = torch.zeros(1, dtype=torch.bool, device=header.device)
        # latched by the digests themselves: once two histories differ, every later header differs too
        torch.ne(header, expected, out=self._mismatch)
        self._arrived = None  # a header's slot is written again by later hops: compared once, then let go
        kinds = " or ".join(sorted(_KINDS[k] for k in self._checked_kinds))
        self._unchecked, self._checked_kinds = 0, set()
        self._watch.flag(self._mismatch, f"one of {count} hops of {kinds} from global rank {self._prev}")

    def pieces(self, layout: ChunkLayout, like: torch.Tensor) -> int:
        """How many pieces each chunk of `layout` walks the ring in (1 on a ring of one)."""
        return 1 if self.size == 1 else layout.pieces_for(self.piece_bytes // like.element_size())

    def plan(self, layout: ChunkLayout, like: torch.Tensor) -> None:
        """Reserve pool slots large enough for this layout's largest piece."""
        if self.size > 1:
            self.pool.plan(layout.max_piece_numel(self.pieces(layout, like)), like)

    def own_piece(self, own: Bundle, layout: ChunkLayout, rows: Rows) -> list[torch.Tensor]:
        first, end = layout.bounds(self.rank)
        if rows[0] == first and rows[1] == end:  # the whole chunk (one piece): the tensors themselves, no views to make
            return list(own)
        return [t[rows[0] - first : rows[1] - first] for t in own]  # dim-0 views: contiguous, no copy

    def _like(self, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor of `dtype` on `like`'s device: what the pool carves slots by, made once per kind."""
        key = (like.device, dtype)
        known = self._likes.get(key)
        if known is None:
            known = self._likes[key] = like.new_empty(0, dtype=dtype)
        return known

    def travel_dtype(self, own: Bundle, dtype: torch.dtype | None) -> torch.dtype:
        """What weights travel in: `dtype` (the matmuls') where it is a narrower float than the
        parameter's, so a cast at the matmul would have made the same values; else the parameter's."""
        like = own[0]
        if (
            dtype is None
            or self.size == 1
            or not like.is_floating_point()
            or not dtype.is_floating_point
            or torch.finfo(dtype).bits >= torch.finfo(like.dtype).bits
        ):
            return like.dtype
        return dtype

    def _held(self, own: Bundle, layout: ChunkLayout, rows: Rows, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's piece in the travel dtype: a cast copy of one piece at most, made once per walk. On a watched
        ring, in the weights' slot 1 (the first hop receives into slot 0), so that the first hop is one message,
        its header after it (the pool's room), as every other hop is: under autocast that is where the cast lands,
        otherwise one copy of the piece a walk, on the device."""
        piece = self.own_piece(own, layout, rows)
        if self._watch is not None:
            like = self._like(piece[0], dtype if piece[0].is_floating_point() else piece[0].dtype)
            staged = self.pool.take("weights", 1, [t.shape for t in piece], like)
            for slot, t in zip(staged, piece, strict=True):
                slot.copy_(t)
            return staged
        return [t.to(dtype) if t.dtype != dtype and t.is_floating_point() else t for t in piece]

    def forward_walk(
        self,
        own: Bundle,
        layout: ChunkLayout,
        compute: Callable[[Rows, Bundle], None],
        dtype: torch.dtype | None = None,
    ) -> None:
        """Call `compute(rows, piece)` for every piece of every chunk, own chunk first, while the next
        piece is in flight. `rows` are the piece's global rows [start, end). `dtype`: what the
        matmuls run in (travel_dtype)."""
        self.moved = None  # the weights' slots, where the last tokens that moved are kept, are overwritten
        pieces = self.pieces(layout, own[0])
        travel = self.travel_dtype(own, dtype)
        like = self._like(own[0], travel)
        for cut in layout.walk(pieces):  # each piece's rows and shapes in every chunk, computed once per layout
            index = self.rank
            rows = cut[index][0]
            held = self._held(own, layout, rows, travel)
            for step in range(self.size):
                last = step == self.size - 1
                if not last:
                    following = (index - 1) % self.size
                    next_rows, shapes = cut[following]
                    incoming = self.pool.take("weights", step % 2, shapes, like)
                    pending = self.exchange(held, incoming, _WEIGHT_TAG)
                compute(rows, held)
                if not last:
                    pending.wait()
                    index, held, rows = following, incoming, next_rows
        self.walked()

    def backward_walk(
        self,
        own: Bundle,
        layout: ChunkLayout,
        accumulate: Callable[[Rows, Bundle | None, Bundle], None] | None,
        input_grad: Callable[[Rows, Bundle], None] | None,
        dtype: torch.dtype | None = None,
        accumulate_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor] | None:
        """Walk the ring again for backward; return this rank's summed weight gradients.

        `accumulate(rows, piece, acc)` adds this rank's gradient for those rows into `acc`. A rank
        keeps its share of its own piece at home; the others' shares of a piece go into an
        accumulator that starts at the next rank and travels with the piece, arriving home after
        N-1 hops (as many as the weights make) holding their sum, so a flat ring needs no
        all-reduce; the sum over this ring's ranks is returned. (On a 2-D grid the sum over the
        replicas follows: layers.common.finish_weight_grads, through ReplicaSum.)

        Weights rotate only when `input_grad` is given (an embedding needs none; `piece` is then
        None); `input_grad(rows, piece)` runs while the accumulator is in flight. `accumulate` is None for frozen
        weights, which then send no
        gradients at all. Weights travel in `dtype` (travel_dtype), accumulators in `reduce_dtype`, or in
        `accumulate_dtype` where given (attention's K/V gradients, which are activations', not parameters').
        """
        like = own[0]
        self.moved = None  # the weights' slots, where the last tokens that moved are kept, are overwritten
        summed = accumulate_dtype or self.reduce_dtype or like.dtype
        if self.size == 1:
            acc = None
            if accumulate is not None:
                acc = [like.new_zeros(s, dtype=accumulate_dtype or like.dtype) for s in layout.shapes(0)]
                accumulate(layout.bounds(0), own if input_grad is not None else None, acc)
            if input_grad is not None:
                input_grad(layout.bounds(0), own)
            return acc
        pieces = self.pieces(layout, like)
        travel = self._like(like, self.travel_dtype(own, dtype))
        reduced = self._like(like, summed)
        # This rank's complete gradient is gathered in fresh memory, not in the shared pool: it
        # becomes `.grad`. Zeros, as every piece's own share is added to it.
        home = [reduced.new_zeros(s) for s in layout.shapes(self.rank)] if accumulate is not None else None
        for cut in layout.walk(pieces):  # each piece's rows and shapes in every chunk, computed once per layout
            index = self.rank
            held = self._held(own, layout, cut[index][0], travel.dtype) if input_grad is not None else None
            acc = None
            for step in range(self.size):
                last = step == self.size - 1
                following = (index - 1) % self.size
                (rows, shapes), (next_rows, next_shapes) = cut[index], cut[following]
                weights_pending = grads_pending = None
                if input_grad is not None and not last:
                    assert held is not None  # held whenever input_grad is given
                    incoming = self.pool.take("weights", step % 2, next_shapes, travel)
                    weights_pending = self.exchange(held, incoming, _WEIGHT_TAG)
                if accumulate is not None:
                    assert home is not None  # made above whenever accumulate is given
                    piece = held if input_grad is not None else None
                    if step == 0:  # this rank's share of its own piece's gradient stays home
                        accumulate(rows, piece, self.own_piece(home, layout, rows))
                    else:  # the others' shares travel: started at the next rank, home in N-1 hops
                        if step == 1:
                            acc = self.pool.take("grads", 1, shapes, reduced)
                            for a in acc:
                                a.zero_()
                        assert acc is not None  # taken at step 1
                        accumulate(rows, piece, acc)
                        landing = self.pool.take("grads", (step + 1) % 2, next_shapes, reduced)
                        # Sent while input_grad below runs: the transfer hides behind that matmul.
                        grads_pending = self.exchange(acc, landing, _GRAD_TAG)
                if input_grad is not None:
                    assert held is not None
                    input_grad(rows, held)
                if weights_pending is not None:
                    weights_pending.wait()
                    held = incoming
                if grads_pending is not None:
                    grads_pending.wait()
                    acc = landing
                    if last:  # the other ranks' shares of this rank's piece: add them to its own
                        assert home is not None
                        mine = self.own_piece(home, layout, next_rows)
                        for m, arrived in zip(mine, landing, strict=True):
                            m.add_(arrived)
                index = following
        self.walked()
        return home if home is None or reduced.dtype == like.dtype else [h.to(like.dtype) for h in home]

    def slot_bytes(self, like: torch.Tensor) -> int:
        """What a weights' slot holds for a layer of `like`'s dtype (BufferPool.plan): the most a token walk may
        use of each of the two. Under autocast a float32 tensor's slot is sized in the autocast dtype, as the pool
        sizes it (a float32 embedding's lookup beside bf16 matmuls): reckoned in float32 it would seem twice as big."""
        return self.pool.planned_bytes(like)

    most_tokens: int | None = None
    """The most tokens any rank brought to the last forward (model/traffic.py; None where a rank's inputs were not
    counted), kept after it, through its backward: what model/tiled_mlp.py cuts tiles by, on every rank alike."""

    brought: tuple[int, int] | None = None
    """What this rank's own forward brought, its tokens and those its LM head sees, beside the `traffic` every rank
    agreed on (model/traffic.py; None outside a forward): token_walk's `brought`."""

    # a forward that moves the tokens instead of the weights: distributed/transport/token_walk.py says how
    token_walk = _token_walk
    # a backward whose products stay where they are made (an embedding's weight gradient): the tokens visit each rank
    visit_walk = _visit_walk

    def collect(self, own: torch.Tensor, layout: ChunkLayout, rows: Rows | None = None) -> Iterator[torch.Tensor]:
        """Stream rows [start, end) of a dim-0-sharded tensor (all by default) to ring rank 0, in order.

        Rank 0 yields each owner's rows, its own first, in pieces of at most `piece_bytes`, while
        the next piece is in flight, so it holds at most two foreign pieces, never the whole tensor;
        they land in the weight slots, idle while saving. Every other rank sends its pieces and
        yields nothing. Every rank must exhaust the iterator.
        """
        start, end = rows or (0, layout.rows)
        self.moved = None  # the weights' slots, where the last tokens that moved are kept, are overwritten
        count = self.pieces(layout, own)  # the walks' pieces, so the pool's slots already fit them

        def pieces(j: int) -> list[Rows]:
            cut = [layout.piece(j, p, count) for p in range(count)]
            return [(max(lo, start), min(hi, end)) for lo, hi in cut if min(hi, end) > max(lo, start)]

        if self.rank != 0:
            first = layout.bounds(self.rank)[0]
            for lo, hi in pieces(self.rank):
                piece = own[lo - first : hi - first].contiguous()
                send = [(dist.isend, piece, self._global_rank(0), _COLLECT_TAG)]
                self._post(send, "sending rows to ring rank 0").wait()
                if self.device.type == "cuda":  # NCCL's wait does not hold the host: without this a rank would post
                    torch.cuda.current_stream(self.device).synchronize()  # every piece, then wait out rank 0's save
            return

        for lo, hi in pieces(0):
            yield own[lo:hi]
        foreign = [(j, piece) for j in range(1, self.size) for piece in pieces(j)]

        def receive(k: int):
            j, (lo, hi) = foreign[k]
            (buffer,) = self.pool.take("weights", k % 2, [torch.Size((hi - lo, *own.shape[1:]))], own)
            peer = self._global_rank(j)
            return buffer, self._post([(dist.irecv, buffer, peer, _COLLECT_TAG)], f"rows from global rank {peer}")

        incoming = receive(0) if foreign else None
        for k in range(len(foreign)):
            assert incoming is not None  # received for k before the loop or at k - 1
            buffer, pending = incoming
            pending.wait()
            if k + 1 < len(foreign):
                incoming = receive(k + 1)  # into the other slot, while the caller writes this one
            yield buffer
