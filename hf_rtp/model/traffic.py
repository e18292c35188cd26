"""What a forward's rotated ops move around the ring, agreed by every rank at the forward's start.

A rotated op moves either its weight pieces or the tokens (their inputs and outputs), whichever is
cheaper, in bytes and hops (distributed.transport.weights_or_tokens.Traffic). Every rank of the ring must walk the same
way and know how many token rows the others send, so at each forward's meeting (the `forward` entry every rank makes
already, rendezvous.enter) each rank brings the tokens of its forward and their sequences, whether it
records gradients, and its rotation_moves; the ring walks with the most tokens any rank brought (shorter
token sets travel padded), and the LM head with the most tokens any rank's head sees: transformers'
`logits_to_keep` (generate keeps each sequence's last logits, assisted decoding the candidates' too, which
differ by rank); an op that sees more learns so from its walk, Ring.token_walk. A forward whose inputs this
module cannot count (images beside the text, a call without input_ids or inputs_embeds) moves weights, on
every rank. Each rank also keeps what its own forward brought (Ring.brought): an op on no more tokens than
that reads no count on the host in its walk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.transport.ring import Ring
from ..distributed.transport.weights_or_tokens import Traffic
from ..errors import CollectiveMisuseError
from ..settings import MOVES

# A decoder backbone's inputs whose tokens are input_ids' (or inputs_embeds') b x s; any other tensor
# (pixel_values, audio features) brings tokens of its own to some rotated op.
_TEXT_INPUTS = frozenset(
    {"input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position", "token_type_ids", "labels"}
)
_UNCOUNTED = -1


def tokens_of(args: tuple, kwargs: dict, text_only: bool = False, keep=None) -> tuple[int, int]:
    """The tokens a backbone forward brings to its rotated ops and how many of them its LM head sees (`keep`: the
    model's logits_to_keep, None where unknown), or _UNCOUNTED twice. `text_only`: its input_ids' (or
    inputs_embeds') tokens whatever else it is given (context parallelism's shift_labels, images)."""
    given = dict(kwargs)
    if args:
        if len(args) > 1 or "input_ids" in given:
            return _UNCOUNTED, _UNCOUNTED
        given["input_ids"] = args[0]
    if not text_only and any(isinstance(v, torch.Tensor) and k not in _TEXT_INPUTS for k, v in given.items()):
        return _UNCOUNTED, _UNCOUNTED
    ids, embeds = given.get("input_ids"), given.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and embeds is None:
        return ids.numel(), _head_tokens(ids.numel(), ids[..., 0].numel(), keep)
    if isinstance(embeds, torch.Tensor) and ids is None:
        return embeds[..., 0].numel(), _head_tokens(embeds[..., 0].numel(), embeds[..., 0, 0].numel(), keep)
    return _UNCOUNTED, _UNCOUNTED


def _head_tokens(tokens: int, sequences: int, keep) -> int:
    """The tokens an LM head sees, by transformers' `logits_to_keep`: each sequence's last `keep` where it is a
    positive int, every token otherwise (0, not given, or a tensor of positions: at most every token, an upper
    bound; a head that sees more reads the true count in its walk)."""
    if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0 and sequences > 0:
        return sequences * min(keep, tokens // sequences)
    return tokens


def payload(ring: Ring, args: tuple, kwargs: dict, keep=None) -> list[int]:
    """What this rank brings to the forward's meeting (`keep`: the model's logits_to_keep, None where unknown)."""
    text = tokens_of(args, kwargs, text_only=True)[0]
    inference = int(torch.is_inference_mode_enabled())  # inference tensors walk otherwise (token_walk.identities)
    return [*tokens_of(args, kwargs, keep=keep), int(torch.is_grad_enabled()), MOVES.index(ring.moves), text, inference]


def agree(ring: Ring, everyone: list[list[int]]) -> None:
    """Set the ring's traffic for this forward from every rank's payload (the same on every rank)."""
    moves = {MOVES[code] for _, _, _, code, _, _ in everyone}
    if len(moves) > 1:
        raise CollectiveMisuseError(
            "ranks passed different rotation_moves to from_pretrained: "
            + ", ".join(f"rank {r}: {MOVES[code]!r}" for r, (_, _, _, code, _, _) in enumerate(everyone))
            + ". Every rank must walk the ring the same way: pass one value on every rank."
        )
    counts = [tokens for tokens, *_ in everyone]
    texts = [text for *_, text, _ in everyone]
    ring.most_tokens = None if _UNCOUNTED in texts else max(texts)  # kept through backward: not cleared below
    if _UNCOUNTED in counts or ring.moves == "weights":
        clear(ring)
        return
    inference = [r for r, (*_, under) in enumerate(everyone) if under]
    if 0 < len(inference) < len(everyone):  # where tokens may move: weights walk alike in either mode
        raise CollectiveMisuseError(
            f"ranks ran a forward in different modes: under torch.inference_mode on rank(s) "
            f"{', '.join(map(str, inference))} only. Its tensors make the ops that move tokens walk otherwise (each "
            "alone), so every rank must run the forward under torch.inference_mode, or none (torch.no_grad is the "
            'same on all), or load with rotation_moves="weights"'
        )
    ring.traffic = Traffic(
        bound=max(counts),
        head=max(head for _, head, *_ in everyone),
        moves=ring.moves,
        grad=any(grad for _, _, grad, *_ in everyone),
    )
    # `everyone` is every rank of the world, in global rank order (rendezvous.enter): on a 2-D grid this ring's rank
    # is not this rank's place there
    me = everyone[dist.get_rank() if dist.is_initialized() else 0]
    ring.brought = (me[0], me[1])


def clear(ring: Ring) -> None:
    """After a forward or generate: ops called outside one move weights."""
    ring.traffic, ring.brought = None, None
