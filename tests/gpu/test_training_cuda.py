"""A training step of a rotated model on CUDA equals vanilla transformers' on the same GPU, under DDP's semantics,
at three ranks on one GPU in a gloo world (uneven chunks).

Every rank on cuda:0 (gpu_world.py says why and how they share it), each on its own batch; in the same process
vanilla runs every rank's batch and takes the mean of their losses (DDP's objective). Compared: the loss (through
the fused LM-head loss, hf_rtp's default in training), every gradient (this rank's rows of rotated ones), then one
AdamW step of each model from its own gradients.

What equality holds: cuBLAS picks its kernels by shape, and a rotated matmul runs on a chunk's rows where vanilla's
runs on the whole weight, so the sums are ordered differently. In float32 (TF32 off, torch's default for matmuls)
that is float32 rounding: 1e-4 of a gradient's largest entry. AdamW's first step is lr * g / (|g| + eps) per entry,
so gradients `gap` apart move a parameter at most lr * min(2, gap / eps) apart: each parameter's step is held to
that bound from its own measured gradient gap (an optimizer stepping other rows, or stale gradients, is off by up to
2 lr where the bound allows a fraction of it). Nothing is copied from vanilla into the model before a comparison.

Two ranks (float32, bf16 autocast, and much more: launched by torchrun, 20 steps) are tests/gpu/users_loop.py's, which
.ci/gpu runs; this file runs with `pytest -m gpu tests/gpu`, not in .ci/gpu's 8 minutes (a layout no user runs).
"""

from __future__ import annotations

import pytest
import torch
from gpu_world import GLOO_WORLD, NO_CUDA, join_world
from support.compare import ADAM_EPS, LR, rows
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
    pytest.mark.timeout(100),  # three fresh ranks of a gloo world: more than .ci/gpu's --timeout 60
]

TOLERANCE = {False: 1e-4, True: 3e-2}  # of the largest entry: float32, bf16 autocast
SLACK = 1e-6  # a float32 parameter near 1 rounds by ~1e-7 in the step


def _steps_beside_vanilla(ckpt, autocasts, backend=None):
    """_step_beside_vanilla for each of `autocasts`, in one start of the ranks (each start costs about 15 s)."""
    device = join_world(backend)
    return [_step_beside_vanilla(ckpt, autocast, device) for autocast in autocasts]


def _step_beside_vanilla(ckpt, autocast, device):
    """One step of hf_rtp on this rank's batch and of vanilla on all of them, on cuda:0, each from its own
    gradients: the losses, each parameter's gradient gap and scale, and each parameter's gap after AdamW."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = dist.get_rank(), dist.get_world_size()
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, device=device).train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device).train()
    batches = global_batch(world).to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=batches[rank], labels=batches[rank]).loss
        ref_losses = [ref(input_ids=b, labels=b).loss for b in batches]
    loss.backward()
    hf_rtp.sync_grads(model)
    torch.stack(ref_losses).mean().backward()

    def mine_and_vanillas(name, p, of):
        """(this rank's tensor, vanilla's rows of it): of="grad" or "param"."""
        mine, theirs = (p.grad, vanilla[name].grad) if of == "grad" else (p, vanilla[name])
        if isinstance(p, DTensor):
            mine, theirs = mine.to_local(), theirs[rows(p, world, rank)]
        return mine.detach(), theirs.detach()

    vanilla = dict(ref.named_parameters())
    gaps = {}
    for name, p in model.named_parameters():
        mine, want = mine_and_vanillas(name, p, "grad")
        gaps[name] = ((mine - want).abs().max().item(), want.abs().max().item())
    for m in (model, ref):  # each from its own gradients
        torch.optim.AdamW(m.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1).step()
    step_gaps, places = {}, set()
    for name, p in model.named_parameters():
        mine, want = mine_and_vanillas(name, p, "param")
        step_gaps[name] = (mine - want).abs().max().item()
        places.add(str(mine.device))
    rotated = sum(isinstance(p, DTensor) for p in model.parameters())
    return loss.item(), ref_losses[rank].item(), gaps, step_gaps, sorted(places), rotated


def _assert_like_vanilla(results, autocast):
    tolerance = TOLERANCE[autocast]
    for rank, (loss, ref_loss, gaps, step_gaps, places, rotated) in enumerate(results):
        assert places == ["cuda:0"] and rotated > 0, (rank, places, rotated)
        assert abs(loss - ref_loss) <= tolerance * abs(ref_loss), (rank, loss, ref_loss)
        for name, (gap, scale) in gaps.items():
            assert scale > 0 and gap <= tolerance * scale, (rank, name, gap, scale)
            bound = LR * min(2.0, gap / ADAM_EPS) + SLACK  # AdamW's first step, from gradients `gap` apart
            assert step_gaps[name] <= bound, (rank, name, step_gaps[name], bound)
    assert len({loss for loss, *_ in results}) == len(results)  # each rank trained on its own batch


def test_uneven_chunks_at_three_ranks_on_one_gpu(tmp_path):
    """A prime vocabulary (101) and widths 3 does not divide: chunks of unequal rows. Three ranks on one GPU run in
    the gloo world, whose ring stages each message through host memory: NCCL's multi-rank mode allows two ranks per
    GPU with its defaults (NCCL's env.rst, NCCL_MULTI_RANK_GPU_ENABLE; more need NCCL_MAX_CTAS lowered, and may hang
    when the GPU runs short)."""
    ckpt = make_tiny("llama", tmp_path / "ckpt", tied=True)
    results = run_on_ranks(_steps_beside_vanilla, 3, ckpt, [False], GLOO_WORLD, fresh=True)
    _assert_like_vanilla([by_rank[0] for by_rank in results], False)
