"""bitsandbytes' 8-bit optimizers on rotated rows, against vanilla DDP with the same optimizer in the same processes.

Each rank steps only its rows. Where those rows start on one of bitsandbytes' 256-element blocks, the weights,
the uint8 state and its block scales must equal vanilla's bit for bit; where they cannot (at 3 ranks, most of
this model's rows), hf_rtp keeps that parameter's state in float32 and says so, which must then equal vanilla
with optim_bits=32 for exactly those parameters. Whether a parameter gets 8-bit state follows its global
size, as vanilla's does. The gradients are vanilla's (copied in after hf_rtp's own backward, which is checked
against them first), so that any difference is the optimizer's, not summation order."""

import logging
import os

import numpy
import pytest
import torch
from support.compare import hf_rtp_records, rows, take_vanilla_grads
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytest.importorskip("bitsandbytes")

WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16)  # 8-bit state for q_proj, MLP, embeddings
MIN_8BIT = 4096  # bitsandbytes' min_8bit_size default


def _unaligned(shape, world):
    """The parameters whose rows some rank starts off a 256-element block (the test's own oracle)."""
    per_row = torch.Size(shape[1:]).numel()
    return any(rows(torch.empty(shape[0]), world, r).start * per_row % 256 for r in range(world))


def _steps(ckpt, optimizer_name, steps=3):
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    records = hf_rtp_records()
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    vanilla = DistributedDataParallel(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train())
    ref = dict(vanilla.module.named_parameters())
    fallback = {n for n, p in model.named_parameters() if isinstance(p, DTensor) and p.numel() >= MIN_8BIT
                and _unaligned(p.shape, world)}  # fmt: skip
    manager = bnb.optim.GlobalOptimManager.get_instance()
    for name in fallback:
        manager.override_config(ref[name], "optim_bits", 32)  # what hf_rtp says it does for them
    kind = getattr(bnb.optim, optimizer_name)
    ours, theirs = kind(model.parameters(), lr=1e-2), kind(vanilla.parameters(), lr=1e-2)
    batch = global_batch(world)[rank]
    for _ in range(steps):
        ours.zero_grad(), theirs.zero_grad()
        vanilla(input_ids=batch, labels=batch).loss.backward()
        model(input_ids=batch, labels=batch).loss.backward()
        hf_rtp.sync_grads(model)
        take_vanilla_grads(model, ref, world, rank)
        ours.step(), theirs.step()
    unequal, kinds = [], {}
    for name, p in model.named_parameters():
        here = slice(None) if not isinstance(p, DTensor) else rows(p, world, rank)
        local = p.to_local() if isinstance(p, DTensor) else p
        if not torch.equal(local.detach(), ref[name].detach()[here]):
            unequal.append(f"weight of {name}")
        state, want = ours.state[p], theirs.state[ref[name]]
        kinds[name] = (state["state1"].dtype, want["state1"].dtype)
        for key in [k for k in ("state1", "state2") if k in want]:  # Lion keeps one moment
            mine = state[key].to_local() if isinstance(p, DTensor) else state[key]
            if not torch.equal(mine, want[key][here]):
                unequal.append(f"{key} of {name}")
        if "absmax1" in want and isinstance(p, DTensor):
            per_row = p[0].numel()
            first, count = here.start * per_row // 256, -(-local.numel() // 256)
            for key in [k for k in ("absmax1", "absmax2") if k in want]:
                mine = state[key].to_local().reshape(-1)[:count]
                if not torch.equal(mine, want[key][first : first + count]):
                    unequal.append(f"{key} of {name}")
    warned = [r.getMessage() for r in records if r.levelno == logging.WARNING and "float32" in r.getMessage()]
    # hf_rtp's step hook left the vanilla optimizer in the same process alone: plain state, whole-tensor scales
    for p in vanilla.parameters():
        state = theirs.state[p]
        assert not any(isinstance(v, DTensor) for v in state.values())
        assert "absmax1" not in state or state["absmax1"].shape == (-(-p.numel() // 256),)
    return unequal, kinds, sorted(fallback), warned


# AdamW8bit at 3 ranks (uneven rows, most of them unaligned); Lion8bit (one moment) at 2, where q_proj's rows hold
# 2048 of its 4096 elements
@pytest.mark.parametrize(("world", "optimizer"), [(3, "AdamW8bit"), (2, "Lion8bit")])
def test_8bit_optimizers_on_rotated_rows_step_bit_equal_to_vanilla_ddp(tmp_path, world, optimizer):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for rank, (unequal, kinds, fallback, warned) in enumerate(run_on_ranks(_steps, world, ckpt, optimizer)):
        assert unequal == [], (rank, unequal)
        for name, (mine, theirs) in kinds.items():
            assert mine == theirs, (name, mine, theirs)  # 8-bit where vanilla is; float32 where it falls back
        # the choice follows the global size: q_proj has 4096 elements, a rank's rows only 4096 / world
        assert kinds["model.layers.0.self_attn.q_proj.weight"][0] == (
            torch.float32 if "model.layers.0.self_attn.q_proj.weight" in fallback else torch.uint8
        )
        assert kinds["model.layers.0.self_attn.k_proj.weight"][0] == torch.float32  # 2048 elements: vanilla's too
        assert kinds["model.layers.0.mlp.down_proj.weight"][0] == torch.uint8  # rows of 128: aligned at 2 and 3
        if world == 2:
            assert fallback == ["lm_head.weight", "model.embed_tokens.weight"], fallback  # 101 rows: 51 * 64 % 256
        else:
            assert "model.layers.0.mlp.up_proj.weight" in fallback, fallback  # 43 * 64 % 256
        if rank == 0:
            assert len(warned) == 1 and f"the rows of {len(fallback)} rotated parameter(s)" in warned[0], warned
        else:
            assert warned == []  # rank 0 speaks for all


ALIGNED = dict(hidden_size=256, intermediate_size=512, head_dim=64)  # rows of 256 or 512: aligned at any world size


def _full_state(model, optimizer):
    """Every parameter and its optimizer state, whole (collective), by name; numpy arrays, which a rank's result
    queue pickles by value (a tensor would go through shared memory that dies with the rank)."""
    from torch.distributed.tensor import DTensor

    whole = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            state = optimizer.state[p]
            kept = [(k, state[k]) for k in ("state1", "state2", "absmax1", "absmax2") if k in state]
            for key, value in [("weight", p), *kept]:
                value = value.full_tensor() if isinstance(value, DTensor) else value
                whole[f"{name}.{key}"] = value.detach().reshape(-1).numpy().copy()  # the scales' shape is hf_rtp's
            whole[f"{name}.step"] = state["step"]
    return whole


def _synthetic_step(model, optimizer):
    """One step from the same global gradients at any world size: each rank its rows of a seeded tensor."""
    from torch.distributed.tensor import DTensor

    for index, (_, p) in enumerate(model.named_parameters()):
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(index)) * 1e-2
        if isinstance(p, DTensor):
            p.grad.to_local().copy_(grad[rows(p, p.device_mesh.size(), p.device_mesh.get_local_rank())])
        else:
            p.grad.copy_(grad)
    optimizer.step()


def _save(ckpt, out):
    import bitsandbytes as bnb

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    batch = global_batch(world)[rank]
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        hf_rtp.sync_grads(model)
        optimizer.step()
    hf_rtp.save_training_state(out, model, optimizer)
    saved = _full_state(model, optimizer)
    _synthetic_step(model, optimizer)
    return saved, _full_state(model, optimizer)


def _resume(ckpt, out):
    import bitsandbytes as bnb

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    hf_rtp.load_training_state(out, model, optimizer)
    loaded = _full_state(model, optimizer)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    _synthetic_step(model, optimizer)
    return loaded, _full_state(model, optimizer)


def _differences(ours, theirs):
    assert set(ours) == set(theirs)
    return sorted(k for k in ours if not numpy.array_equal(ours[k], theirs[k]))


def test_8bit_state_saves_and_resumes_exactly_at_another_world_size(tmp_path):
    """Saved by 2 ranks, resumed by 3 (at the same world size, the Trainer test below resumes exactly)."""
    ckpt, out = make_tiny("llama", tmp_path / "ckpt", **ALIGNED), str(tmp_path / "state")
    saved, stepped = run_on_ranks(_save, 2, ckpt, out)[0]
    assert saved["model.layers.0.mlp.up_proj.weight.state1"].dtype == numpy.uint8
    assert saved["model.layers.0.mlp.up_proj.weight.step"] == 2
    for loaded, resumed in run_on_ranks(_resume, 3, ckpt, out):
        assert _differences(loaded, saved) == []
        assert _differences(resumed, stepped) == []


def _resume_refused(ckpt, out):
    import hf_rtp

    with pytest.raises(hf_rtp.CheckpointError) as refused:
        _resume(ckpt, out)
    return str(refused.value)


def test_8bit_state_is_refused_by_name_where_another_world_size_keeps_it_otherwise(tmp_path):
    # at 2 ranks the MLP rows of 64 align and keep 8-bit state; at 3 (43 rows each) they cannot: float32 state
    ckpt, out = make_tiny("llama", tmp_path / "ckpt", **WIDE), str(tmp_path / "state")
    run_on_ranks(_save, 2, ckpt, out)
    for message in run_on_ranks(_resume_refused, 3, ckpt, out):
        assert "8-bit optimizer state (bitsandbytes' or torchao's) in another form" in message, message
        assert "saved at (2)" in message, message


def _trainer(model, out, optim, save_steps=2):
    from test_trainer import Tokens
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out,
        optim=optim,
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=save_steps,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=Tokens(32, 3))


