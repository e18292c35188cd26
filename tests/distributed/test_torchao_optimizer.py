"""torchao's AdamW8bit on rotated rows, against vanilla DDP with the same optimizer in the same processes.

torchao compiles each parameter's step; hf_rtp runs it on each rank's rows. Where a rank's rows start on one of
torchao's 256-element blocks, the weights, the uint8 codes and their block scales must equal vanilla's bit for
bit, and whether the state is 8-bit follows the whole tensor's size. Where the rows cannot align (o_proj's rows
of 64 at 3 ranks), the state is unquantized as torchao keeps a small tensor's, and must then equal vanilla
given the same unquantized state. The gradients are vanilla's (copied in after hf_rtp's own backward, which is
checked against them first), so that any difference is the optimizer's.

torchao is kept out of the suite's environment: transformers imports it in every process that imports PEFT
(about 3 s each). .ci/run installs it in .ci/torchao, which only these ranks put on their path.
"""

import importlib.util
import logging
import os
import sys

import numpy
import pytest
import torch
from support.compare import hf_rtp_records, rows, take_vanilla_grads
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

TORCHAO = os.path.join(os.path.dirname(__file__), "..", "..", ".ci", "torchao")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None and not os.path.isdir(os.path.join(TORCHAO, "torchao")),
    reason="torchao is not installed (.ci/run installs it in .ci/torchao)",
)

# q_proj: 64 rows of 128 (two rows a block: 22/22/20 rows at 3 align, 2816 of its 8192 elements each); o_proj: 128
# rows of 64 (four rows a block: 43/43/42 at 3 do not align; 64/64 at 2 do); the norm: replicated, 128 elements
CONFIG = dict(hidden_size=128, num_attention_heads=2, head_dim=32, intermediate_size=64)
TRAINED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
           "model.layers.0.input_layernorm.weight")  # fmt: skip
RESUMED = (TRAINED[0], TRAINED[2])  # q_proj and the norm: aligned at 2 and 3 ranks alike
# A first step compiles torchao's step per shape: on a loaded two-core machine, tens of seconds, which some ranks
# spend while the others wait in the next collective. The suite's 60 s would time them out (a CI run did).
COMPILING = {"HF_RTP_TIMEOUT": "300"}


def _optim():
    if os.path.isdir(TORCHAO):
        sys.path.insert(0, os.path.abspath(TORCHAO))
    import torchao.optim

    return torchao.optim


def _trained(model, names=TRAINED):
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
    return [p for name, p in model.named_parameters() if name in names]


def _state(optimizer, p, key):
    """(codes or unquantized moment, block scales or None) of one moment, this rank's part, plain tensors."""
    from torch.distributed.tensor import DTensor

    state = optimizer.state[p]
    value = state[key].to_local() if isinstance(state[key], DTensor) else state[key]
    if hasattr(value, "codes"):  # vanilla's OptimState8bit
        return value.codes, value.scale
    scale = state.get(f"{key}_scale")
    blocks = value.numel() // 256
    return value, None if scale is None else scale.to_local().reshape(-1)[:blocks]


def _in_turn(step) -> None:
    """A step rank after rank: what one rank compiled for its first step, the next takes from torch.compile's
    cache (the ranks share most shapes); the test's time only, the steps are the same."""
    import torch.distributed as dist

    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            step()
        dist.barrier()


