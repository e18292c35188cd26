"""Context parallelism: one sequence across the ring, against vanilla transformers on the whole sequence.

Every rank gets the same batch and `hf_rtp.context_parallel(model, batch)` cuts it (chunks r and 2N-1-r
of 2N). The loss must be vanilla's over the whole sequence on every rank, every gradient vanilla's, and
an AdamW step vanilla's, in float64, at 2 and 3 ranks, with sequence lengths that are not multiples of 2N
(uneven chunks) and label masks (a prompt) so the count of label tokens differs between ranks.
"""

from __future__ import annotations

import pytest
import torch
from support.compare import GRAD_ATOL, GRAD_RTOL, STEP_ATOL, adamw, assert_matches
from support.models import VOCAB, make_tiny
from support.spawn import run_on_ranks


def _batch(seq: int, batch: int = 2, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt: its tokens carry no loss
    labels[1, -2:] = -100
    return {"input_ids": ids, "labels": labels}


def _against_vanilla(ckpt, seq, checkpointing, lora=False, piece="16MB"):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp

    model = hf_rtp.from_pretrained(
        ckpt, dtype=torch.float64, attn_implementation="sdpa", rotation_piece_size=piece
    ).train()
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa").train()
    if checkpointing:
        model.gradient_checkpointing_enable()
        ref.gradient_checkpointing_enable()
    if lora:
        from peft import LoraConfig, get_peft_model

        adapters = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
        model, ref = get_peft_model(model, adapters), get_peft_model(ref, adapters)
    optimizers = adamw(model, ref)
    batch = _batch(seq)
    given = {k: v.clone() for k, v in batch.items()}
    with hf_rtp.context_parallel(model, batch):
        assert batch["input_ids"].shape[1] < seq  # this rank's chunks, inside the block
        loss = model(**batch).loss
        loss.backward()
    assert all(torch.equal(batch[k], given[k]) for k in given) and set(batch) == set(given)  # put back
    ref_loss = ref(**given).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-7, rtol=1e-6)  # the fused loss sums in float32
    hf_rtp.sync_grads(model)
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)
    return loss.item()


@pytest.mark.parametrize(
    "world,seq,checkpointing,piece",
    [(2, 11, False, "16MB"), (3, 13, True, "16MB"), (2, 4, True, "16MB"), (3, 17, False, "1KB")],
    ids=["2ranks-11tokens", "3ranks-13tokens-checkpointing", "2ranks-one-token-per-chunk", "3ranks-kv-in-pieces"],
)
def test_one_sequence_across_the_ring_is_vanillas(tmp_path, world, seq, checkpointing, piece):
    """GQA (2 K/V heads for 4 query heads) and linear RoPE scaling on global positions. With 1 KB pieces the
    K/V blocks walk the ring two tokens at a time, so a block's keys start inside a chunk of queries."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ckpt = make_tiny("llama", tmp_path / "ckpt", rope_parameters=rope)
    losses = run_on_ranks(_against_vanilla, world, ckpt, seq, checkpointing, False, piece)
    assert len(set(losses)) == 1  # every rank reports the sequence's loss
