"""What a forward's rotated ops move, weights or tokens: the policy, from numbers every rank agreed.

A forward with few tokens (a decode step) moves the tokens instead of the weights (distributed/transport/token_walk.py):
each rank applies its own chunk to every rank's tokens, and the outputs travel home. Which one an op moves is
decided per call from `Traffic`, which every rank of the ring agreed at the forward's start (model/traffic.py),
so every rank walks the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

# A message's latency, in the bytes a link moves meanwhile: gloo between CPU processes about 0.2 ms at about
# 1 GB/s, NCCL about 10 us at 10-100 GB/s. An op whose weights are about this small walks them, in fewer hops.
HOP_BYTES = 256 * 1024


@dataclass(frozen=True)
class Traffic:
    """What every rank of the ring agreed at the start of a forward: the most tokens any rank brings to it
    (`bound`, rows each rank's tokens travel in), `moves` (from_pretrained's rotation_moves) and whether any
    rank records gradients (`grad`)."""

    bound: int
    head: int
    """the most tokens any rank's LM head sees (its `logits_to_keep`): where the head's walk starts"""
    moves: str
    grad: bool

    def moves_tokens(
        self, bound: int, weight_bytes: int, row_bytes: int, held_bytes: int, slot_bytes: int, ranks: int
    ) -> bool:
        """Whether an op whose weight chunk is `weight_bytes` and whose `bound` tokens carry `row_bytes` each
        (their inputs and outputs) moves the tokens: the same answer on every rank, from agreed numbers only.
        The weights make N-1 hops, the tokens N (their outputs go home), each hop costing HOP_BYTES of latency
        beside its bytes. Only if what a token walk holds at once in either weight slot (`held_bytes`,
        Ring.token_walk) fits the `slot_bytes` the weights' walks reserve: moving tokens takes no memory of its
        own."""
        if self.moves == "weights" or held_bytes > slot_bytes:
            return False
        tokens = ranks * (HOP_BYTES + bound * row_bytes)
        return self.moves == "activations" or tokens < (ranks - 1) * (HOP_BYTES + weight_bytes)
