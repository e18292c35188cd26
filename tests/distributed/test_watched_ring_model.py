"""A watched ring (NCCL's: a header on every hop, a watch on the hops in flight) over gloo, under a whole model:
every hop is one message, its header inside it, and the results are the plain ring's bit for bit.

The ring a GPU user's model walks is watched; CI has no GPU, so the same ring is watched here over gloo, where it
posts the same messages one by one. A rotated Llama's training step (forward with labels, backward) and a greedy
decode, with its weights moving and with its tokens moving (the token walks' messages, their accumulators, the
outputs-only walks of q/k/v and gate/up, the embedding's visit walk in backward), at 2 and 3 ranks and with
ranks bringing different numbers of tokens: the loss, the logits, every gradient and the generated tokens equal
the unwatched ring's, and the ring posted one send and one receive per hop, no more.
"""

from __future__ import annotations

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks


def _watch(ring) -> None:
    """The ring watched from now, as topology.py makes an NCCL ring (a test's gloo ring is neither aborted nor
    ended by its watch)."""
    from hf_rtp.distributed.transport.watch import Watch

    ring._watch = Watch(60.0, device=ring.device)
    ring._plain = False


def _step_and_decode(ckpt: str):
    import torch.distributed as dist

    import hf_rtp

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batch(world, batch=1 + rank % 2, seq=5 + 2 * rank, seed=3)[rank]  # each rank its own shape
    out = {}
    # under bf16 autocast over float32 weights the weights travel in bf16: a watched walk casts its own piece into
    # the pool's slot, where the plain one casts it into a tensor of its own
    for case in ("weights", "activations", "weights-autocast"):
        moves, autocast = case.removesuffix("-autocast"), case.endswith("-autocast")
        dtype = torch.float32 if autocast else torch.float64
        model = hf_rtp.from_pretrained(ckpt, dtype=dtype, rotation_moves=moves, fused_loss=True).train()
        ring = hf_rtp.state_of(model).topology.ring
        runs = []
        for watched in (False, True):
            if watched:
                _watch(ring)
            model.zero_grad(set_to_none=True)
            before = (ring.exchanges, ring.messages, ring.token_walks)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if hasattr(p.grad, "full_tensor")}
            grads |= {n: p.grad for n, p in model.named_parameters() if not hasattr(p.grad, "full_tensor")}
            model.eval()
            with torch.no_grad():
                tokens = model.generate(batch, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
            model.train()
            runs.append(
                {
                    "loss": loss.item(),
                    "grads": grads,
                    "tokens": tokens,
                    "exchanges": ring.exchanges - before[0],
                    "messages": ring.messages - before[1],
                    "token_walks": ring.token_walks - before[2],
                }
            )
        ring._watch.check()  # no header differed on walks that matched
        plain, watched = runs
        assert watched["loss"] == plain["loss"], (case, rank)
        assert torch.equal(watched["tokens"], plain["tokens"]), (case, rank)
        for name, grad in plain["grads"].items():
            assert torch.equal(watched["grads"][name], grad), (case, rank, name)
        out[case] = {k: plain[k] for k in ("exchanges", "messages", "token_walks")} | {
            "watched": {k: watched[k] for k in ("exchanges", "messages", "token_walks")}
        }
        del model
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_watched_ring_sends_one_message_a_hop_and_gives_the_plain_rings_results(tmp_path, world):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for rank, result in enumerate(run_on_ranks(_step_and_decode, world, ckpt)):
        for moves, counts in result.items():
            watched = counts["watched"]
            assert watched["exchanges"] == counts["exchanges"] > 0, (rank, moves, counts)
            assert watched["token_walks"] == counts["token_walks"], (rank, moves, counts)
            assert watched["messages"] == 2 * watched["exchanges"], (rank, moves, counts)  # a send and a receive a hop
        assert result["activations"]["token_walks"] > 0 and result["weights"]["token_walks"] == 0, (rank, result)
        # the plain ring posts a message per tensor: a linear's weight and bias, a token message's parts are apart
        assert result["weights"]["messages"] >= 2 * result["weights"]["exchanges"], (rank, result)
