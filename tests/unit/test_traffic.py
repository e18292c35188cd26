"""What a forward's ranks agree on before its rotated ops choose between moving weights and moving tokens
(model/traffic.py, distributed/transport/weights_or_tokens.py's Traffic): single-process, on the numbers each rank
would bring."""

import pytest
import torch

from hf_rtp.distributed.transport.ring import Ring
from hf_rtp.distributed.transport.weights_or_tokens import Traffic
from hf_rtp.errors import CollectiveMisuseError
from hf_rtp.model import traffic


def test_a_forwards_tokens_are_counted_from_its_text_inputs_only():
    ids = torch.zeros(3, 7, dtype=torch.long)
    # (tokens, those the LM head sees): every token, unless the model's logits_to_keep keeps each sequence's last k
    assert traffic.tokens_of((), {"input_ids": ids, "attention_mask": torch.ones(3, 7)}) == (21, 21)
    assert traffic.tokens_of((ids,), {}) == (21, 21)  # input_ids by position
    assert traffic.tokens_of((), {"inputs_embeds": torch.zeros(2, 5, 16)}) == (10, 10)
    assert traffic.tokens_of((), {"input_ids": ids}, keep=1) == (21, 3)  # generate's decode step
    assert traffic.tokens_of((), {"input_ids": ids}, keep=4) == (21, 12)  # assisted: 3 candidates + 1
    assert traffic.tokens_of((), {"input_ids": ids}, keep=50) == (21, 21)  # more than a sequence has
    assert traffic.tokens_of((), {"input_ids": ids}, keep=0) == (21, 21)
    assert traffic.tokens_of((), {"inputs_embeds": torch.zeros(2, 5, 16)}, keep=2) == (10, 4)
    uncounted = (-1, -1)
    # images bring tokens of their own to the vision tower's rotated ops: weights move
    assert traffic.tokens_of((), {"input_ids": ids, "pixel_values": torch.zeros(1, 3, 4, 4)}) == uncounted
    assert traffic.tokens_of((), {"pixel_values": None, "input_ids": ids}) == (21, 21)  # a decode step's None
    assert traffic.tokens_of((ids, ids), {}) == uncounted
    assert traffic.tokens_of((), {}) == uncounted


def test_ranks_agree_on_the_most_tokens_and_head_tokens_and_any_gradient():
    ring = Ring(None)
    traffic.agree(ring, [[21, 3, 0, 0, 21, 0], [8, 8, 1, 0, 8, 0]])
    assert ring.traffic == Traffic(bound=21, head=8, moves="auto", grad=True)
    assert ring.most_tokens == 21
    # one rank cannot count its tokens: every rank moves weights; its text tokens still count (tiled_mlp)
    traffic.agree(ring, [[21, 3, 0, 0, 21, 0], [-1, -1, 0, 0, 30, 0]])
    assert ring.traffic is None and ring.most_tokens == 30
    traffic.clear(ring)  # after the forward: kept through its backward
    assert ring.most_tokens == 30
    traffic.agree(ring, [[21, 3, 0, 0, 21, 0], [-1, -1, 0, 0, -1, 0]])
    assert ring.most_tokens is None
    ring.moves = "weights"
    traffic.agree(ring, [[1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 0]])
    assert ring.traffic is None and ring.most_tokens == 1
    with pytest.raises(CollectiveMisuseError, match="rank 0: 'auto', rank 1: 'weights'"):
        traffic.agree(ring, [[1, 1, 0, 0, 1, 0], [1, 1, 0, 1, 1, 0]])
    traffic.agree(ring, [[1, 1, 0, 1, 1, 0], [1, 1, 0, 1, 1, 1]])  # weights walk alike in either mode
    ring.moves = "auto"
    traffic.agree(ring, [[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]])  # every rank under torch.inference_mode
    with pytest.raises(CollectiveMisuseError, match=r"under torch.inference_mode on rank\(s\) 1 only"):
        traffic.agree(ring, [[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 1, 1]])


def test_the_text_tokens_count_beside_what_moves_cannot_count():
    ids = torch.zeros(3, 7, dtype=torch.long)
    given = {"input_ids": ids, "shift_labels": ids}  # context parallelism's
    assert traffic.tokens_of((), given) == (-1, -1)
    assert traffic.tokens_of((), given, text_only=True) == (21, 21)


@pytest.mark.parametrize(
    "moves, weights, bound, held, expected",
    [
        # 2 ranks: the weights make 1 hop, the tokens 2, each also costing HOP_BYTES (256 KB) of latency
        ("auto", 2_000_000, 4, 800, True),  # 2 x (256 KB + 400 B) against 256 KB + 2 MB
        ("auto", 2_000_000, 10_000, 800, False),  # 2 x (256 KB + 1 MB): more than the weights' hop
        ("auto", 100_000, 4, 800, False),  # small weights: one hop of them is quicker than two of tokens
        ("auto", 2_000_000, 4, 1200, False),  # fewer bytes, but more than a weight slot holds: no memory of their own
        ("activations", 100, 100, 800, True),
        ("activations", 100, 100, 1200, False),
        ("weights", 2_000_000, 1, 8, False),
    ],
)
def test_an_op_moves_tokens_when_they_cost_less_and_fit_the_weight_slots(moves, weights, bound, held, expected):
    assert Traffic(bound, 1, moves, False).moves_tokens(bound, weights, 100, held, 1000, 2) is expected


def test_a_weights_slot_is_reckoned_in_the_dtype_that_fills_it():
    """A slot holds the largest planned piece in what it travels in (distributed/transport/pool.py). Reckoned in a wider
    dtype (a float32 lookup under bf16 autocast, TRL's float32 hidden states beside a bf16 head) it would seem
    twice as big, and a token message that fit that reckoning would regrow both slots for good."""
    from hf_rtp.layers.fused_loss import _tokens_fit

    ring = Ring(None)
    ring.pool.plan(1000, torch.zeros(1, dtype=torch.bfloat16))
    assert ring.slot_bytes(torch.zeros(1)) == 4000
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ring.slot_bytes(torch.zeros(1)) == 2000
    head = torch.zeros(10, 8, dtype=torch.bfloat16)
    # the head's backward per token: 2 x 8 float32 + 16 bytes, 8 more, room for 3 hops: 264 bytes, and 64
    assert _tokens_fit(ring, torch.zeros(7, 8), head, 7)  # 1912 bytes <= 2000
    assert not _tokens_fit(ring, torch.zeros(8, 8), head, 8)  # 2176 bytes: more than 2000, though under 4000
