"""The fused LM-head loss across ranks, loaded with from_pretrained as users do, against vanilla (DDP).

Each rank trains its own batch with a masked prompt and Trainer's `num_items_in_batch`; the head
travels in many small pieces (rotation_piece_size) and tokens in blocks of 3, so the running
log-sum-exp crosses pieces, chunks and blocks. Loss, logits on request, every gradient and what the
users' other paths get (logits without labels, fused_loss=False) are compared with vanilla on the
global batch, in float64. Bad labels on every rank fail there at once, and the ring still works after.
"""

from __future__ import annotations

import pytest
import torch
from support.compare import GRAD_ATOL, GRAD_RTOL, assert_matches
from support.models import VOCAB, global_batch, make_tiny
from support.spawn import run_on_ranks


def _labels(batch):
    labels = batch.clone()
    labels[:, :3] = -100
    return labels


def _fused_against_vanilla(ckpt):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.layers import fused_loss

    fused_loss.BLOCK_BYTES = 4 * 3 * 3  # pieces of 3 rows (1 KB of float64 rows of 32): 3 tokens per block
    world = 2
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rotation_piece_size="1KB").train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).train()
    rank = dist.get_rank()
    batches = global_batch(world, batch=2, seq=9)
    count = torch.tensor(sum(int((_labels(b)[:, 1:] != -100).sum()) for b in batches))  # Trainer's global count

    out = model(input_ids=batches[rank], labels=_labels(batches[rank]), num_items_in_batch=count)
    ref_losses = [ref(input_ids=b, labels=_labels(b), num_items_in_batch=count).loss for b in batches]
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_losses[rank], atol=1e-6, rtol=1e-6)
    out.loss.backward()
    hf_rtp.sync_grads(model)
    torch.stack(ref_losses).mean().backward()  # DDP's mean over ranks
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL)

    with torch.no_grad():
        expected = ref(input_ids=batches[rank], labels=batches[rank])
        for kwargs in (dict(labels=batches[rank], return_logits=True), {}):
            got = model(input_ids=batches[rank], **kwargs)
            torch.testing.assert_close(got.logits, expected.logits, atol=1e-8, rtol=1e-6)

    bad = batches[rank].clone()
    bad[0, 4] = VOCAB + 7  # every rank's batch is bad: every rank fails, before the ring
    with pytest.raises(RuntimeError, match="labels must be -100 or lie in"):
        model(input_ids=batches[rank], labels=bad)
    with torch.no_grad():  # nothing half-walked: the next forward meets its neighbours as usual
        again = model(input_ids=batches[rank], labels=batches[rank]).loss
    torch.testing.assert_close(again, expected.loss, atol=1e-6, rtol=1e-6)

    # a rank whose batch is all prompt (every label ignored) still walks the ring with the others, and
    # contributes nothing: the gradient is DDP's with that rank's loss 0 under Trainer's global count
    model.zero_grad(), ref.zero_grad()
    prompts_only = [_labels(batches[0]), torch.full_like(batches[1], -100)]
    count = (prompts_only[0][:, 1:] != -100).sum()
    out = model(input_ids=batches[rank], labels=prompts_only[rank], num_items_in_batch=count)
    out.loss.backward()
    hf_rtp.sync_grads(model)
    ref_losses = [
        ref(input_ids=b, labels=lab, num_items_in_batch=count).loss
        for b, lab in zip(batches, prompts_only, strict=True)
    ]
    torch.testing.assert_close(out.loss, ref_losses[rank], atol=1e-6, rtol=1e-6)
    torch.stack(ref_losses).mean().backward()
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL)

    plain = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, fused_loss=False).train()
    with torch.no_grad():
        unfused = plain(input_ids=batches[rank], labels=batches[rank])
    torch.testing.assert_close(unfused.logits, expected.logits, atol=1e-8, rtol=1e-6)
    return float(out.loss)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_loss_matches_vanilla_ddp_across_ranks(tmp_path, tied):
    ckpt = make_tiny("llama", tmp_path / "ckpt", tied=tied)
    losses = run_on_ranks(_fused_against_vanilla, 2, ckpt)
    assert losses[0] != losses[1]  # each rank trained on its own batch
