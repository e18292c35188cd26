"""hf_rtp.CPUOffloadOptimizer (optimizer state and step in host memory) against vanilla transformers + DDP with
torch's AdamW, in the same processes: losses, every gradient before each step (after accumulation over two
micro-batches and clip_grad_norm_) and every weight after it, over four steps, at 2 and 3 ranks (uneven rows).
Then the training state saved after step 2 is resumed by a fresh model and optimizer: its losses and weights
after steps 3 and 4 equal the uninterrupted run's, and its state after loading equals the state saved.

On the CPU "host memory" is the same memory: this checks the path (masters, copies, the host step, the state's
round trip), not the saving. torchao's CPUOffloadOptimizer, tried first, asserts a CUDA or XPU device and keeps a
state dict without parameter names (hf_rtp/model/host_optimizer.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from support.compare import rows
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

LR, EPS, DECAY, CLIP = 1e-2, 1e-6, 0.1, 0.5
STEPS, MICRO, SAVED_AT = 4, 2, 2
# Adam's step is lr * m / (sqrt(v) + eps): float32 summation-order noise in a gradient moves it by far less than
# 0.1% of a step; a wrong chunk, a stale master or a lost state is off by a whole step
GRAD_ATOL, GRAD_RTOL, STEP_ATOL = 1e-6, 1e-4, LR * 1e-3


def _batches(world: int, step: int, micro: int):
    return global_batch(world, seed=100 + MICRO * step + micro)


def _local(p, world, rank, value):
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return value.to_local()
    return value.detach()


def _train(model, optimizer, steps, world, rank, vanilla=None, theirs=None):
    """`steps` (step indices) of two micro-batches each, clipped; vanilla beside, compared, when given. Returns
    this rank's losses (per micro-batch) and the largest gaps found (gradients, weights)."""
    import hf_rtp

    ref = dict(vanilla.module.named_parameters()) if vanilla is not None else {}
    losses, grad_gaps, weight_gaps = [], [], []
    for step in steps:
        for micro in range(MICRO):
            batch = _batches(world, step, micro)[rank]
            loss = model(input_ids=batch, labels=batch).loss
            (loss / MICRO).backward()
            losses.append(loss.item())
            if vanilla is not None:
                context = vanilla.no_sync() if micro < MICRO - 1 else _nothing()
                with context:
                    their_loss = vanilla(input_ids=batch, labels=batch).loss
                    (their_loss / MICRO).backward()
                assert abs(loss.item() - their_loss.item()) <= 1e-5 * abs(their_loss.item()), (loss, their_loss)
        hf_rtp.sync_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if vanilla is not None:
            torch.nn.utils.clip_grad_norm_(vanilla.parameters(), CLIP)
            for name, p in model.named_parameters():
                want = ref[name].grad[rows(p, world, rank)] if _rotated(p) else ref[name].grad
                torch.testing.assert_close(_local(p, world, rank, p.grad), want, atol=GRAD_ATOL, rtol=GRAD_RTOL)
                grad_gaps.append((_local(p, world, rank, p.grad) - want).abs().max().item())
        optimizer.step()
        optimizer.zero_grad()
        if vanilla is not None:
            theirs.step()
            theirs.zero_grad()
            for name, p in model.named_parameters():
                want = ref[name].detach()[rows(p, world, rank)] if _rotated(p) else ref[name].detach()
                mine = _local(p, world, rank, p)
                torch.testing.assert_close(mine, want, atol=STEP_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
                weight_gaps.append((mine - want).abs().max().item())
    return losses, max(grad_gaps, default=0.0), max(weight_gaps, default=0.0)


def _rotated(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _optimizer(model):
    import hf_rtp

    return hf_rtp.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, eps=EPS, weight_decay=DECAY)


def _host_state(optimizer, model) -> dict:
    """Each parameter's host state, by name, cloned."""
    return {
        f"{name}.{key}": value.clone()
        for name, p in model.named_parameters()
        for key, value in optimizer.state.get(p, {}).items()
    }


def _offload_beside_ddp(ckpt, out):
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()
    ours = _optimizer(model)
    theirs = torch.optim.AdamW(vanilla.parameters(), lr=LR, eps=EPS, weight_decay=DECAY)
    vanilla = DistributedDataParallel(vanilla)
    first, grad_gap, weight_gap = _train(model, ours, range(SAVED_AT), world, rank, vanilla, theirs)
    hf_rtp.save_training_state(out, model, ours)
    saved = _host_state(ours, model)
    later, grad_gap2, weight_gap2 = _train(model, ours, range(SAVED_AT, STEPS), world, rank, vanilla, theirs)
    final = {n: _local(p, world, rank, p).clone() for n, p in model.named_parameters()}

    resumed_model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    resumed = _optimizer(resumed_model)
    hf_rtp.load_training_state(out, resumed_model, resumed)
    loaded = _host_state(resumed, resumed_model)
    state_gaps = sorted(k for k in saved if k not in loaded or not torch.equal(saved[k], loaded[k]))
    state_gaps += sorted(k for k in loaded if k not in saved)
    again, _, _ = _train(resumed_model, resumed, range(SAVED_AT, STEPS), world, rank)
    weights_gaps = sorted(
        n for n, p in resumed_model.named_parameters() if not torch.equal(_local(p, world, rank, p), final[n])
    )
    masters = len(ours._masters), sum(1 for p in model.parameters() if p.requires_grad)
    return {
        "losses": first + later,
        "resumed": again,
        "grad_gap": max(grad_gap, grad_gap2),
        "weight_gap": max(weight_gap, weight_gap2),
        "state_gaps": state_gaps,
        "state_keys": len(saved),
        "resumed_weight_gaps": weights_gaps,
        "masters": masters,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_offloaded_adamw_steps_like_vanilla_ddp_with_accumulation_clipping_and_a_resume(tmp_path, world):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    results = run_on_ranks(_offload_beside_ddp, world, ckpt, str(tmp_path / "state"))
    for rank, result in enumerate(results):
        print(f"rank {rank}: largest gradient gap {result['grad_gap']:.2e}, weight gap {result['weight_gap']:.2e}")
        assert result["state_gaps"] == [], (rank, result["state_gaps"])
        assert result["state_keys"] > 0
        assert result["resumed"] == result["losses"][SAVED_AT * MICRO :], (rank, result["resumed"], result["losses"])
        assert result["resumed_weight_gaps"] == [], (rank, result["resumed_weight_gaps"])
        assert result["masters"][0] == result["masters"][1]


def test_offload_refuses_optimizers_it_cannot_step_on_the_host_by_name():
    """No ranks needed: the class is refused before any parameter is touched. 8-bit optimizers (bitsandbytes'
    where installed), a factored one (transformers' Adafactor), LBFGS and a non-optimizer."""
    import transformers

    import hf_rtp

    params = [torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4), requires_grad=False)]
    refused = {}
    classes = [transformers.Adafactor, torch.optim.LBFGS, dict]
    try:
        import bitsandbytes

        classes.append(bitsandbytes.optim.AdamW8bit)
    except ImportError:
        pass
    for cls in classes:
        with pytest.raises(hf_rtp.KeywordError) as err:
            hf_rtp.CPUOffloadOptimizer(params, cls, lr=1e-3)
        refused[cls.__name__] = str(err.value)
    assert "Adafactor" in refused["Adafactor"] and "span every row" in refused["Adafactor"]
    assert "LBFGS re-evaluates its closure" in refused["LBFGS"]
    assert "not a torch.optim.Optimizer class" in refused["dict"]
    if "AdamW8bit" in refused:
        assert "bitsandbytes's AdamW8bit keeps 8-bit state" in refused["AdamW8bit"]
    # one plain process, CPU tensors: the path runs (and the frozen parameter gets no master)
    optimizer = hf_rtp.CPUOffloadOptimizer(params, lr=0.1)
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4, 4))], lr=0.1)
    for p in (params[0], reference.param_groups[0]["params"][0]):
        p.grad = torch.full((4, 4), 0.5)
    optimizer.step(), reference.step()
    assert len(optimizer._masters) == 1
    torch.testing.assert_close(params[0].detach(), reference.param_groups[0]["params"][0].detach())


