"""Cross-rank agreement: one rank's failure is an error on every rank, never a hang in the next collective.

A step that may fail on some ranks only (a file one rank cannot read, a check one rank's data fails) runs
inside `agreed(group, CheckpointError)`: every rank then meets in one small all-gather, and either all go on
or all raise, naming the rank that failed. A new call site cannot forget the meeting, because leaving the
block is the meeting. The block itself must not communicate: a rank that failed inside a collective
cannot meet the others (work interleaved with transfers collects its failure in `Attempts` instead).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from ...errors import CLASSES, HfRtpError


@contextmanager
def agreed(group: dist.ProcessGroup | None, wrap: type[HfRtpError] = HfRtpError) -> Iterator[None]:
    """Run the block on every rank, then agree: if it raised anywhere, raise on every rank (see
    raise_if_any_failed). An exception that is not an `Exception` (KeyboardInterrupt) is not agreed on:
    it ends this process, and the others learn of it through their timeouts."""
    try:
        yield
    except Exception as err:
        raise_if_any_failed(err, group, wrap)
        raise  # not reached: raise_if_any_failed raises when given an error
    raise_if_any_failed(None, group, wrap)


class Attempts:
    """One rank's steps interleaved with collectives it must keep taking part in (a writer's file steps
    between transfers): the first failure is kept and the later steps are skipped, never the transfers.
    `raise_first()` inside `agreed` then tells every rank."""

    def __init__(self):
        self.error: Exception | None = None

    def attempt(self, step, *args):
        """`step(*args)`, unless an earlier step failed; its result, or None after a failure. Arguments
        are bound now, so a step made in a loop cannot see a later iteration's values."""
        if self.error is None:
            try:
                return step(*args)
            except Exception as err:
                self.error = err
        return None

    def raise_first(self) -> None:
        if self.error is not None:
            raise self.error


def raise_if_any_failed(
    error: BaseException | None, group: dist.ProcessGroup | None = None, wrap: type[HfRtpError] = HfRtpError
) -> None:
    """Make a failure on one rank an error on every rank, instead of a hang in the next collective.

    Every rank raises the same class, naming the rank that failed: the failing rank's own class when
    it is an hf_rtp error, else `wrap` (the failing rank chains the original as its cause).
    """
    if not dist.is_initialized():  # one process: the same class a rank would raise, e.g. CheckpointError
        if error is None or isinstance(error, HfRtpError):
            if error is not None:
                raise error
            return
        raise wrap(f"{type(error).__name__}: {error}") from error
    mine = None
    if error is not None:
        name = type(error).__name__ if isinstance(error, HfRtpError) else wrap.__name__
        mine = (name, str(error) if isinstance(error, HfRtpError) else f"{type(error).__name__}: {error}")
    messages: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(messages, mine, group=group)
    except RuntimeError as err:  # gloo's words for a peer that is gone or silent
        raise wrap(
            f"rank {dist.get_rank()} could not agree with the other ranks ({str(err).splitlines()[0][:300]}): another "
            "rank died, was stopped, or did not reach the same call within HF_RTP_TIMEOUT. Check the other ranks' "
            "logs; every rank must make the same hf_rtp calls"
        ) from (error or err)
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if isinstance(error, HfRtpError):
        raise error
    rank, (name, message) = failed[0]
    raised = CLASSES.get(name, wrap)(f"rank {rank} failed: {message}")
    raise raised from error
