"""Comparing a rotated model with vanilla transformers on the global batch, in float64.

Float64, because Adam divides by sqrt(v) + eps: in float32 a gradient near 1e-8 turns
summation-order noise into a visible step difference. Some families still compute norms (and their
loss) in float32, so inputs that differ by float64 rounding (chunked matmuls block differently) can
round differently there: the tolerance is float32 rounding, about 100x tighter than a float32 comparison.
"""

from __future__ import annotations

import torch

ATOL, RTOL = 1e-8, 1e-6
LR = 1e-2
# Adam's first step is lr * g / (|g| + eps): a grad error d moves it by up to lr * d / eps. With
# eps = 1e-6 the float32-sized noise the grad check admits (d ~ 1e-11) moves a step by ~1e-7, far
# inside 0.1% of a step; a real fault (wrong chunk, wrong state) is off by a whole step.
ADAM_EPS = 1e-6
STEP_ATOL = LR * 1e-3
# Gradients through a family's float32 islands (Gemma 2 runs four float32 RMSNorms per layer) carry
# float32 rounding of a different summation order: ~1e-5 relative, where a wrong chunk is off by ~1
GRAD_ATOL, GRAD_RTOL = 1e-7, 1e-5
DTYPE = torch.float64


def rows(param, world, rank):
    from hf_rtp.distributed.tensors.sharding import chunk_rows

    return slice(*chunk_rows(param.shape[0], world, rank))


def assert_matches(model, ref, world, rank, what, atol=ATOL, rtol=RTOL, trainable=False):
    """Every parameter (or its grad) equals vanilla's; rotated ones as this rank's rows of it (with
    `trainable`, only the parameters that require grad: adapters over a frozen base)."""
    from torch.distributed.tensor import DTensor

    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        if trainable and not p.requires_grad:
            continue
        mine = p if what == "param" else p.grad
        theirs = ref_params[name] if what == "param" else ref_params[name].grad
        assert mine is not None and theirs is not None, f"{name}: missing {what}"
        if isinstance(p, DTensor):
            mine, theirs = mine.to_local(), theirs[rows(p, world, rank)]
        torch.testing.assert_close(
            mine.detach(), theirs.detach(), atol=atol, rtol=rtol, msg=lambda m, name=name: f"{what} of {name}: {m}"
        )


def float64_loss(out, ids, config):
    """Next-token loss in float64 (plus the MoE auxiliary loss, as transformers adds it)."""
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + config.router_aux_loss_coef * out.aux_loss
    return loss


def assert_same_model(model, ref, world, rank):
    """Same class, parameter names and shapes, state_dict keys, buffers; this rank's rows of every parameter."""
    assert type(model) is type(ref)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert list(model.state_dict()) == list(ref.state_dict())
    for name, buf in ref.named_buffers():  # non-persistent rotary frequencies, Gemma's embed_scale
        torch.testing.assert_close(model.get_buffer(name), buf, atol=0, rtol=0)
    assert_matches(model, ref, world, rank, "param")


def forward_both(model, ref, batches, rank):
    """This rank's forward, and vanilla's on every rank's batch; logits, loss and MoE aux loss compared.

    `return_logits=True`: in training a forward with labels otherwise takes the fused loss, without logits."""
    out = model(input_ids=batches[rank], labels=batches[rank], return_logits=True)
    ref_outs = [ref(input_ids=b, labels=b) for b in batches]
    torch.testing.assert_close(out.logits, ref_outs[rank].logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.loss, ref_outs[rank].loss, atol=1e-6, rtol=1e-6)  # transformers' loss is float32
    if getattr(out, "aux_loss", None) is not None:  # MoE load balancing, from the replicated router
        torch.testing.assert_close(out.aux_loss, ref_outs[rank].aux_loss, atol=ATOL, rtol=RTOL)
    return out, ref_outs


def adamw(*models):
    return [torch.optim.AdamW(m.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1) for m in models]


def step_both(model, ref, optimizers, batches, rank):
    """One optimizer step of this rank's batch, and of vanilla's on all of them; gradients compared
    before it and parameters after it, this rank's rows of rotated ones (on its ring)."""
    import hf_rtp
    from hf_rtp.model.state import state_of

    topology = state_of(model).topology
    out, ref_outs = forward_both(model, ref, batches, rank)
    float64_loss(out, batches[rank], ref.config).backward()
    hf_rtp.sync_grads(model)
    torch.stack([float64_loss(o, b, ref.config) for o, b in zip(ref_outs, batches, strict=True)]).mean().backward()
    assert_matches(model, ref, topology.rtp_size, topology.rtp_rank, "grad")
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    assert_matches(model, ref, topology.rtp_size, topology.rtp_rank, "param", atol=STEP_ATOL)
    return out.loss.item()


