"""The fused LM-head loss on CUDA against vanilla transformers' loss on the same GPU, at two ranks on cuda:0.

On CUDA a tile of the fused loss holds up to 256 MiB of logits (layers/fused_loss.py), so a tiny model's loss is
one tile; here the tile is cut to 3 tokens x 3 rows and the head travels in pieces of 1 KB, so the running
log-sum-exp crosses tiles, pieces and chunks as it does at a real vocabulary. Each rank trains its own batch with
a masked prompt and Trainer's `num_items_in_batch`, in float32: loss and every gradient within float32 rounding of
vanilla's (cuBLAS orders a tile's sums otherwise than one matmul over the whole head; 1e-4 of the largest entry),
and a forward at the default tile gives the same loss.
"""

from __future__ import annotations

import pytest
import torch
from gpu_world import NO_CUDA, join_world
from support.compare import grad_gaps_rows
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def _labels(batch):
    labels = batch.clone()
    labels[:, :3] = -100  # a prompt
    return labels


def _fused_beside_vanilla(ckpt):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.layers import fused_loss

    device = join_world()
    default_tile = fused_loss.block_bytes(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, device=device, rotation_piece_size="1KB").train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).train()
    batches = global_batch(world, batch=2, seq=9).to(device)
    labels = [_labels(b) for b in batches]
    count = sum(int((lab[:, 1:] != -100).sum()) for lab in labels)  # Trainer's count over every rank's batch
    count = torch.tensor(count, device=device)

    with torch.no_grad():  # the default tile: the whole of a tiny model's logits at once
        whole = model(input_ids=batches[rank], labels=labels[rank], num_items_in_batch=count).loss.item()
    fused_loss.ACCELERATOR_BLOCK_BYTES = 4 * 3 * 3  # float32 tiles of 3 tokens x 3 rows
    out = model(input_ids=batches[rank], labels=labels[rank], num_items_in_batch=count)
    pairs = zip(batches, labels, strict=True)
    ref_losses = [ref(input_ids=b, labels=lab, num_items_in_batch=count).loss for b, lab in pairs]
    out.loss.backward()
    hf_rtp.sync_grads(model)
    torch.stack(ref_losses).mean().backward()

    gaps = grad_gaps_rows(model, ref, world, rank)
    return default_tile, out.logits is None, whole, out.loss.item(), ref_losses[rank].item(), gaps


def test_the_fused_loss_on_cuda_in_small_tiles_matches_vanillas_loss_and_gradients(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt", tied=True)
    results = run_on_ranks(_fused_beside_vanilla, 2, ckpt, fresh=True)
    for rank, (default_tile, no_logits, whole, loss, ref_loss, gaps) in enumerate(results):
        assert default_tile == 256 * 2**20, default_tile  # CUDA's tile, not the CPU's 16 MiB
        assert no_logits  # the fused loss kept no [tokens, vocab] logits
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and abs(whole - loss) <= 1e-5 * abs(loss), (rank, loss)
        assert len(gaps) >= 10
        for name, (gap, scale) in gaps.items():
            assert scale > 0 and gap <= 1e-4 * scale, (rank, name, gap, scale)