def _steps(ckpt, out, other, steps=3):
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    optim = _optim()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    records = hf_rtp_records()
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()
    ours, theirs = optim.AdamW8bit(_trained(model), lr=1e-2), optim.AdamW8bit(_trained(vanilla), lr=1e-2)
    vanilla = DistributedDataParallel(vanilla)
    ref = dict(vanilla.module.named_parameters())
    if world == 3:  # what hf_rtp says it keeps for o_proj there: unquantized state, as torchao's for a small tensor
        o_proj = ref[TRAINED[1]]
        theirs.state[o_proj] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(o_proj),
                                "exp_avg_sq": torch.zeros_like(o_proj)}  # fmt: skip
    batch = global_batch(world)[rank]
    for _ in range(steps):
        ours.zero_grad(), theirs.zero_grad()
        vanilla(input_ids=batch, labels=batch).loss.backward()
        model(input_ids=batch, labels=batch).loss.backward()
        hf_rtp.sync_grads(model)
        take_vanilla_grads(model, ref, world, rank, TRAINED)
        _in_turn(lambda: (ours.step(), theirs.step()))
    unequal, kinds = [], {}
    for name, p in model.named_parameters():
        if name not in TRAINED:
            continue
        here = rows(p, world, rank) if isinstance(p, DTensor) else slice(None)
        if not torch.equal(p.to_local() if isinstance(p, DTensor) else p.detach(), ref[name].detach()[here]):
            unequal.append(f"weight of {name}")
        if p.grad is None:
            unequal.append(f"the gradient of {name} was not given back after the step")
        for key in ("exp_avg", "exp_avg_sq"):
            (mine, mine_scale), (want, want_scale) = _state(ours, p, key), _state(theirs, ref[name], key)
            kinds[name] = (str(mine.dtype), str(want.dtype))
            if not torch.equal(mine, want[here]):
                unequal.append(f"{key} of {name}")
            if want_scale is not None and mine_scale is not None:
                per_row = p[0].numel()
                first = here.start * per_row // 256 if isinstance(p, DTensor) else 0
                if not torch.equal(mine_scale, want_scale[first : first + mine_scale.numel()]):
                    unequal.append(f"{key} scales of {name}")
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "torchao" in r.getMessage()]
    hf_rtp.save_training_state(other, model, ours)  # o_proj's state unquantized, as 3 ranks keep it
    resumable = _optim().AdamW8bit(_trained(model, RESUMED), lr=1e-2)  # aligned at 2 and 3 ranks alike
    scheduler = _scheduler(resumable)  # torchao's lr is a tensor: so are the scheduler's records of it
    for _ in range(2):
        _synthetic_step(model, resumable)
        scheduler.step()
    hf_rtp.save_training_state(out, model, resumable, scheduler)
    saved = _full_state(model, resumable, RESUMED)
    _synthetic_step(model, resumable)
    return unequal, kinds, warned, saved, _full_state(model, resumable, RESUMED)


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))


def _full_state(model, optimizer, names):
    """The trained parameters and their optimizer state, whole (collective), by name; numpy arrays."""
    from torch.distributed.tensor import DTensor

    whole = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in names:
                continue
            state = optimizer.state[p]
            for key, value in [("weight", p), *((k, v) for k, v in state.items() if k != "step")]:
                value = value.full_tensor() if isinstance(value, DTensor) else value
                whole[f"{name}.{key}"] = value.detach().reshape(-1).numpy().copy()
            whole[f"{name}.step"] = float(state["step"])
    lr = optimizer.param_groups[0]["lr"]
    whole["lr"] = (type(lr).__name__, float(lr))
    return whole


def _synthetic_step(model, optimizer, in_turn=False):
    """One step from the same global gradients at any world size: each rank its rows of a seeded tensor."""
    from torch.distributed.tensor import DTensor

    for index, (_, p) in enumerate(model.named_parameters()):
        if p.requires_grad:
            grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(index)) * 1e-2
            here = rows(p, p.device_mesh.size(), p.device_mesh.get_local_rank()) if isinstance(p, DTensor) else ...
            p.grad = torch.zeros_like(p)
            (p.grad.to_local() if isinstance(p, DTensor) else p.grad).copy_(grad[here])
    _in_turn(optimizer.step) if in_turn else optimizer.step()


def _refused(model):
    """What torchao's 4-bit AdamW, AdamW8bit with stochastic rounding and a step with a closure (which would
    recompute the gradients after hf_rtp stepped the rows) say on their first step, and whether they left the
    weights and their own state untouched."""
    import hf_rtp

    optim = _optim()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    messages = []
    for make, closure in [
        (optim.AdamW4bit, None),
        (lambda ps: optim.AdamW8bit(ps, bf16_stochastic_round=True), None),
        (optim.AdamW8bit, lambda: torch.tensor(0.0)),
    ]:
        optimizer = make(_trained(model, TRAINED))
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        with pytest.raises(hf_rtp.RotatedStateError) as refused:
            optimizer.step(closure)
        messages.append((str(refused.value), len(optimizer.state)))
    untouched = all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    return messages, untouched


def _trainers(ckpt, out):
    """Trainer(optim="adamw_torch_8bit") as a script sets it, on vanilla (DDP) and on hf_rtp, then hf_rtp's run
    resumed from its checkpoint-2: the losses of each."""
    from test_trainer import Tokens
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_rtp

    def run(model, folder, resume=None):
        _trained(model)
        # weight_decay: two param groups (the norm without decay), and the decayed ones compile as in _steps
        args = TrainingArguments(output_dir=folder, optim="adamw_torch_8bit", max_steps=4, learning_rate=1e-2,
                                 weight_decay=0.01, per_device_train_batch_size=2, logging_steps=1, save_steps=2,
                                 report_to=[], use_cpu=True, seed=0, disable_tqdm=True)  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(32, 3))
        trainer.train(resume_from_checkpoint=resume)
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    vanilla = run(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), f"{out}/vanilla")
    ours = run(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), f"{out}/ours")
    resumed = run(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), f"{out}/ours", f"{out}/ours/checkpoint-2")
    return vanilla, ours, resumed