def save_and_check_reload(model, out_dir, rank):
    """Collective save_pretrained; rank 0 then loads it with vanilla transformers and finds every
    tensor bit-equal to the rotated model's (gathered) state."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    model.save_pretrained(out_dir)
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.state_dict().items()}
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=next(model.parameters()).dtype)
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(tensor, full[name]), name


def backward_both(model, ref, batches, rank):
    """This rank's forward and backward, beside vanilla's over every rank's batch (the mean of the per-rank
    losses is DDP's objective), replicated gradients averaged: each model's gradients before an optimizer step.

    Backward runs through a float64 loss: vanilla's downcasts logits to float32, whose rounding would then
    differ between one rank's mean and the reference's mean over ranks."""
    import hf_rtp

    out, ref_outs = forward_both(model, ref, batches, rank)
    float64_loss(out, batches[rank], ref.config).backward()
    hf_rtp.sync_grads(model)
    torch.stack([float64_loss(o, b, ref.config) for o, b in zip(ref_outs, batches, strict=True)]).mean().backward()
    return out, ref_outs


def trainable_grad_gaps(model, reference) -> dict[str, tuple[float, float]]:
    """Each trainable parameter's name -> (largest |grad - reference's grad|, largest |reference's grad|), for
    replicated parameters (adapters) of a model and its vanilla reference; plain floats cross a result queue."""
    theirs = dict(reference.named_parameters())
    return {
        name: ((p.grad - theirs[name].grad).abs().max().item(), theirs[name].grad.abs().max().item())
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def grad_gaps_rows(model, ref, world, rank) -> dict[str, tuple[float, float]]:
    """(largest gap, largest vanilla gradient) of every trainable parameter, rotated ones as this rank's rows, in
    float32 (bf16 gradients compared as their values, not their rounding), as plain floats."""
    from torch.distributed.tensor import DTensor

    theirs = dict(ref.named_parameters())
    gaps = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            mine, want = p.grad, theirs[name].grad
            if isinstance(p, DTensor):
                mine, want = mine.to_local(), want[rows(p, world, rank)]
            gaps[name] = ((mine.float() - want.float()).abs().max().item(), want.float().abs().max().item())
    return gaps


def lora_step_both(model, vanilla, batch, targets) -> tuple:
    """The same LoRA adapters (r=4, seeded, B not zero) on a quantized model and on its vanilla reference, then one
    backward on `batch` each, vanilla's under DDP, hf_rtp's replicated gradients averaged: (the adapted model, both
    losses, every trainable gradient's gap)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from torch.nn.parallel import DistributedDataParallel

    import hf_rtp

    def adapted(m):
        m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=False)
        torch.manual_seed(0)  # the same adapters on both
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=targets)
        return get_peft_model(m, config).train()

    model, vanilla = adapted(model), adapted(vanilla)
    losses = []
    for m in (model, DistributedDataParallel(vanilla)):
        loss = m(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.item())
    hf_rtp.sync_grads(model)
    return model, losses, trainable_grad_gaps(model, vanilla)


def hf_rtp_records() -> list:
    """Every record hf_rtp logs in this process from now on (a rank's own, whatever its level)."""
    import logging

    records: list = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("hf_rtp").addHandler(handler)
    return records


def take_vanilla_grads(model, ref: dict, world: int, rank: int, names=None) -> None:
    """hf_rtp's gradients checked against vanilla's (DDP's, `ref` by name), then replaced by them: what remains
    to differ after an optimizer step is the step's (rotated ones as this rank's rows)."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if names is not None and name not in names:
            continue
        mine = p.grad.to_local() if isinstance(p, DTensor) else p.grad
        want = ref[name].grad[rows(p, world, rank)] if isinstance(p, DTensor) else ref[name].grad
        torch.testing.assert_close(mine, want, atol=1e-6, rtol=1e-4)
        mine.copy_(want)


def vanilla_training_path(model):
    """`model` (vanilla transformers + bitsandbytes) computing its 4-bit linears as it does in training and on a
    GPU, whatever this CPU's flags; returns it.

    On a CPU with AVX512-BF16, bitsandbytes 0.50's `Linear4bit.forward` in eval mode, with an input that needs
    no grad (a model fresh from from_pretrained is in eval mode; under LoRA the first layer's input needs no
    grad), repacks its weight (`_convert_weight_packed_for_cpu`) and from then on runs a bf16 kernel with no
    autograd (`support_avx512bf16_for_cpu`): logits ~5e-3 off the float32 path, and later LoRA gradients None.
    On a CPU without it, and on every GPU, that path does not exist. hf_rtp always computes bitsandbytes'
    general path (layers/linear4bit.py), so the baseline is that path on every machine of this kind."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model