def _trained(ckpt, out):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    def losses(trainer):
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    def state_kinds(trainer):
        optimizer = trainer.optimizer.optimizer
        return {n: optimizer.state[p]["state1"].dtype for n, p in trainer.model.named_parameters()}

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    vanilla = _trainer(base, f"{out}/vanilla", "adamw_bnb_8bit")
    vanilla.train()
    ours = _trainer(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), f"{out}/ours", "adamw_bnb_8bit")
    ours.train()
    weights = _full_state(ours.model, ours.optimizer.optimizer)
    resumed = _trainer(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), f"{out}/ours", "adamw_bnb_8bit")
    resumed.train(resume_from_checkpoint=f"{out}/ours/checkpoint-2")
    paged = _trainer(hf_rtp.from_pretrained(ckpt, dtype=torch.float32), f"{out}/paged", "paged_adamw_8bit", 10)
    paged.train()
    kinds = state_kinds(ours)
    same_kinds = kinds == {n.removeprefix("module."): k for n, k in state_kinds(vanilla).items()}
    return (losses(vanilla), losses(ours), losses(resumed), kinds, same_kinds, paged.optimizer.optimizer.is_paged,
            _differences(_full_state(paged.model, paged.optimizer.optimizer), weights))  # fmt: skip


def test_trainer_optim_adamw_bnb_8bit_trains_like_vanilla_and_resumes_exactly(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **ALIGNED)
    vanilla, ours, resumed, kinds, same_kinds, paged, paged_differences = run_on_ranks(
        _trained, 2, ckpt, str(tmp_path)
    )[0]
    assert kinds["model.layers.0.mlp.up_proj.weight"] == torch.uint8
    assert kinds["model.embed_tokens.weight"] == torch.float32  # Trainer keeps embeddings' state 32-bit, as vanilla
    assert same_kinds
    assert ours == pytest.approx(vanilla, rel=1e-4), (ours, vanilla)
    assert resumed[-2:] == ours[2:]  # steps 3 and 4 again, from checkpoint-2: exact
    assert paged and paged_differences == []  # on CPU bitsandbytes does not page: the same steps


