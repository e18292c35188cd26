"""Where users' code reaches a rotated model around hf_rtp's API: each path equals vanilla DDP, or is refused by name
on every rank before anything steps.

One run of 2 ranks and one of 3, float64 (fused_loss=False: hf_rtp's fused loss computes in float32), beside vanilla
transformers, PEFT and DDP in the same processes:
- `optimizer.step(closure)`: a closure without sync_grads is refused after it ran, nothing stepped; with
  sync_grads inside (two micro-batches accumulated) the SGD step equals vanilla DDP's; LBFGS is refused by name;
- PEFT prompt tuning (its prompt encoder lives outside the rotated model): a plain loop without sync_grads is
  refused; with it, and under DDP(peft_model), the prompt's gradient and step equal vanilla DDP's;
- DDP around a user's wrapper that holds the model under a name of its own: rotated parameters ignored, the
  wrapper's own head averaged, equal to vanilla DDP around the same wrapper;
- a head some ranks' batches never reach: sync_grads averages with zeros, as DDP(find_unused_parameters=True);
- adapters made under a different seed on each rank (`set_seed(seed, device_specific=True)`): rank 0's on every
  rank from the first forward, as DDP makes them, and the step equals vanilla DDP's; a replicated weight changed
  on one rank after that is refused by name at sync_grads;
- in-place edits of rotated weights: transformers' new-token recipe after resize_token_embeddings
  (`emb.weight.data[-k:] = emb.weight.data[:-k].mean(0)`), row and index assignment under no_grad, equal vanilla;
  an in-place op on gathered rows (`w.data[:5].zero_()`) is refused by name.
"""

import os

import pytest
import torch
from support.models import global_batch, make_tiny_llama
from support.spawn import run_on_ranks

DTYPE = torch.float64
LR = 1e-2


def _local(p):
    if hasattr(p, "to_local"):
        return p.to_local().detach()
    return p.detach()


def _rows(p, ref):
    """vanilla's `ref` cut to this rank's rows of rotated `p`."""
    from hf_rtp.distributed.tensors.rotated import local_rows

    start, end = local_rows(p)
    return ref.detach()[start:end] if hasattr(p, "to_local") else ref.detach()


def _same(model, ref, what="param", atol=1e-10):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mine = p if what == "param" else p.grad
        theirs = ref_params[name] if what == "param" else ref_params[name].grad
        assert (mine is None) == (theirs is None), f"{what} of {name}"
        if mine is not None:
            torch.testing.assert_close(_local(mine), _rows(p, theirs), atol=atol, rtol=1e-7, msg=f"{what} of {name}")


def _closures(ckpt, batch, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False).train()
    ref = DDP(AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE).train())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)

    def forgetful():
        optimizer.zero_grad()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        return loss

    before = {n: _local(p).clone() for n, p in model.named_parameters()}
    with pytest.raises(hf_rtp.UnsyncedGradientsError, match=r"SGD.step\(\): 5 replicated parameter"):
        optimizer.step(forgetful)
    assert all(torch.equal(_local(p), before[n]) for n, p in model.named_parameters())

    def accumulating(m, opt, sync):  # two micro-batches, then one average
        def closure():
            opt.zero_grad()
            for half in batch.chunk(2):
                (m(input_ids=half, labels=half).loss / 2).backward()
            if sync:
                hf_rtp.sync_grads(m)
            return torch.zeros(())

        return closure

    optimizer.step(accumulating(model, optimizer, True))
    ref_optimizer.step(accumulating(ref, ref_optimizer, False))
    _same(model, ref.module)

    with pytest.raises(hf_rtp.RotatedStateError, match="LBFGS over a rotated model's parameters"):
        torch.optim.LBFGS(model.parameters()).step(accumulating(model, optimizer, True))


def _prompt_tuning(ckpt, batch, rank):
    from peft import PromptTuningConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import hf_rtp

    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    torch.manual_seed(0)
    plain = get_peft_model(hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False).train(), config)
    torch.manual_seed(0)
    wrapped = DDP(get_peft_model(hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False).train(), config))
    torch.manual_seed(0)
    ref = DDP(get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE).train(), config))
    models = (plain, wrapped, ref)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR) for m in models]
    for m in models:
        m(input_ids=batch, labels=batch).loss.backward()
    with pytest.raises(hf_rtp.UnsyncedGradientsError, match=r"prompt_encoder\.default\.embedding\.weight"):
        optimizers[0].step()
    hf_rtp.sync_grads(plain)
    for m in (plain, wrapped.module):
        _same(m, ref.module, "grad")
    for optimizer in optimizers:
        optimizer.step()
    for m in (plain, wrapped.module):
        _same(m, ref.module)


