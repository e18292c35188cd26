"""The ring's watch (distributed/watch.py) on its own thread: a hop is watched from before its post, because on
NCCL the post itself can block the host (a pair of ranks connects at its first message and waits for the
neighbour). A post that never returns is named after the timeout, and the group is aborted; a hop posted as no
work is forgotten. tests/gpu/test_nccl_ring_cuda.py shows it on NCCL."""

from __future__ import annotations

import time

import pytest

from hf_rtp.distributed.watch import Watch
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
    assert "HF_RTP_TIMEOUT" in str(failure) and aborted == [True]
    with pytest.raises(CollectiveMisuseError, match="still not posted"):
        watch.check()


def test_a_hop_posted_as_no_work_is_forgotten():
    watch = Watch(0.3)
    watch.posted(watch.begin("a hop of gradients from global rank 3"), [])
    time.sleep(1.0)
    assert watch.failure is None
    watch.check()