def _trainers(ckpt, out):
    """Trainer with optimizers=(torch's AdamW, None) on vanilla (DDP), and (CPUOffloadOptimizer, None) on hf_rtp,
    then hf_rtp's run resumed from its checkpoint-2: the logged losses of each."""
    from test_trainer import Tokens
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_rtp

    def run(model, folder, offload, resume=None):
        args = TrainingArguments(output_dir=folder, optim="adamw_torch", max_steps=4, learning_rate=LR,
                                 weight_decay=DECAY, adam_epsilon=EPS, max_grad_norm=CLIP,
                                 per_device_train_batch_size=2, gradient_accumulation_steps=MICRO, logging_steps=1,
                                 save_steps=2, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)  # fmt: skip
        kind = hf_rtp.CPUOffloadOptimizer if offload else torch.optim.AdamW  # one group each, the same options
        options = dict(optimizer_class=torch.optim.AdamW) if offload else {}
        optimizers = (kind(model.parameters(), lr=LR, eps=EPS, weight_decay=DECAY, **options), None)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 3), optimizers=optimizers)
        trainer.train(resume_from_checkpoint=resume)
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    vanilla = run(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), f"{out}/vanilla", False)
    ours = run(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), f"{out}/ours", True)
    resumed = run(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), f"{out}/ours", True, f"{out}/ours/checkpoint-2")
    return vanilla, ours, resumed


def test_trainer_takes_the_offloaded_optimizer_and_resumes_from_its_checkpoint(tmp_path):
    """Trainer(optimizers=(hf_rtp.CPUOffloadOptimizer(...), None)), the documented way, at 2 ranks, with gradient
    accumulation, max_grad_norm and Trainer's linear schedule: losses equal vanilla Trainer's with torch's AdamW
    (the same one parameter group), and the run resumed from checkpoint-2 repeats steps 3 and 4 exactly."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for vanilla, ours, resumed in run_on_ranks(_trainers, 2, ckpt, str(tmp_path / "t")):
        print("vanilla", vanilla, "ours", ours, "resumed", resumed)
        assert len(ours) == 4 and resumed[-2:] == ours[2:], (ours, resumed)
        assert ours == pytest.approx(vanilla, rel=1e-6), (ours, vanilla)
