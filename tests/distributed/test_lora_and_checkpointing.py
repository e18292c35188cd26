"""LoRA on a rotated base, and gradient checkpointing through rotated layers, against vanilla."""

import os

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)


def _lora_step(ckpt, adapters, rtp_size):
    from peft import LoraConfig, PeftModel, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    base = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, rtp_size=rtp_size).train()
    rotated = get_peft_model(base, LoraConfig(**LORA))
    torch.manual_seed(0)
    ref = get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).train(), LoraConfig(**LORA))
    base_before = {n: p.detach().clone() for n, p in rotated.named_parameters() if not p.requires_grad}
    hf_rtp.ignore_rotated_in_ddp(rotated)
    ddp = DDP(rotated)
    batches = global_batch(world)
    ddp(input_ids=batches[rank], labels=batches[rank]).loss.backward()
    torch.stack([ref(input_ids=b, labels=b).loss for b in batches]).mean().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in rotated.named_parameters():
        if p.requires_grad:  # adapters: replicated, averaged by DDP
            assert "lora_" in name
            torch.testing.assert_close(
                p.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )
        else:  # the frozen rotated base sent no gradient accumulators around the ring
            assert p.grad is None, name
    torch.optim.AdamW([p for p in rotated.parameters() if p.requires_grad], lr=1e-2).step()
    for name, p in rotated.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.detach(), base_before[name]), name
    if rank == 0:
        rotated.save_pretrained(adapters)  # adapters are replicated: no collective needed
    torch.distributed.barrier()
    probe = global_batch(1, seed=7)[0]
    rotated.eval()
    with torch.no_grad():
        logits = rotated(input_ids=probe).logits  # collective: every rank runs it
    if rank == 0:
        vanilla = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), adapters)
        with torch.no_grad():
            torch.testing.assert_close(vanilla.eval()(input_ids=probe).logits, logits, atol=1e-9, rtol=1e-9)
        return sorted(os.listdir(adapters))


# one flat ring of 2, and 4 ranks as 2 rings of 2 (adapters averaged over all 4, the frozen base silent)
@pytest.mark.parametrize("world,rtp_size", [(2, None), (4, 2)], ids=["flat-2", "2x2"])
def test_lora_on_rotated_base_matches_vanilla_peft(tmp_path, world, rtp_size):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    files = run_on_ranks(_lora_step, world, ckpt, str(tmp_path / "adapters"), rtp_size)[0]
    assert files == ["README.md", "adapter_config.json", "adapter_model.safetensors"]


def _checkpointing(ckpt):
    from torch.distributed.tensor import DTensor

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = global_batch(world)[rank]
    grads, saved_bytes = [], []
    for checkpointing in (False, True):
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        hf_rtp.sync_grads(model)
        local = lambda g: g.to_local() if isinstance(g, DTensor) else g  # noqa: E731
        grads.append({n: local(p.grad) for n, p in model.named_parameters()})
        saved_bytes.append(total[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-12, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
    return saved_bytes


def test_gradient_checkpointing_same_grads_less_activation_memory(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt", num_hidden_layers=4)
    for plain, checkpointed in run_on_ranks(_checkpointing, 2, ckpt):
        assert checkpointed < 0.5 * plain, (plain, checkpointed)
