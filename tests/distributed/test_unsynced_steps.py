"""An optimizer step over replicated gradients that nothing averaged is refused by name, on every rank.

A plain loop at 2 ranks that forgets `hf_rtp.sync_grads(model)` would step each rank's norms (and LoRA adapters)
on its own batch alone, and the ranks' copies would drift apart silently. In one run of 2 ranks, float64, beside
vanilla transformers on the global batch (DDP's objective) in the same processes:
- no sync_grads: `UnsyncedGradientsError` at `optimizer.step()`, naming the model, the count and what to call,
  and no weight (rotated or replicated) or optimizer state has changed;
- then sync_grads (clipping after it, as users do): the step equals vanilla's, and the ranks' replicated weights
  are identical;
- a model wrapped in DDP steps without sync_grads, equal to the synced one;
- gradients that no backward made (set by hand, as torch.distributed.checkpoint sets zeros) are not checked;
- two micro-batches accumulated, then sync_grads: steps; a backward after sync_grads: refused again;
- a PEFT LoRA model on the rotated model (adapters added after load): refused without sync_grads, steps with it.
"""

import os

import pytest
import torch
from support.compare import ADAM_EPS, LR, STEP_ATOL, assert_matches
from support.models import global_batch, make_tiny_llama
from support.spawn import run_on_ranks

DTYPE = torch.float64


def _local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _snapshot(model):
    return {n: _local(p) for n, p in model.named_parameters()}


def _refused(optimizer, model) -> str:
    """optimizer.step() is refused, and neither the weights nor the optimizer's state moved."""
    import hf_rtp

    before = _snapshot(model)
    with pytest.raises(hf_rtp.UnsyncedGradientsError) as raised:
        optimizer.step()
    assert isinstance(raised.value, hf_rtp.CollectiveMisuseError)
    assert all(torch.equal(_local(p), before[n]) for n, p in model.named_parameters())
    assert not optimizer.state
    return str(raised.value)


def _adamw(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=ADAM_EPS)


def _loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def _cases(ckpt):
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batches = global_batch(world)
    batch = batches[rank]
    messages = {}

    # (a) a plain loop without sync_grads, then (b) with it, beside vanilla on the global batch
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE).train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE).train()
    optimizer, ref_optimizer = _adamw(model), _adamw(ref)
    _loss(model, batch).backward()
    messages["plain"] = _refused(optimizer, model)
    hf_rtp.sync_grads(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # in place, after the sync: still averaged
    optimizer.step()
    torch.stack([_loss(ref, b) for b in batches]).mean().backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_optimizer.step()
    assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)
    norm = model.model.norm.weight.tolist()

    # (c) DDP around the model averages the replicated gradients: no sync_grads, the same step
    wrapped = DDP(hf_rtp.from_pretrained(ckpt, dtype=DTYPE).train())
    ddp_optimizer = _adamw(wrapped)
    _loss(wrapped, batch).backward()
    torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0)
    ddp_optimizer.step()
    assert_matches(wrapped.module, ref, world, rank, "param", atol=STEP_ATOL)

    # gradients no backward made (set by hand, as torch.distributed.checkpoint does to make optimizer state)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()

    # (d) accumulation: two micro-batches, then sync_grads, steps; a backward after sync_grads is refused
    optimizer.zero_grad()
    for half in batch.chunk(2):
        (_loss(model, half) / 2).backward()
    hf_rtp.sync_grads(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # zeroed in place: the same gradient tensors
    _loss(model, batch).backward()
    hf_rtp.sync_grads(model)
    _loss(model, batch).backward()
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    before = _snapshot(model)
    with pytest.raises(hf_rtp.UnsyncedGradientsError) as raised:
        optimizer.step()
    messages["after sync"] = str(raised.value)
    assert all(torch.equal(_local(p), before[n]) for n, p in model.named_parameters())
    assert all(all(torch.equal(v, state[p][k]) for k, v in s.items()) for p, s in optimizer.state.items())
    hf_rtp.sync_grads(model)
    optimizer.step()

    # (e) LoRA adapters PEFT adds after load are replicated too
    torch.manual_seed(0)
    base = hf_rtp.from_pretrained(ckpt, dtype=DTYPE).train()
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora_optimizer = _adamw(lora)
    _loss(lora, batch).backward()
    messages["lora"] = _refused(lora_optimizer, lora)
    hf_rtp.sync_grads(lora)
    lora_optimizer.step()
    adapters = {n: p.tolist() for n, p in lora.named_parameters() if p.requires_grad}
    return messages, norm, adapters  # plain lists cross the result queue


def test_a_step_over_unaveraged_replicated_gradients_is_refused_on_every_rank(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    results = run_on_ranks(_cases, 2, ckpt)
    for messages, _, _ in results:  # every rank refused, each by name
        plain, after_sync, lora = messages["plain"], messages["after sync"], messages["lora"]
        # 2 layers x 2 norms + the final norm
        assert plain.startswith("AdamW.step(): 5 replicated parameter(s) of the rotated LlamaForCausalLM loaded from")
        assert "model.layers.0.input_layernorm.weight" in plain
        for message in (plain, after_sync, lora):
            assert "never averaged over the 2 ranks" in message
            assert "hf_rtp.sync_grads(model)" in message and "DistributedDataParallel" in message
            assert "accelerator.prepare(model)" in message
        assert after_sync.startswith("AdamW.step(): 5 replicated parameter(s)")
        # 2 layers x (q_proj, v_proj) x (lora_A, lora_B)
        assert lora.startswith("AdamW.step(): 8 replicated parameter(s) of the rotated LlamaForCausalLM")
        assert ".lora_A.default.weight" in lora
    (_, norm0, adapters0), (_, norm1, adapters1) = results
    assert norm0 == norm1  # the ranks' replicated copies stayed one, bit for bit
    assert adapters0 == adapters1 and len(adapters0) == 8
