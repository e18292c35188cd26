"""dtype follows transformers: "auto" takes config.json's, an explicit one converts on load; saves record it."""

import json
import os
from pathlib import Path

import torch
from support.models import global_batch, make_tiny_llama
from support.spawn import run_on_ranks


def _bf16_round_trip(ckpt, out):
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    auto = hf_rtp.from_pretrained(ckpt)
    assert {p.dtype for p in auto.parameters()} == {torch.float32}  # config.json says float32
    model = hf_rtp.from_pretrained(ckpt, dtype="bfloat16").train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).train()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    batch = global_batch(2)[rank]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=batch).logits, ref(input_ids=batch).logits, atol=2e-2, rtol=2e-2)
    out_ = model(input_ids=batch, labels=batch)  # the fused loss, from bf16 logits as vanilla's
    torch.testing.assert_close(out_.loss, ref(input_ids=batch, labels=batch).loss, atol=2e-2, rtol=2e-2)
    out_.loss.backward()
    hf_rtp.sync_grads(model)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    model.save_pretrained(out)
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.state_dict().items()}
    if rank == 0:
        assert json.loads(Path(os.path.join(out, "config.json")).read_text())["dtype"] == "bfloat16"
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        assert all(torch.equal(t, full[n]) and t.dtype == torch.bfloat16 for n, t in reloaded.state_dict().items())


def test_bfloat16_load_train_save(tmp_path):
    run_on_ranks(_bf16_round_trip, 2, make_tiny_llama(tmp_path / "ckpt"), str(tmp_path / "out"))


def _autocast_matches_vanilla(checkpoints):
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.distributed.tensors.sharding import chunk_rows

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = global_batch(world)
    for ckpt in checkpoints:
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
        ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=batches[rank], labels=batches[rank])
            ref_losses = [ref(input_ids=b, labels=b).loss for b in batches]
        assert out.logits is None  # the fused loss, under autocast
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(input_ids=batches[rank]).logits.dtype == torch.bfloat16  # as vanilla's under autocast
        torch.testing.assert_close(out.loss, ref_losses[rank], atol=2e-3, rtol=1e-3)
        out.loss.backward()
        hf_rtp.sync_grads(model)
        torch.stack(ref_losses).mean().backward()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            mine, theirs = p.grad, ref_params[name].grad
            if isinstance(p, DTensor):
                mine, theirs = mine.to_local(), theirs[slice(*chunk_rows(p.shape[0], world, rank))]
            assert mine.dtype == torch.float32, name  # grads land in the parameter's dtype
            if theirs.norm() > 0:
                cosine = torch.nn.functional.cosine_similarity(mine.flatten(), theirs.flatten(), dim=0)
                assert cosine > 0.99 and abs(mine.norm() / theirs.norm() - 1) < 0.05, (ckpt, name, cosine)


def test_bf16_autocast_matches_vanilla_autocast(tmp_path):
    from support.models import make_tiny

    checkpoints = [make_tiny(arch, tmp_path / arch) for arch in ("llama", "gpt2", "mixtral")]
    run_on_ranks(_autocast_matches_vanilla, 2, checkpoints)
