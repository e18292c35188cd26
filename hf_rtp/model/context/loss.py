"""The loss of a forward in a block: one meaning, vanilla's over the whole sequence, whatever the caller passes.

A forward with labels returns, on every rank of the ring, what vanilla's forward returns for the same keywords
on the whole sequence: the sum of the label tokens' losses divided by `num_items_in_batch` when the caller passes
it (transformers' way to normalise over accumulated micro-batches), else by the sequence's label count (vanilla's
mean). Each rank computes its tokens' share with that one divisor, and the shares are summed over the ring.
model/forward.py gives a forward in a block that divisor (`divisor`) and returns `sequence_loss` below; so does TRL's
fused forward (integrations/trl.py).

The sum's backward is a sum too: each rank's share gets the ring's upstream gradient, N times its own, so after
the data-parallel mean over ranks (DDP, accelerate, `hf_rtp.sync_grads`) every gradient is the whole sequence's.
Callers that follow torch's own context-parallel convention, where a rank's loss is its share and the gradients'
mean is scaled back by the processes (Trainer's `num_items_in_batch` path), declare it (`shares`,
integrations/trainer.py) and get the ring's mean of the shares instead: one conversion, in one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .run import ContextRun


def sequence_loss(run: ContextRun, share: torch.Tensor) -> torch.Tensor:
    """A forward's loss from this rank's share: the whole sequence's, or the ring's mean of the shares for a caller
    that declared torch's convention (`shares`)."""
    total = ring_sum(run, share)
    return total / run.ring.size if run.shares else total


@contextmanager
def shares(run: ContextRun, on: bool) -> Iterator[None]:
    """For a caller that follows torch's context-parallel convention (Trainer's compute_loss when it passes its
    count of label tokens: it scales each rank's share back by the processes, and divides the count by cp_size):
    each forward's loss is the ring's mean of the shares, whose gradient through the ring sum is each rank's
    own share's."""
    before, run.shares = run.shares, on
    try:
        yield
    finally:
        run.shares = before


def ring_sum(run: ContextRun, share: torch.Tensor) -> torch.Tensor:
    """The sum over the ring of each rank's share of the loss (see the module's docstring for its backward)."""
    if run.ring.group is None:
        return share
    return _RingSum.apply(share, run.ring.group)


class _RingSum(torch.autograd.Function):
    """The sum over the ring of each rank's share of the loss; its backward sums too, so each rank's gradient
    is the ring's (the data-parallel mean over ranks then gives the whole sequence's gradient)."""

    @staticmethod
    def forward(ctx, value, group):
        ctx.group = group
        total = value.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
