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
LOSS_GAPS: list[float] = []  # |loss - vanilla's| of each micro-batch _train compared, in this process


def _batches(world: int, step: int, micro: int):
    return global_batch(world, seed=100 + MICRO * step + micro)


def _local(p, world, rank, value):
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return value.to_local()
    return value.detach()


def _train(model, optimizer, steps, world, rank, vanilla=None, theirs=None):
    """`steps` (step indices) of two micro-batches each, clipped; vanilla beside, compared, when given. Returns
    this rank's losses (per micro-batch) and the largest gaps found (gradients, weights, then losses in `LOSS_GAPS`)."""
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
                LOSS_GAPS.append(abs(loss.item() - their_loss.item()))
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


def _optimizer(model, bucket_bytes=None):
    import hf_rtp

    optimizer = hf_rtp.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, eps=EPS, weight_decay=DECAY)
    if bucket_bytes is not None:
        optimizer.bucket_bytes = bucket_bytes
    return optimizer


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
    # at 3 ranks a host step per parameter (the pipeline's most buckets), at 2 one for all (the tiny model's masters
    # are far below BUCKET_BYTES)
    ours = _optimizer(model, bucket_bytes=1 if world == 3 else None)
    buckets = len(ours._buckets(list(ours._masters)))
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
        "buckets": buckets,
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
        assert result["buckets"] == (result["masters"][0] if world == 3 else 1), result["buckets"]


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


# A reshard: the training state saved at 2 ranks, resumed at 3, in float64 (fused_loss=False: the fused LM-head
# loss computes in float32). Vanilla DDP's run goes on across the change of world size from its own exact copy
# (torch.save of its weights and AdamW's state), so it stands for the uninterrupted run.
RESHARD_FROM, RESHARD_TO, FLOAT64_GAP = 2, 3, 1e-12


def _float64_pair(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, fused_loss=False).train()
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).train()
    return model, vanilla


def _reshard_save(ckpt, out):
    from torch.nn.parallel import DistributedDataParallel

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model, vanilla = _float64_pair(ckpt)
    ours = _optimizer(model)
    theirs = torch.optim.AdamW(vanilla.parameters(), lr=LR, eps=EPS, weight_decay=DECAY)
    vanilla = DistributedDataParallel(vanilla)
    losses, grad_gap, weight_gap = _train(model, ours, range(SAVED_AT), world, rank, vanilla, theirs)
    loss_gap = max(LOSS_GAPS)
    hf_rtp.save_training_state(f"{out}/ours", model, ours)
    whole = {}  # what was saved, every tensor whole: the weights and each parameter's host state
    for name, p in model.named_parameters():
        for key, value in {"weight": p, **ours.state_dict()["state"][_position(model, p)]}.items():
            value = value.full_tensor() if _rotated(value) else value
            whole[f"{name}.{key}"] = value.detach().clone()
    if rank == 0:
        torch.save({"model": vanilla.module.state_dict(), "optimizer": theirs.state_dict()}, f"{out}/vanilla.pt")
        torch.save(whole, f"{out}/ours.pt")
    torch.distributed.barrier()
    return {"losses": losses, "loss_gap": loss_gap, "grad_gap": grad_gap, "weight_gap": weight_gap}


def _reshard_resume(ckpt, out):
    from torch.nn.parallel import DistributedDataParallel

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model, vanilla = _float64_pair(ckpt)
    ours = _optimizer(model)
    hf_rtp.load_training_state(f"{out}/ours", model, ours)
    saved = torch.load(f"{out}/vanilla.pt", weights_only=True)
    vanilla.load_state_dict(saved["model"])
    theirs = torch.optim.AdamW(vanilla.parameters(), lr=LR, eps=EPS, weight_decay=DECAY)
    theirs.load_state_dict(saved["optimizer"])
    # what the load put in place: this rank's rows of every weight and of AdamW's state, exactly what was saved at 2
    # ranks, and vanilla's within float64 rounding
    whole = torch.load(f"{out}/ours.pt", weights_only=True)
    ref = dict(vanilla.named_parameters())
    loaded_gaps, vanilla_gap = [], 0.0
    for name, p in model.named_parameters():
        cut = rows(p, world, rank) if _rotated(p) else slice(None)
        for key, mine in {"weight": _local(p, world, rank, p), **ours.state[p]}.items():
            want = whole[f"{name}.{key}"]
            if not torch.equal(mine, want if key == "step" else want[cut]):
                loaded_gaps.append(f"{name}.{key}")
            if key != "step":
                theirs_now = ref[name].detach() if key == "weight" else theirs.state[ref[name]][key]
                vanilla_gap = max(vanilla_gap, (mine - theirs_now[cut]).abs().max().item())
        if set(ours.state[p]) != set(theirs.state[ref[name]]):
            loaded_gaps.append(f"{name}: {sorted(ours.state[p])}")
    vanilla = DistributedDataParallel(vanilla)
    LOSS_GAPS.clear()
    losses, grad_gap, weight_gap = _train(model, ours, range(SAVED_AT, STEPS), world, rank, vanilla, theirs)
    return {
        "losses": losses,
        "loss_gap": max(LOSS_GAPS),
        "grad_gap": grad_gap,
        "weight_gap": weight_gap,
        "loaded_gaps": loaded_gaps,
        "loaded_vanilla_gap": vanilla_gap,
    }