def _resume(ckpt, out, refused_out, trainer_out):
    import hf_rtp

    trained = _trainers(ckpt, trainer_out)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    refusals = _refused(model)
    optimizer = _optim().AdamW8bit(_trained(model, TRAINED), lr=1e-2)
    with pytest.raises(hf_rtp.CheckpointError) as refused:  # o_proj's state: saved unquantized, 8-bit here
        hf_rtp.load_training_state(refused_out, model, optimizer)
    optimizer = _optim().AdamW8bit(_trained(model, RESUMED), lr=1e-2)
    scheduler = _scheduler(optimizer)
    hf_rtp.load_training_state(out, model, optimizer, scheduler)
    loaded = _full_state(model, optimizer, RESUMED)
    loaded["scheduler"] = (scheduler.last_epoch, [(type(x).__name__, float(x)) for x in scheduler.get_last_lr()])
    _synthetic_step(model, optimizer, in_turn=True)
    return str(refused.value), loaded, _full_state(model, optimizer, RESUMED), refusals, trained


def test_torchao_adamw8bit_on_rotated_rows_steps_like_vanilla_ddp_saves_and_resumes_at_another_world_size(
    tmp_path, monkeypatch
):
    """3 ranks (uneven rows, o_proj unaligned) against vanilla; their training state resumed by 2 ranks exactly,
    and where 2 ranks keep a parameter's state otherwise (o_proj: 8-bit), refused by name. The 2 ranks are new
    interpreters with torchao on their path from the start, as transformers' Trainer looks for it at import,
    and also train with Trainer(optim="adamw_torch_8bit") beside vanilla."""
    ckpt, out, other = make_tiny("llama", tmp_path / "ckpt", **CONFIG), str(tmp_path / "s"), str(tmp_path / "o")
    results = run_on_ranks(_steps, 3, ckpt, out, other, env=COMPILING)
    for rank, (unequal, kinds, warned, _, _) in enumerate(results):
        assert unequal == [], (rank, unequal)
        for name, (mine, theirs) in kinds.items():
            assert mine == theirs, (name, mine, theirs)
        # q_proj: 8-bit as vanilla's whole 8192 elements, though a rank holds 2816; o_proj: unaligned at 3
        assert kinds[TRAINED[0]][0] == "torch.uint8"
        assert kinds[TRAINED[1]][0] == "torch.float32" and kinds[TRAINED[2]][0] == "torch.float32"
        if rank == 0:
            assert len(warned) == 1 and "the rows of 1 rotated parameter(s) (shapes (128, 64))" in warned[0], warned
        else:
            assert warned == []  # rank 0 speaks for all
    saved, stepped = results[0][3:]
    assert saved[f"{TRAINED[0]}.exp_avg"].dtype == numpy.uint8 and saved[f"{TRAINED[0]}.step"] == 2
    assert saved[f"{TRAINED[0]}.exp_avg_scale"].dtype == numpy.float32
    if os.path.isdir(TORCHAO):
        monkeypatch.syspath_prepend(os.path.abspath(TORCHAO))  # a spawned rank starts with this process's path
    trainer_out = str(tmp_path / "trainer")
    for message, loaded, resumed, (refusals, untouched), trained in run_on_ranks(
        _resume, 2, ckpt, out, other, trainer_out, env=COMPILING, fresh=True
    ):
        vanilla, ours, resumed_losses = trained
        assert ours == pytest.approx(vanilla, rel=1e-5), (ours, vanilla)
        assert resumed_losses[-2:] == ours[2:]  # steps 3 and 4 again, from checkpoint-2: exact
        (four_bit, states), (rounding, rounding_states), (closure, closure_states) = refusals
        assert "torchao's AdamW4bit over a rotated model" in four_bit and "AdamW8bit and Adam8bit" in four_bit, four_bit
        assert "bf16_stochastic_round=True" in rounding, rounding
        assert "step(closure)" in closure, closure
        assert untouched and states == rounding_states == closure_states == 0
        assert "in another form than this run keeps it" in message and "saved at (3)" in message, message
        assert TRAINED[1] in message, message
        assert loaded.pop("scheduler") == (2, [("Tensor", saved["lr"][1])])
        assert saved["lr"] == ("Tensor", pytest.approx(1e-2 / 3))  # torchao refuses to step with a float lr
        assert sorted(k for k in saved if not numpy.array_equal(saved[k], loaded[k])) == []
        assert sorted(k for k in stepped if not numpy.array_equal(stepped[k], resumed[k])) == []
