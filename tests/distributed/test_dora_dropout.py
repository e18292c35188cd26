"""PEFT's DoRA as users configure it, with lora_dropout > 0: PEFT then recomputes the base layer's output on
the dropped-out input (`F.linear(x, base_layer.weight)`), which on a rotated weight leaked a DTensor into the
hidden states. Against vanilla PEFT under DDP in the same processes, in float64, with each rank's dropout
masks drawn from the same generator state: the loss and every trainable gradient, at 2 and 3 ranks."""

import os

import pytest
import torch
from support.compare import GRAD_ATOL, GRAD_RTOL, trainable_grad_gaps
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks


def _config():
    from peft import LoraConfig

    return LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        use_dora=True,
        init_lora_weights=False,  # random B too, so every adapter gets a gradient
        target_modules=["q_proj", "v_proj", "down_proj"],
    )


def _dora_with_dropout(ckpt, plan):
    from peft import get_peft_model
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = get_peft_model(hf_rtp.from_pretrained(ckpt, dtype=torch.float64, plan=plan), _config()).train()
    torch.manual_seed(0)
    vanilla = get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), _config()).train()
    ddp = DistributedDataParallel(vanilla)
    batch = global_batch(world, seq=12)[rank]
    losses = []
    for m in (model, ddp):
        torch.manual_seed(10 + rank)  # this rank's dropout masks, the same for both
        loss = m(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.item())
    hf_rtp.sync_grads(model)
    grads = trainable_grad_gaps(model, vanilla)
    return losses, grads


@pytest.mark.parametrize(("arch", "world"), [("llama", 2), ("llama", 3), ("qwen2", 2)])  # qwen2: q/v with biases
def test_dora_with_dropout_equals_vanilla_peft_under_ddp(tmp_path, arch, world):
    ckpt = make_tiny(arch, tmp_path / "ckpt")
    plan = "auto" if arch == "qwen2" else None  # make_tiny's qwen2 is loaded with plan="auto" (support/models.py)
    for rank, (losses, grads) in enumerate(run_on_ranks(_dora_with_dropout, world, ckpt, plan)):
        assert abs(losses[0] - losses[1]) < 1e-6, (rank, losses)
        assert any("lora_magnitude_vector" in n for n in grads) and any("lora_A" in n for n in grads)
        # float64 model; hf_rtp's fused loss is a float32 island (support/compare.py)
        for name, (difference, scale) in grads.items():
            assert scale > 0 and difference <= GRAD_ATOL + GRAD_RTOL * scale, (rank, name, difference, scale)
