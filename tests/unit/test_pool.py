"""distributed/transport/pool.py: the views a walk asks for at every hop are carved once, and never outlive their
buffer."""

from __future__ import annotations

import torch

from hf_rtp.distributed.transport.pool import VIEWS_KEPT, BufferPool

LIKE = torch.empty(0)


def test_the_same_request_gets_the_same_views_and_another_dtype_its_own():
    pool = BufferPool()
    first = pool.take("weights", 0, [torch.Size((4, 8)), torch.Size((4,))], LIKE)
    again = pool.take("weights", 0, [torch.Size((4, 8)), torch.Size((4,))], LIKE)
    assert all(a is b for a, b in zip(first, again, strict=True))
    half = pool.take("weights", 0, [torch.Size((4, 8))], torch.empty(0, dtype=torch.bfloat16))
    assert half[0].dtype == torch.bfloat16 and half[0].data_ptr() == first[0].data_ptr()  # one slot, two dtypes
    assert pool.allocations == 1


def test_a_grown_slot_drops_the_views_of_its_old_buffer():
    pool = BufferPool()
    (small,) = pool.take("grads", 1, [torch.Size((2, 2))], LIKE)
    (large,) = pool.take("grads", 1, [torch.Size((64, 64))], LIKE)  # the slot's buffer is replaced
    (again,) = pool.take("grads", 1, [torch.Size((2, 2))], LIKE)
    assert pool.allocations == 2 and again is not small
    assert again.data_ptr() == large.data_ptr()  # carved from the buffer the slot holds now
    assert [b.numel() for b in pool.buffers("grads")] == [64 * 64 * 4]  # the old buffer is not kept


def test_views_of_many_shapes_are_kept_up_to_a_bound():
    pool = BufferPool()
    pool.take("weights", 0, [torch.Size((VIEWS_KEPT + 8,))], LIKE)
    for n in range(1, VIEWS_KEPT + 8):
        pool.take("weights", 0, [torch.Size((n,))], LIKE)  # a token walk's messages, one per sequence length
    assert len(pool._views) == VIEWS_KEPT and pool.allocations == 1
