"""Context parallelism on a rotated model: one sequence across the ring, for the length of a `with` block.

Inside the block each rank holds its chunks of the sequence (distributed.tensors.sequence). Every op but attention works
token by token, so the rotated layers run unchanged; attention is hf_rtp's ring attention (layers.attention),
reached through transformers' own attention interface; rotary embeddings compute from the whole sequence's
positions; the loss is vanilla's over the whole sequence. One module a job, so that a new keyword or model
feature has one place to be handled:

- `run`: the block running now (`active`), and what each forward in it learned (`Facts`);
- `block`: the API: `context_parallel(model, batch)`, accelerate's `maybe_context_parallel` contract (`sharded`),
  `context_parallel_unshard`, and `running`, which sets the model up for the block and back after it;
- `inputs`: the checks of the block's buffers at its entry and of each forward's inputs, on every rank together;
- `interface`: the registration with transformers' attention interface, and what the ring attention refuses;
- `rope`: rotary embeddings on the whole sequence's positions, cut to the rank's tokens;
- `loss`: the loss's one meaning, vanilla's over the whole sequence, whatever keywords the caller passes.

Right padding is exact (a token never attends to the padding after it; padded positions carry no labels), and
so are packed documents (position_ids restarting: each attends within its own, as transformers separates them);
what the ring attention does not reproduce is refused by name: left padding, sliding windows shorter than the
sequence, soft-capping, attention sinks, attention dropout, implementations other than SDPA, and generation.
"""

from .block import check_cp_size, context_parallel, context_parallel_unshard, running, sharded
from .inputs import check
from .interface import attended
from .loss import ring_sum, sequence_loss, shares
from .run import ATTENTION, ContextRun, Facts, active, refuse_inside

__all__ = [
    "ATTENTION",
    "ContextRun",
    "Facts",
    "active",
    "attended",
    "check",
    "check_cp_size",
    "context_parallel",
    "context_parallel_unshard",
    "refuse_inside",
    "ring_sum",
    "running",
    "sequence_loss",
    "sharded",
    "shares",
]