def _position(model, p) -> int:
    return next(i for i, q in enumerate(model.parameters()) if q is p)


def test_offloaded_state_saved_at_2_ranks_resumes_at_3_like_vanilla_ddp_in_float64(tmp_path):
    """Issue 68's reshard: the training state of CPUOffloadOptimizer saved after step 2 at 2 ranks, loaded at 3 ranks
    (rows cut anew), holds vanilla's weights and AdamW state row for row, and steps 3 and 4 (two micro-batches each,
    clipped) give vanilla DDP's losses, gradients and weights within float64 rounding."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    out = str(tmp_path / "state")
    before = run_on_ranks(_reshard_save, RESHARD_FROM, ckpt, out)
    after = run_on_ranks(_reshard_resume, RESHARD_TO, ckpt, out)
    for phase, results in (("saved at 2", before), ("resumed at 3", after)):
        for rank, result in enumerate(results):
            gaps = {what: result[f"{what}_gap"] for what in ("loss", "grad", "weight")}
            print(
                f"{phase}, rank {rank}: largest gaps to vanilla DDP "
                + ", ".join(f"{k} {v:.1e}" for k, v in gaps.items())
            )
            assert max(gaps.values()) < FLOAT64_GAP, (phase, rank, result)
    for rank, result in enumerate(after):
        print(f"resumed at 3, rank {rank}: loaded state against vanilla's {result['loaded_vanilla_gap']:.1e}")
        assert result["loaded_gaps"] == [], (rank, result["loaded_gaps"])
        assert result["loaded_vanilla_gap"] < FLOAT64_GAP, (rank, result["loaded_vanilla_gap"])
        assert len(result["losses"]) == (STEPS - SAVED_AT) * MICRO


def _lora_offload(ckpt):
    """LoRA on q_proj and v_proj (float64, unfused loss) with CPUOffloadOptimizer over every parameter, beside
    vanilla PEFT under DDP with torch's AdamW: every trainable gradient before each step, every weight after it."""
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def adapt(model):
        torch.manual_seed(0)  # init_lora_weights=False: random B too, so every adapter gets a gradient at once
        config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "v_proj"]
        )
        return get_peft_model(model, config)

    model = adapt(hf_rtp.from_pretrained(ckpt, dtype=torch.float64, fused_loss=False)).train()
    vanilla = adapt(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)).train()
    ours = _optimizer(model)  # every parameter handed over, as Trainer does: only the adapters get host state
    theirs = torch.optim.AdamW(vanilla.parameters(), lr=LR, eps=EPS, weight_decay=DECAY)
    ddp = DistributedDataParallel(vanilla)
    reference = dict(vanilla.named_parameters())
    grad_gap = weight_gap = 0.0
    for step in range(3):
        batch = _batches(world, step, 0)[rank]
        model(input_ids=batch, labels=batch).loss.backward()
        ddp(input_ids=batch, labels=batch).loss.backward()
        hf_rtp.sync_grads(model)
        for name, p in model.named_parameters():
            if p.requires_grad:
                grad_gap = max(grad_gap, (_local(p, world, rank, p.grad) - reference[name].grad).abs().max().item())
        ours.step(), theirs.step()
        ours.zero_grad(), theirs.zero_grad()
        for name, p in model.named_parameters():
            want = reference[name].detach()[rows(p, world, rank)] if _rotated(p) else reference[name].detach()
            weight_gap = max(weight_gap, (_local(p, world, rank, p) - want).abs().max().item())
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    offloaded = sorted(n for n, p in model.named_parameters() if p in ours._masters)
    stated = sorted(n for n, p in model.named_parameters() if ours.state.get(p))
    return {"grad_gap": grad_gap, "weight_gap": weight_gap, "trainable": trainable, "offloaded": offloaded,
            "stated": stated}  # fmt: skip


