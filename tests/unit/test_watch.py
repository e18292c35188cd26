"""The ring's watch (distributed/transport/watch.py) on its own thread: a hop is watched from before its post, because
on NCCL the post itself can block the host (a pair of ranks connects at its first message and waits for the
neighbour). A post that never returns is named after the timeout, and the group is aborted; a hop posted as no
work is forgotten. tests/gpu/test_nccl_ring_cuda.py shows it on NCCL."""

from __future__ import annotations

import time

import pytest
import torch

from hf_rtp.distributed.transport.watch import Watch
from hf_rtp.errors import CollectiveMisuseError


def _failure_within(watch: Watch, seconds: float):
    deadline = time.monotonic() + seconds
    while watch.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return watch.failure


def test_a_post_that_never_returns_is_named_after_the_timeout_and_aborts_the_group():
    aborted = []
    watch = Watch(0.5, abort=lambda: aborted.append(True))
    started = time.monotonic()
    watch.begin("a hop of weights from global rank 1")  # its post never returns: `posted` is never called
    failure = _failure_within(watch, 10)
    assert failure is not None and time.monotonic() - started >= 0.5
    assert "a hop of weights from global rank 1 was still not posted" in str(failure), failure
    # the failure is recorded before the abort (the abort returns a blocked post, which then raises it): wait for both
    deadline = time.monotonic() + 10
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "HF_RTP_TIMEOUT" in str(failure) and aborted == [True]
    with pytest.raises(CollectiveMisuseError, match="still not posted"):
        watch.check()


def test_a_hop_posted_as_no_work_is_forgotten():
    watch = Watch(0.3)
    watch.posted(watch.begin("a hop of gradients from global rank 3"), [])
    time.sleep(1.0)
    assert watch.failure is None
    watch.check()


def test_a_post_that_raised_leaves_nothing_to_time_out():
    """A watched ring whose post raises by itself (a wrong tensor, say) leaves the watch with nothing in flight: a
    script that caught the error is not ended later for a hop that was never sent."""
    import torch.distributed as dist

    from hf_rtp.distributed.transport.ring import _WEIGHT_TAG, Ring

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ring = Ring(dist.new_group([0], backend="gloo"), timeout_s=0.3, watched=True)
        ring.size, ring._next, ring._prev = 2, 5, 5  # a neighbour no group has: the post itself raises
        with pytest.raises(Exception) as raised:
            ring.exchange([torch.ones(2)], [torch.empty(2)], _WEIGHT_TAG)
        assert not isinstance(raised.value, CollectiveMisuseError), raised.value
        time.sleep(1.0)
        assert ring._watch is not None and ring._watch.failure is None
    finally:
        dist.destroy_process_group()