class _Wrapper(torch.nn.Module):
    """A user's module around the model, under a name of its own, with a head of its own."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.value = torch.nn.Linear(backbone.config.hidden_size, 1, dtype=DTYPE)

    def forward(self, ids, use_value=True):
        out = self.backbone(input_ids=ids, labels=ids, output_hidden_states=True)
        extra = self.value(out.hidden_states[-1]).pow(2).mean() if use_value else 0.0
        return out.loss + extra


def _wrappers(ckpt, batch, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import hf_rtp

    torch.manual_seed(0)
    wrapped = DDP(_Wrapper(hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False).train()))
    torch.manual_seed(0)
    ref = DDP(_Wrapper(AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE).train()))
    wrapped(batch).backward()
    ref(batch).backward()
    _same(wrapped.module, ref.module, "grad")

    # a head only rank 0's batch reaches: averaged with zeros where it is missing, as DDP's unused parameters are
    torch.manual_seed(0)
    plain = _Wrapper(hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False).train())
    torch.manual_seed(0)
    unused = DDP(_Wrapper(AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE).train()), find_unused_parameters=True)
    plain(batch, use_value=rank == 0).backward()
    unused(batch, use_value=rank == 0).backward()
    assert (plain.value.weight.grad is None) == (rank != 0)
    # a step over the wrapper's own head before sync_grads is refused naming the wrapper, where the head has a
    # gradient (rank 0's batch reached it); elsewhere there is nothing to step
    if rank == 0:
        with pytest.raises(hf_rtp.UnsyncedGradientsError, match="held by a _Wrapper"):
            torch.optim.SGD(plain.value.parameters(), lr=LR).step()
    hf_rtp.sync_grads(plain)
    _same(plain, unused.module, "grad")


def _per_rank_seeds(ckpt, batch, rank):
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    import hf_rtp

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(100 + rank)  # set_seed(seed, device_specific=True)
    lora = get_peft_model(hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False).train(), config)
    torch.manual_seed(100 + rank)
    ref = DDP(get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE).train(), config))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=LR)
    ref_optimizer = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    for m, opt in ((lora, optimizer), (ref, ref_optimizer)):
        m(input_ids=batch, labels=batch).loss.backward()
        if m is lora:
            hf_rtp.sync_grads(m)
        opt.step()
    _same(lora, ref.module)

    # a replicated weight changed on one rank only after load, before the first average of its gradient
    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False).train()
    with torch.no_grad():
        if rank == 1:
            model.model.norm.weight.add_(1.0)
    model(input_ids=batch, labels=batch).loss.backward()
    with pytest.raises(hf_rtp.RotatedStateError, match=r"1 replicated parameter\(s\) hold different values"):
        hf_rtp.sync_grads(model)


def _edits(ckpt, batch, rank):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=DTYPE, fused_loss=False)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPE)
    torch.manual_seed(1)
    model.resize_token_embeddings(model.config.vocab_size + 3)
    torch.manual_seed(1)
    ref.resize_token_embeddings(ref.config.vocab_size + 3)
    for m in (model, ref):  # transformers' recipe for new tokens: the mean of the old rows
        emb, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
        emb.data[-3:] = emb.data[:-3].mean(0)
        head.data[7] = torch.arange(head.shape[1], dtype=DTYPE)
        with torch.no_grad():
            head[:5] = 0
            emb[[0, 50, 103]] = -1.0
            head.data[torch.tensor([2, 99]), :4] = 3.0
    _same(model, ref)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=batch).logits, ref(input_ids=batch).logits)
    with pytest.raises(hf_rtp.RotatedStateError, match="on rows taken from a rotated tensor"):
        model.lm_head.weight.data[:5].zero_()
    with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
        model.lm_head.weight[:5] = 0  # autograd on: vanilla's own error

    # a backward through rows read under autograd: DTensor's gather would give each chunk its own rank's gradient
    weight, world = model.lm_head.weight, model.lm_head.weight.device_mesh.size()
    assert weight[0].numel() == 32  # reading a row under autograd, with no backward through it, is fine
    xs = [torch.randn(32, dtype=DTYPE, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for rows in (7, slice(0, 5)):
        with pytest.raises(hf_rtp.RotatedStateError, match=r"w\.full_tensor\(\)\[7\]"):
            (weight[rows] * xs[rank]).sum().backward()
    weight.grad = None
    (weight.full_tensor()[7] * xs[rank]).sum().backward()  # what the refusal says to call
    (sum((ref.lm_head.weight[7] * x).sum() for x in xs) / world).backward()  # DDP's mean over the ranks' terms
    torch.testing.assert_close(_local(weight.grad), _rows(weight, ref.lm_head.weight.grad))


def _cases(ckpt):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = global_batch(world)[rank]
    for case in (_closures, _prompt_tuning, _wrappers, _per_rank_seeds, _edits):
        case(ckpt, batch, rank)
    return True


@pytest.mark.parametrize("world", [2, 3])  # 3: uneven chunks of every rotated weight (vocabulary 101)
def test_users_paths_around_the_api_equal_vanilla_ddp_or_are_refused(tmp_path, world):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    assert run_on_ranks(_cases, world, ckpt) == [True] * world