def test_lora_adapters_alone_are_offloaded_and_step_like_vanilla_peft_under_ddp(tmp_path):
    """PEFT (issue 68 point 1): with LoRA only the adapters get a host master and AdamW state; their gradients
    before each of 3 AdamW steps and every weight after them equal vanilla PEFT + DDP's within float64 rounding."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for rank, result in enumerate(run_on_ranks(_lora_offload, 2, ckpt)):
        print(f"rank {rank}: LoRA gradient gap {result['grad_gap']:.1e}, weight gap {result['weight_gap']:.1e}")
        assert result["trainable"] and all("lora_" in n for n in result["trainable"]), result["trainable"]
        assert result["offloaded"] == result["stated"] == result["trainable"], result
        assert result["grad_gap"] < FLOAT64_GAP and result["weight_gap"] < FLOAT64_GAP, (rank, result)


def _edits_followed(ckpt):
    """A bf16 rotated model: after a step, the user edits three weights in place, through the DTensor, through
    `.data` and through a foreach op; a step at lr=0 must leave each as edited, where a stale float32 master would
    put the old rows back. Every other weight keeps its rows (its master rounds to them). Also returned: whether
    torch's clip_grad_norm_ (foreach ops) bumps a rotated gradient's version counters, which is why the gradients
    are not copied during backward (host_optimizer's docstring)."""
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.bfloat16).train()
    optimizer = hf_rtp.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.0)
    batch = _batches(2, 0, 0)[int(os.environ["RANK"])]
    model(input_ids=batch, labels=batch).loss.backward()
    hf_rtp.sync_grads(model)
    grad = next(p.grad for p in model.parameters() if _rotated(p))
    counters = (grad._version, grad._local_tensor._version)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # scales every gradient: the norm is far above 1e-3
    clip_bumped = counters != (grad._version, grad._local_tensor._version)
    optimizer.step()
    optimizer.zero_grad()
    rotated = [(n, p) for n, p in model.named_parameters() if _rotated(p) and p.ndim == 2]
    (a, pa), (b, pb), (c, pc) = rotated[:3]
    with torch.no_grad():
        pa.mul_(0.5)  # in place through the DTensor
        torch._foreach_add_([pc], 1.0)  # a foreach op, as a user's EMA or decay loop would
    pb.data.fill_(0.25)  # through .data
    want = {n: _local(p, 2, 0, p).clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(_local(p, 2, 0, p), want[n]))
    return {"changed": changed, "edited": [a, b, c], "clip_bumped": clip_bumped}


