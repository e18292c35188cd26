"""distributed/transport/pool.py: the views a walk asks for at every hop are carved once, and never outlive their
buffer."""

from __future__ import annotations

import torch

from hf_rtp.distributed.transport.pool import VIEWS_KEPT, BufferPool, header_room

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
    # the old buffer is not kept; the new one holds the views and a watched hop's header after them
    assert [b.numel() for b in pool.buffers("grads")] == [header_room(64 * 64 * 4)]


def test_views_of_many_shapes_are_kept_up_to_a_bound():
    pool = BufferPool()
    pool.take("weights", 0, [torch.Size((VIEWS_KEPT + 8,))], LIKE)
    for n in range(1, VIEWS_KEPT + 8):
        pool.take("weights", 0, [torch.Size((n,))], LIKE)  # a token walk's messages, one per sequence length
    assert len(pool._views) == VIEWS_KEPT and pool.allocations == 1


def test_a_carved_bundle_and_its_header_are_one_message():
    """A watched ring sends a hop's tensors and its header as one message (distributed/transport/ring.py): the wire
    of a bundle `take` carved covers its tensors, then the header's 8 bytes at an offset aligned to 8; writing the
    header touches no tensor of the bundle, and tensors the pool did not carve have no wire."""
    pool = BufferPool()
    bundle = pool.take("weights", 0, [torch.Size((3, 5)), torch.Size((3,))], torch.empty(0, dtype=torch.bfloat16))
    for t in bundle:
        t.fill_(1.0)
    wire, header = pool.wire(bundle)
    assert wire.dtype == torch.uint8 and wire.data_ptr() == bundle[0].data_ptr()
    assert wire.numel() == header_room((15 + 3) * 2) == 48
    assert header.dtype == torch.int64 and header.numel() == 1 and header.data_ptr() % 8 == 0
    assert header.data_ptr() + 8 == wire.data_ptr() + wire.numel()
    header.fill_(-1)
    assert all(bool((t == 1.0).all()) for t in bundle)  # the header lies past the bundle
    assert pool.wire(bundle)[0] is wire  # made once
    assert pool.wire([torch.ones(3)]) is None  # a caller's tensor: sent as it is, the header apart
    assert pool.wire(bundle[::-1]) is None  # not one after another
    pool.take("weights", 0, [torch.Size((4096,))], LIKE)  # the slot grows: the old buffer's wires are dropped
    assert pool._wires == {}
