"""The ring: the only place in hf_rtp that does point-to-point communication.

Rank r sends to r+1 and receives from r-1 on a process group of its own (design I5). A rotated op
walks the ring through `forward_walk` / `backward_walk` and supplies the math as callbacks, so the
overlap (transfer of the next chunk while computing on the held one), the double buffering and the
travelling gradient accumulator live here once, not in every layer.

Foreign chunks land in a `BufferPool` that all layers share: two weight slots and two gradient
slots, each as large as the largest chunk seen, so a rotated op never holds more than its own chunk
plus two foreign ones (design I3) and nothing is allocated per step.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .sharding import ChunkLayout

Bundle = Sequence[torch.Tensor]
_WEIGHT_TAG = 0
_GRAD_TAG = 64
_COLLECT_TAG = 128


class BufferPool:
    """Flat buffers keyed by (role, slot, dtype, device); chunks are views carved from them."""

    def __init__(self):
        self._flat: dict[tuple, torch.Tensor] = {}
        self._planned: dict[tuple, int] = {}
        self.allocations = 0  # how many flat buffers were ever created: tests and memory reports read it

    def take(self, role: str, slot: int, shapes: Sequence[torch.Size], like: torch.Tensor) -> list[torch.Tensor]:
        need = sum(math.prod(s) for s in shapes)
        key = (role, slot, like.dtype, like.device)
        flat = self._flat.get(key)
        if flat is None or flat.numel() < need:
            flat = None  # free the smaller buffer before allocating the larger one
            size = max(need, self._planned.get((like.dtype, like.device), 0))
            flat = torch.empty(size, dtype=like.dtype, device=like.device)
            self._flat[key] = flat
            self.allocations += 1
        views, offset = [], 0
        for shape in shapes:
            n = math.prod(shape)
            views.append(flat[offset : offset + n].view(shape))
            offset += n
        return views

    def plan(self, layout: ChunkLayout, like: torch.Tensor) -> None:
        """Size every slot for the largest chunk up front, so none is regrown mid-step.

        Slots are still allocated on first use: gradient slots only once training starts.
        """
        key = (like.dtype, like.device)
        self._planned[key] = max(self._planned.get(key, 0), layout.max_numel())

    def buffers(self, role: str) -> list[torch.Tensor]:
        return [t for (r, *_), t in self._flat.items() if r == role]


class _Pending:
    def __init__(self, works):
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class Ring:
    """Neighbour exchange on `group` (None: a ring of one, which never communicates)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
            self._next = self._prev = 0
            self._batched = False
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
            self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
            # NCCL must post a send and its matching receive together or the ring deadlocks;
            # gloo's batched path has been seen to hang, so it uses plain isend/irecv.
            self._batched = dist.get_backend(group) == "nccl"
        self.pool = BufferPool()

    def _exchange(self, send: Bundle, recv: Bundle, tag: int) -> _Pending:
        """Start sending `send` to the next rank and receiving `recv` from the previous one."""
        # Both ends derive chunk sizes from the same layout, so an empty chunk is skipped on both.
        sends = [(t, tag + i) for i, t in enumerate(send) if t.numel()]
        recvs = [(t, tag + i) for i, t in enumerate(recv) if t.numel()]
        if self._batched:
            ops = [dist.P2POp(dist.isend, t.contiguous(), self._next, self.group, k) for t, k in sends]
            ops += [dist.P2POp(dist.irecv, t, self._prev, self.group, k) for t, k in recvs]
            return _Pending(dist.batch_isend_irecv(ops) if ops else [])
        works = [dist.isend(t.contiguous(), self._next, group=self.group, tag=k) for t, k in sends]
        works += [dist.irecv(t, self._prev, group=self.group, tag=k) for t, k in recvs]
        return _Pending(works)

    def forward_walk(self, own: Bundle, layout: ChunkLayout, compute: Callable[[int, Bundle], None]) -> None:
        """Call `compute(j, chunk_j)` for every chunk j, own first, while the next one is in flight."""
        index, held = self.rank, own
        for step in range(self.size):
            last = step == self.size - 1
            if not last:
                following = (index - 1) % self.size
                incoming = self.pool.take("weights", step % 2, layout.shapes(following), own[0])
                pending = self._exchange(held, incoming, _WEIGHT_TAG)
            compute(index, held)
            if not last:
                pending.wait()
                index, held = following, incoming

    def backward_walk(
        self,
        own: Bundle,
        layout: ChunkLayout,
        accumulate: Callable[[int, Bundle | None, Bundle], None] | None,
        input_grad: Callable[[int, Bundle], None] | None,
    ) -> list[torch.Tensor] | None:
        """Walk the ring again for backward; return this rank's summed weight gradients.

        `accumulate(j, chunk_j, acc)` adds this rank's gradient for chunk j into `acc`, an
        accumulator that travels with the chunk: after N hops it arrives home holding the sum over
        all ranks, so rotated weights need no all-reduce. Weights rotate only when `input_grad` is
        given (an embedding needs none; `chunk_j` is then None); `input_grad(j, chunk_j)` runs while
        the accumulator is in flight. `accumulate` is None for frozen weights, which then send no
        gradients at all.
        """
        like = own[0]
        index, held = self.rank, own
        acc = None
        for step in range(self.size):
            last = step == self.size - 1
            following = (index - 1) % self.size
            weights_pending = grads_pending = None
            if input_grad is not None and not last:
                incoming = self.pool.take("weights", step % 2, layout.shapes(following), like)
                weights_pending = self._exchange(held, incoming, _WEIGHT_TAG)
            if accumulate is not None:
                if step == 0:
                    shapes = layout.shapes(index)
                    acc = self.pool.take("grads", 0, shapes, like) if self.size > 1 else [like.new_empty(s) for s in shapes]
                    for a in acc:
                        a.zero_()
                accumulate(index, held if input_grad is not None else None, acc)
                if self.size > 1:
                    # The last hop brings this rank's own, complete gradient home into fresh memory:
                    # it becomes `.grad`, so it must not live in the shared pool.
                    if last:
                        landing = [like.new_empty(s) for s in layout.shapes(following)]
                    else:
                        landing = self.pool.take("grads", (step + 1) % 2, layout.shapes(following), like)
                    # Sent while input_grad below runs: the transfer hides behind that matmul.
                    grads_pending = self._exchange(acc, landing, _GRAD_TAG)
            if input_grad is not None:
                input_grad(index, held)
            if weights_pending is not None:
                weights_pending.wait()
                held = incoming
            if grads_pending is not None:
                grads_pending.wait()
                acc = landing
            index = following
        return acc

    def collect(self, own: torch.Tensor, layout: ChunkLayout, rows: tuple[int, int] | None = None) -> Iterator[torch.Tensor]:
        """Stream rows [start, end) of a dim-0-sharded tensor (all by default) to ring rank 0, in order.

        Rank 0 yields each owner's piece, its own first, while the next one is in flight, so it
        holds at most two foreign pieces, never the whole tensor; they land in the weight slots,
        idle while saving. Every other rank sends its overlap and yields nothing. Every rank
        must exhaust the iterator.
        """
        start, end = rows or (0, layout.rows)

        def overlap(j: int) -> tuple[int, int]:
            first, last = layout.bounds(j)
            return max(first, start), min(last, end)

        if self.rank != 0:
            lo, hi = overlap(self.rank)
            if hi > lo:
                first = layout.bounds(self.rank)[0]
                piece = own[lo - first : hi - first].contiguous()
                dist.isend(piece, dist.get_global_rank(self.group, 0), group=self.group, tag=_COLLECT_TAG).wait()
            return

        owners = [j for j in range(self.size) if overlap(j)[1] > overlap(j)[0]]

        def receive(slot: int, j: int):
            lo, hi = overlap(j)
            shape = torch.Size((hi - lo, *own.shape[1:]))
            (buffer,) = self.pool.take("weights", slot, [shape], own)
            source = dist.get_global_rank(self.group, j)
            return buffer, dist.irecv(buffer, source, group=self.group, tag=_COLLECT_TAG)

        foreign = [j for j in owners if j != 0]
        incoming = receive(0, foreign[0]) if foreign else None
        for j in owners:
            if j == 0:
                lo, hi = overlap(0)
                yield own[lo:hi]
                continue
            buffer, work = incoming
            work.wait()
            position = foreign.index(j)
            if position + 1 < len(foreign):
                incoming = receive((position + 1) % 2, foreign[position + 1])  # the other slot
            yield buffer