def test_a_bf16_weight_edited_in_place_between_steps_is_where_the_next_step_starts(tmp_path):
    """Issue 68 point 1 (the masters): a bf16 parameter's float32 master follows every write to its rows between
    steps, also those no version counter shows (DTensor in-place ops, `.data`, foreach), at 2 ranks."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for rank, result in enumerate(run_on_ranks(_edits_followed, 2, ckpt)):
        assert result["changed"] == [], (rank, result)
        # if torch starts counting these, gradient copies during backward could be checked for staleness
        assert not result["clip_bumped"], "torch now bumps a DTensor's counters in foreach ops: revisit the docstring"


def test_a_cuda_run_with_one_host_thread_is_told_how_many_cores_it_has():
    """torchrun and accelerate launch set OMP_NUM_THREADS=1: the host AdamW would then run on one core of many."""
    from hf_rtp.model.host_optimizer import cores_per_rank, thread_advice

    advice = thread_advice(True, 1, 8)
    assert advice is not None and "OMP_NUM_THREADS=8" in advice
    assert thread_advice(True, 8, 8) is None and thread_advice(True, 1, 1) is None
    assert thread_advice(False, 1, 8) is None  # on a CPU device the cores are the model's too
    assert cores_per_rank({"LOCAL_WORLD_SIZE": str(10**6)}) == 1
    assert cores_per_rank({}) == cores_per_rank({"LOCAL_WORLD_SIZE": "1"}) >= 1


def _scaled(ckpt):
    """GradScaler around both optimizers (float32 weights, scaled losses): three steps, the second with an inf in
    a rotated gradient's rows on rank 0 (vanilla's: on every rank, DDP's gradients being whole), which GradScaler
    must skip on every rank for both (DTensor's unscale reduces found_inf over the ring). Returns the largest weight
    gap after each step and each scaler's scales."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()
    ours, theirs = _optimizer(model), torch.optim.AdamW(vanilla.parameters(), lr=LR, eps=EPS, weight_decay=DECAY)
    ddp = DistributedDataParallel(vanilla)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12) for _ in range(2)]
    reference = dict(vanilla.named_parameters())
    gaps, scales = [], []
    for step in range(3):
        batch = _batches(world, step, 0)[rank]
        scalers[0].scale(model(input_ids=batch, labels=batch).loss).backward()
        scalers[1].scale(ddp(input_ids=batch, labels=batch).loss).backward()
        hf_rtp.sync_grads(model)
        if step == 1:  # an overflow in a rotated gradient's rows rank 0 holds; vanilla's every rank holds whole
            name, p = next((n, p) for n, p in model.named_parameters() if _rotated(p))
            if rank == 0:
                p.grad.to_local()[0, 0] = float("inf")
            reference[name].grad[rows(p, world, 0)][0, 0] = float("inf")
        for scaler, optimizer in zip(scalers, (ours, theirs), strict=True):
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters() if optimizer is ours else vanilla.parameters(), CLIP)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        gaps.append(
            max(
                (
                    _local(p, world, rank, p)
                    - (reference[n].detach()[rows(p, world, rank)] if _rotated(p) else reference[n].detach())
                )
                .abs()
                .max()
                .item()
                for n, p in model.named_parameters()
            )
        )
        scales.append([s.get_scale() for s in scalers])
    return {"gaps": gaps, "scales": scales, "steps": [float(ours.state[p]["step"]) for p in list(ours._masters)[:1]]}


def test_grad_scaler_unscales_skips_an_overflow_and_steps_like_vanilla_ddp(tmp_path):
    """Issue 68 point 1's GradScaler: unscale_, clip_grad_norm_ and scaler.step around the offloaded optimizer,
    beside vanilla DDP with torch's AdamW and its own scaler; an inf on one rank's gradient in step 2 halves both
    scales and skips that step on every rank (the host step never runs it), rank 1 too, which holds other rows, and
    the weights stay vanilla's."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for rank, result in enumerate(run_on_ranks(_scaled, 2, ckpt)):
        print(f"rank {rank}: weight gaps {result['gaps']}, scales {result['scales']}, steps {result['steps']}")
        assert max(result["gaps"]) < STEP_ATOL, (rank, result)
        assert [a == b for a, b in result["scales"]] == [True] * 3, result["scales"]
        assert result["scales"][1][0] == result["scales"][0][0] / 2, result["scales"]  # the overflow's backoff
        assert float(result["steps"][0]) == 2.0, result["steps"]  # three steps, the overflowed one skipped


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta"])
def test_each_elementwise_optimizer_stepped_a_bucket_at_a_time_equals_torch_s(name):
    """No ranks: plain CPU parameters (the path a replicated parameter takes). The pipeline steps the host optimizer
    once per bucket, here a bucket per parameter, with the others' gradients hidden: five steps of each class torch
    steps element by element (with momentum or weight decay where it has them) equal torch's own optimizer's."""
    import hf_rtp

    cls = getattr(torch.optim, name)
    options = {"lr": 1e-2, "weight_decay": 0.1}
    options.update({"SGD": {"momentum": 0.9, "nesterov": True}, "RMSprop": {"momentum": 0.5}}.get(name, {}))
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=gen) for shape in ((16, 8), (8,), (4, 4, 2))]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    offloaded = hf_rtp.CPUOffloadOptimizer(ours, cls, **options)
    offloaded.bucket_bytes = 1
    reference = cls(theirs, **options, **({"foreach": False} if name not in ("SGD",) else {}))
    for _ in range(5):
        grads = [torch.randn(t.shape, generator=gen) for t in start]
        for params in (ours, theirs):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
        offloaded.step(), reference.step()
    assert len(offloaded._buckets(list(offloaded._masters))) == 3
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