def _refused(ckpt, name, options):
    import bitsandbytes as bnb

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = getattr(bnb.optim, name)(model.parameters(), lr=1e-2, **options)
    batch = global_batch(2)[int(os.environ["RANK"])]
    model(input_ids=batch, labels=batch).loss.backward()
    hf_rtp.sync_grads(model)  # as a plain loop must: the refusal is LAMB's, not the unaveraged norms'
    with pytest.raises(hf_rtp.RotatedStateError) as refused:
        optimizer.step()
    untouched = all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    return str(refused.value), untouched, len(optimizer.state)


@pytest.mark.parametrize(
    "name, options, shape, said",
    [
        ("LAMB8bit", {}, WIDE, "LAMB8bit bounds each update by the whole parameter's norm (max_unorm"),
        # its two EMAs in one (2, *shape) tensor, sized by the whole parameter: its update met the rows and crashed
        ("AdEMAMix", {}, WIDE, "AdEMAMix keeps its state 'state1' for the whole parameter ((2, "),
        # 8-bit, and at 2 ranks no row aligns on a block: refused before its state would be made float32 rows
        ("AdEMAMix8bit", {"min_8bit_size": 1}, dict(hidden_size=24), "AdEMAMix8bit keeps its state 'state1'"),
    ],
    ids=["LAMB8bit", "AdEMAMix", "AdEMAMix8bit-unaligned"],
)
def test_an_optimizer_that_needs_the_whole_parameter_is_refused_before_any_row_steps(
    tmp_path, name, options, shape, said
):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **shape)
    for message, untouched, states in run_on_ranks(_refused, 2, ckpt, name, options):
        assert said in message, message
        assert untouched and states == 0


def _bf16_steps(ckpt):
    """Three AdamW8bit steps on bf16 weights from the same global gradients, against one vanilla model stepped
    whole in this process: this rank's rows equal it bit for bit."""
    import bitsandbytes as bnb
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.bfloat16).train()
    whole = dict(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).named_parameters())
    ours = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
    theirs = bnb.optim.AdamW8bit(whole.values(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(3):
        _synthetic_step(model, ours)
        for index, p in enumerate(whole.values()):  # the same seeded gradients, whole
            p.grad = (torch.randn(p.shape, generator=torch.Generator().manual_seed(index)) * 1e-2).to(p.dtype)
        theirs.step()
    unequal = []
    for name, p in model.named_parameters():
        mine = p.to_local() if isinstance(p, DTensor) else p.detach()
        want = whole[name].detach()
        want = want[rows(p, p.device_mesh.size(), p.device_mesh.get_local_rank())] if isinstance(p, DTensor) else want
        if not torch.equal(mine, want):
            unequal.append(name)
    return unequal, ours.state[model.model.layers[0].mlp.up_proj.weight]["state1"].dtype


def test_8bit_adamw_on_bf16_rotated_rows_equals_a_whole_vanilla_step(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **ALIGNED)
    for unequal, kind in run_on_ranks(_bf16_steps, 3, ckpt):
        assert unequal == [] and kind == torch.uint8, unequal
