"""Context parallelism: one sequence across the ring, against vanilla transformers on the whole sequence.

Every rank gets the same batch and `hf_rtp.context_parallel(model, batch)` cuts it (chunks r and 2N-1-r
of 2N). The loss must be vanilla's over the whole sequence on every rank, every gradient vanilla's, and
an AdamW step vanilla's, in float64, at 2 and 3 ranks, with sequence lengths that are not multiples of 2N
(uneven chunks) and label masks (a prompt) so the count of label tokens differs between ranks.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from support.compare import (
    GRAD_ATOL,
    GRAD_RTOL,
    STEP_ATOL,
    adamw,
    assert_matches,
    grad_gaps_rows,
    rows,
    trainable_grad_gaps,
    vanilla_training_path,
)
from support.models import VOCAB, make_tiny
from support.spawn import run_on_ranks


def _batch(seq: int, batch: int = 2, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt: its tokens carry no loss
    labels[-1, -2:] = -100
    return {"input_ids": ids, "labels": labels}


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # the same adapters on both: B not zero, so every adapter has a gradient
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False))


def _against_vanilla(ckpt, seq, checkpointing, piece="16MB", variant="plain"):
    """One training step of hf_rtp under context parallelism beside vanilla's on the whole sequence.

    variant: "plain" (float64), "padded" (right padding, its labels -100, and its attention_mask), "packed"
    (documents packed in a row, position_ids restarting, rows packed differently: each attends within its own),
    "lora" (PEFT adapters), "unfused" (fused_loss=False: each rank's logits), "tiled" (each MLP over
    tiles of 3 of the rank's tokens; "qlora-tiled" on a QLoRA base, a rank's last tile empty),
    "autocast" (float32 weights, bf16 autocast: bf16 partial outputs, so bf16-sized gaps), "qlora" (an NF4
    base from quantization_config with float32 LoRA adapters; vanilla on its training path)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp

    dtype = torch.float64 if variant in ("plain", "padded", "packed", "lora", "unfused", "tiled") else torch.float32
    options: dict = dict(dtype=dtype, attn_implementation="sdpa")
    if "mixtral" in ckpt:
        options["experts_implementation"] = "eager"  # grouped_mm has no float64 kernel
    if variant in ("qlora", "qlora-tiled"):
        from transformers import BitsAndBytesConfig

        options["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    extra = {"fused_loss": False} if variant == "unfused" else {}
    if variant in ("tiled", "qlora-tiled"):  # the MLPs over tiles of 3 of the rank's tokens (model/tiled_mlp.py)
        extra = {"tiled_mlp": 3}
    model = hf_rtp.from_pretrained(ckpt, rotation_piece_size=piece, **extra, **options).train()
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = vanilla_training_path(AutoModelForCausalLM.from_pretrained(ckpt, **options)).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
        ref.gradient_checkpointing_enable()
    if variant in ("lora", "qlora", "qlora-tiled"):
        model, ref = _lora(model), _lora(ref)
    optimizers = adamw(model, ref)
    batch = _batch(seq)
    if variant == "padded":  # what a collator pads a shorter sequence with: zeros in the mask, -100 in the labels
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][1, -4:] = 0
        batch["labels"][1, -4:] = -100
    if variant == "packed":  # padding-free packing: position_ids restart at each document, rows packed unlike
        starts = ([0, 3, 8], [0, 6])
        batch["position_ids"] = torch.stack(
            [torch.cat([torch.arange(b - a) for a, b in zip(s, [*s[1:], seq], strict=True)]) for s in starts]
        )
        batch["use_cache"] = False  # transformers separates packed documents only in a forward without a cache
    given = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    tiles: list[int] = []  # "tiled": the first layer's down_proj, called once per tile
    if variant in ("tiled", "qlora-tiled"):
        down = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.down_proj"))
        down.register_forward_hook(lambda *_: tiles.append(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast"):
        with hf_rtp.context_parallel(model, batch):
            assert batch["input_ids"].shape[1] < seq  # this rank's chunks, inside the block
            loss = model(**batch).loss
            # 2 rows of the rank's 6 or 7 (5 or 4) tokens: every rank cuts as many tiles of 3 as the longest needs
            assert "tiled" not in variant or len(tiles) == -(-2 * -(-seq // world) // 3), (tiles, seq, world)
            loss.backward()
        ref_loss = ref(**given).loss
        ref_loss.backward()
    assert all(not torch.is_tensor(v) or torch.equal(batch[k], v) for k, v in given.items())  # put back
    assert set(batch) == set(given)
    hf_rtp.sync_grads(model)
    if variant == "autocast":  # bf16 partial outputs merged in float32, where vanilla rounds once
        torch.testing.assert_close(loss, ref_loss, atol=2e-3, rtol=2e-3)
        gaps = grad_gaps_rows(model, ref, world, rank)
        assert all(gap <= 2e-3 + 5e-2 * scale for gap, scale in gaps.values()), gaps
        return loss.item()
    torch.testing.assert_close(loss, ref_loss, atol=1e-7, rtol=1e-6)  # the fused loss sums in float32
    if variant in ("qlora", "qlora-tiled"):
        gaps = trainable_grad_gaps(model, ref)
        assert sum("lora_A" in n for n in gaps) == 10 and all(s > 0 for _, s in gaps.values())
        assert all(gap <= 1e-7 + 1e-5 * scale for gap, scale in gaps.values()), gaps
        return loss.item()
    assert_matches(model, ref, world, rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL, trainable=True)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    assert_matches(model, ref, world, rank, "param", atol=STEP_ATOL)
    return loss.item()


@pytest.mark.parametrize(
    "world,seq,checkpointing,piece",
    [(2, 11, False, "16MB"), (3, 13, True, "16MB"), (2, 4, True, "16MB"), (3, 17, False, "1KB")],
    ids=["2ranks-11tokens", "3ranks-13tokens-checkpointing", "2ranks-one-token-per-chunk", "3ranks-kv-in-pieces"],
)
def test_one_sequence_across_the_ring_is_vanillas(tmp_path, world, seq, checkpointing, piece):
    """GQA (2 K/V heads for 4 query heads) and linear RoPE scaling on global positions. With 1 KB pieces the
    K/V blocks walk the ring two tokens at a time, so a block's keys start inside a chunk of queries."""
    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ckpt = make_tiny("llama", tmp_path / "ckpt", rope_parameters=rope)
    losses = run_on_ranks(_against_vanilla, world, ckpt, seq, checkpointing, piece)
    assert len(set(losses)) == 1  # every rank reports the sequence's loss


@pytest.mark.parametrize(
    "arch,world,seq,variant,checkpointing",
    [
        ("llama", 2, 11, "lora", True),
        ("llama", 3, 13, "padded", False),
        ("llama", 3, 13, "packed", True),
        ("llama", 3, 10, "unfused", False),
        ("llama", 2, 13, "autocast", True),
        ("llama", 2, 11, "qlora", True),
        ("llama", 2, 13, "tiled", True),
        ("qwen2", 3, 14, "tiled", False),
        ("llama", 2, 13, "qlora-tiled", True),
        ("mixtral", 2, 9, "plain", False),
        ("qwen2", 3, 14, "plain", True),
        ("gpt2", 2, 11, "plain", False),
    ],
    ids=lambda v: str(v),
)
def test_the_configurations_beside_it(tmp_path, arch, world, seq, variant, checkpointing):
    """LoRA, right padding at 3 ranks, each rank's own logits (fused_loss=False), bf16 autocast, QLoRA with
    checkpointing, Mixtral's
    experts (router aux loss off: see the refusals), Qwen2's q/k/v biases, GPT-2's learned positions."""
    overrides = {"output_router_logits": False} if arch == "mixtral" else {}
    if "qlora" in variant:  # rows of 64 values: each rank's rows quantize as the whole weight does
        overrides.update(hidden_size=64, intermediate_size=128, head_dim=16)
    ckpt = make_tiny(arch, tmp_path / arch, **overrides)
    losses = run_on_ranks(_against_vanilla, world, ckpt, seq, checkpointing, "16MB", variant)
    assert len(set(losses)) == 1


def _refusals(llama, qwen_window, mixtral_aux):
    import torch.distributed as dist

    import hf_rtp

    model = hf_rtp.from_pretrained(llama, dtype=torch.float64, attn_implementation="sdpa").train()
    rank = dist.get_rank()
    seen = {}

    def refused(batch, match, error=hf_rtp.SettingError, target=None):
        with pytest.raises(error, match=match), hf_rtp.context_parallel(target or model, batch):
            (target or model)(**batch).loss.backward()
        assert (target or model).config._attn_implementation == "sdpa"  # set back after a refused block
        seen[match] = True

    padded = _batch(11)
    padded["attention_mask"] = torch.ones_like(padded["input_ids"])
    padded["attention_mask"][0, -3:] = 0  # right padding whose tokens keep their labels
    refused(padded, "padding tokens carry labels")
    padded["labels"][0, -3:] = -100
    padded["attention_mask"][0, :2] = 0  # and left padding
    refused(padded, "right padding only")
    cached = _batch(11)
    cached["use_cache"] = True
    refused(cached, "keeps no cache")
    # the last positions a rank keeps are its own chunks', not the sequence's: logits of other tokens, same shape
    refused({**_batch(11), "logits_to_keep": 1}, "logits_to_keep=1: a rank holds two chunks")
    refused({**_batch(11), "logits_to_keep": True}, "logits_to_keep=True")  # transformers reads True as 1
    refused(_batch(11, seed=3 + rank), "different tokens")  # a plain loop that gave ranks their own data
    refused(_batch(11 + rank), "different sequences")

    with pytest.raises(hf_rtp.HfRtpError, match="but not its backward"):
        batch = _batch(11)
        with hf_rtp.context_parallel(model, batch):
            loss = model(**batch).loss  # and loss.backward() after the block, where it would be wrong
    assert loss.requires_grad
    with pytest.raises(hf_rtp.SettingError, match="generate"):
        batch = _batch(11)
        with hf_rtp.context_parallel(model, batch):
            model.generate(batch["input_ids"], max_new_tokens=2)

    dropout = hf_rtp.from_pretrained(llama, dtype=torch.float64, attention_dropout=0.1).train()
    refused(_batch(11), "attention dropout", target=dropout)
    eager = hf_rtp.from_pretrained(llama, dtype=torch.float64, attn_implementation="eager").train()
    with (
        pytest.raises(hf_rtp.SettingError, match="attn_implementation='sdpa'"),
        hf_rtp.context_parallel(eager, {**_batch(11)}),
    ):
        pass
    window = hf_rtp.from_pretrained(qwen_window, dtype=torch.float64, attn_implementation="sdpa").train()
    refused(_batch(11), "sliding window of 4 tokens", target=window)
    aux = hf_rtp.from_pretrained(mixtral_aux, dtype=torch.float64, experts_implementation="eager").train()
    refused(_batch(11), "output_router_logits", target=aux)

    custom = hf_rtp.from_pretrained(llama, dtype=torch.float64, attn_implementation="sdpa").train()
    layer = custom.model.layers[1].self_attn  # a user's own attention that calls SDPA itself: each rank's chunks

    def own_attention(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        q = layer.q_proj(hidden_states).unflatten(-1, (-1, layer.head_dim)).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return layer.o_proj(out.transpose(1, 2).flatten(2)), None

    layer.forward = own_attention
    refused(_batch(11), "1 of its 2 layers' attention went through", target=custom)
    with hf_rtp.context_parallel(model, _batch(11)), pytest.raises(hf_rtp.SettingError, match="do not nest"):
        hf_rtp.context_parallel(model, _batch(11)).__enter__()

    classifier = hf_rtp.AutoModelForSequenceClassification.from_pretrained(llama, dtype=torch.float64, num_labels=2)
    with pytest.raises(hf_rtp.SettingError, match="for causal language models"):
        hf_rtp.context_parallel(classifier, _batch(11)).__enter__()

    batch = _batch(11)  # after every refusal the ring still trains
    with hf_rtp.context_parallel(model, batch):
        loss = model(**batch).loss
        loss.backward()
        with torch.no_grad():  # input_ids passed by position, as vanilla accepts them: the same loss
            rest = {k: v for k, v in batch.items() if k != "input_ids"}
            assert torch.equal(model(batch["input_ids"], **rest).loss, loss.detach())
    with torch.no_grad():  # outside a block the model is an ordinary rotated model again
        plain = model(**_batch(11)).loss
    return len(seen), loss.item(), plain.item()


def test_what_it_does_not_compute_is_refused_on_every_rank_by_name(tmp_path):
    """Padding, packing, ranks given different sequences, a backward left outside the block, generate,
    logits_to_keep, attention dropout, eager attention, a sliding window shorter than the sequence, the router's
    aux loss."""
    llama = make_tiny("llama", tmp_path / "llama")
    window = make_tiny("qwen2", tmp_path / "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    mixtral = make_tiny("mixtral", tmp_path / "mixtral")
    results = run_on_ranks(_refusals, 2, llama, window, mixtral)
    assert [r[0] for r in results] == [11, 11]
    assert results[0][1] == results[1][1]


def _accelerate_loop(ckpt, cp_size, world):
    import torch.distributed as dist
    from accelerate import ParallelismConfig
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    import hf_rtp

    replicas = world // cp_size
    with pytest.raises(hf_rtp.SettingError, match="tp_size=2 shards the model another way"):
        hf_rtp.Accelerator(parallelism_config=ParallelismConfig(tp_size=2, cp_size=world // 2))
    config = ParallelismConfig(cp_size=cp_size, dp_shard_size=replicas)  # accelerate refuses cp with dp_replicate
    accelerator = hf_rtp.Accelerator(parallelism_config=config)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa", rtp_size=cp_size).train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa").train()
    sequences = [{k: v[0] for k, v in _batch(11, batch=1, seed=s).items()} for s in range(3 * replicas)]
    optimizer, ref_optimizer = adamw(model, ref)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(sequences, batch_size=1))
    losses = []
    for batch in loader:
        # what Trainer adds before it hands the buffers to maybe_context_parallel
        batch["shift_labels"] = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
        batch["position_ids"] = torch.arange(11).unsqueeze(0).contiguous()
        given = {k: v.clone() for k, v in batch.items()}
        buffers = [batch[k] for k in ("input_ids", "labels", "shift_labels", "position_ids")]
        with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1] * 4, no_restore_buffers=set()):
            loss = model(**batch).loss
            accelerator.backward(loss)
        assert torch.equal(batch["input_ids"], given["input_ids"])  # restored: not in no_restore_buffers
        everyone: list = [None] * world  # vanilla trains every replica's sequence: DDP's mean over replicas
        dist.all_gather_object(everyone, given)
        ref_losses = [ref(input_ids=b["input_ids"], labels=b["labels"]).loss for b in everyone[::cp_size]]
        torch.stack(ref_losses).mean().backward()
        topology = hf_rtp.state_of(model).topology
        # every gradient before the step (AdamW's step would hide a gradient off by a constant factor)
        unwrapped = accelerator.unwrap_model(model)
        assert_matches(unwrapped, ref, topology.rtp_size, topology.rtp_rank, "grad", atol=GRAD_ATOL, rtol=GRAD_RTOL)
        for o in (optimizer, ref_optimizer):
            o.step()
            o.zero_grad()
        assert all(
            torch.equal(b["input_ids"], given["input_ids"])
            for b in everyone[dist.get_rank() // cp_size * cp_size :][:cp_size]
        )
        torch.testing.assert_close(loss, ref_losses[dist.get_rank() // cp_size], atol=1e-7, rtol=1e-6)
        losses.append(loss.item())
    assert_matches(accelerator.unwrap_model(model), ref, topology.rtp_size, topology.rtp_rank, "param", atol=STEP_ATOL)
    if replicas > 1:  # a flat ring of every rank under cp_size=2: refused by name, not trained on the wrong groups
        flat = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa")
        with pytest.raises(hf_rtp.SettingError, match="so cp_size must equal it"):
            accelerator.prepare(flat)
    return losses


@pytest.mark.parametrize("world,cp_size", [(2, 2), (4, 2)], ids=["one-ring", "two-rings-of-2"])
def test_accelerate_parallelism_config_cp_size_trains_as_vanilla_on_the_cpu(tmp_path, world, cp_size):
    """`hf_rtp.Accelerator(parallelism_config=ParallelismConfig(cp_size=2, dp_shard_size=...))`, accepted on
    MULTI_CPU for hf_rtp's own Accelerator. accelerate's DataLoader gives the ranks of a ring the same sequence
    (checked by hf_rtp at each step) and the rings of a 2-D grid their own; three steps equal vanilla's."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    losses = run_on_ranks(_accelerate_loop, world, ckpt, cp_size, world)
    assert all(len(r) == 3 for r in losses) and losses[0] == losses[1]


class _Sequences(torch.utils.data.Dataset):
    def __init__(self, n, seq):
        self.items = [{k: v[0] for k, v in _batch(seq, batch=1, seed=s).items()} for s in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


# one logged optimizer step, unclipped: clipping would hide a gradient off by a constant factor
_ONE_STEP = dict(
    max_steps=1,
    per_device_train_batch_size=1,
    learning_rate=1e-2,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    logging_steps=1,
    save_strategy="no",
    max_grad_norm=0.0,
)


def _trainer_step(ckpt, out, through_arguments, trl=None, packing=False):
    """One Trainer step (`trl`: TRL's SFTTrainer, or another TRL trainer, refused) under context parallelism,
    beside vanilla's step on the sequence the sampler drew."""
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import hf_rtp

    config = ParallelismConfig(cp_size=2)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa")
    options: dict = {}
    if trl:
        import trl as trl_library
        from datasets import Dataset
        from support.models import tiny_tokenizer

        TrainingArguments = getattr(trl_library, trl.replace("Trainer", "Config"))  # TRL's arguments class
        options = dict(max_length=16, bf16=False)
        if packing:  # padding-free packing: documents end to end in a row, position_ids restarting
            options.update(packing=True, padding_free=True, max_length=32)
    args = TrainingArguments(
        **options, **_ONE_STEP, output_dir=out, parallelism_config=config if through_arguments else None
    )
    if not through_arguments:  # after TrainingArguments, which resets accelerate's shared state
        hf_rtp.Accelerator(parallelism_config=config)  # which then carries a config accelerate accepted

    class Losses(TrainerCallback):
        seen: ClassVar[list] = []
        grads: ClassVar[dict] = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.seen.append(logs["loss"])

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    data = _Sequences(2, 11)
    if trl:
        trainer_class = getattr(trl_library, trl)
        extra: dict = {"processing_class": tiny_tokenizer()}
        if trl == "SFTTrainer":
            dataset = Dataset.from_dict({"input_ids": [item["input_ids"].tolist() for item in data.items]})
        else:  # refused before any data is read
            dataset = Dataset.from_dict({"prompt": ["t3 t4"], "chosen": ["t5"], "rejected": ["t6"]})
        trainer = trainer_class(model=model, args=args, train_dataset=dataset, callbacks=[Losses()], **extra)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Losses()])
    assert trainer.get_cp_size() == 2 and trainer.accelerator.parallelism_config.cp_enabled
    trainer.train()
    (logged,) = Losses.seen
    # vanilla's step on whichever sequence Trainer's sampler drew (both ranks drew the same: hf_rtp checks)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa").train()
    if trl:  # what SFTTrainer's tokenization and collator made of each sequence (EOS appended, its labels)
        made = [trainer.data_collator([trainer.train_dataset[i]]) for i in range(len(trainer.train_dataset))]
        keep = ("input_ids", "labels", "attention_mask", "position_ids")
        data.items = [{k: v[0] for k, v in batch.items() if k in keep} for batch in made]
    with torch.no_grad():
        # no cache, as TRL's forwards: transformers then separates packed documents
        candidates = [ref(**{k: v[None] for k, v in item.items()}, use_cache=False).loss.item() for item in data.items]
    drawn = min(range(len(candidates)), key=lambda i: abs(candidates[i] - logged))
    assert abs(candidates[drawn] - logged) < 1e-6, (logged, candidates)
    ref(**{k: v[None] for k, v in data.items[drawn].items()}, use_cache=False).loss.backward()
    topology = hf_rtp.state_of(model).topology
    for name, grad in Losses.grads.items():  # what Trainer's optimizer stepped with: DDP's, the ring's
        want = ref.get_parameter(name).grad
        if hasattr(grad, "to_local"):
            grad, want = grad.to_local(), want[rows(grad, topology.rtp_size, topology.rtp_rank)]
        torch.testing.assert_close(grad, want, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m, n=name: f"{n}: {m}")
    assert len(Losses.grads) == len(list(ref.parameters()))
    return logged


def test_trainer_with_cp_size_trains_as_vanilla_where_accelerate_accepts_it(tmp_path):
    """On the CPU accelerate 1.15 refuses TrainingArguments(parallelism_config=...) before hf_rtp sees the
    Trainer; built after hf_rtp.Accelerator(parallelism_config=...), Trainer's own accelerator shares the
    config accelerate accepted, and Trainer's context-parallel path (position_ids, shift_labels, the count
    of label tokens divided by cp_size, the loss times the processes) runs on the ring: vanilla's step."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="ParallelismConfig is only compatible"):
        run_on_ranks(_trainer_step, 2, ckpt, str(tmp_path / "refused"), True, attempts=1)
    logged = run_on_ranks(_trainer_step, 2, ckpt, str(tmp_path / "out"), False)
    assert logged[0] == logged[1]


def test_trl_sft_trainer_with_cp_size_trains_as_vanilla_and_dpo_is_refused(tmp_path):
    """TRL's SFTTrainer runs Trainer's context-parallel path through TRL's fused LM head on the ring; DPOTrainer,
    whose loss sums log-probabilities per sequence (each rank holds part of each), is refused by name."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    logged = run_on_ranks(_trainer_step, 2, ckpt, str(tmp_path / "sft"), False, "SFTTrainer")
    assert logged[0] == logged[1]
    # TRL 1.16 refuses SFTConfig(packing=True) with cp_size > 1 itself (torch's context parallelism drops masks)
    with pytest.raises(RuntimeError, match="Packing is not compatible with context parallelism"):
        run_on_ranks(_trainer_step, 2, ckpt, str(tmp_path / "packed"), False, "SFTTrainer", True, attempts=1)
    with pytest.raises(RuntimeError, match="DPOTrainer is not supported on a rotated model"):
        run_on_ranks(_trainer_step, 2, ckpt, str(tmp_path / "dpo"), False, "DPOTrainer", attempts=1)


def _skip_and_save(ckpt, out):
    import os

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa").train()
    rank = dist.get_rank()
    batch = _batch(11)
    if rank == 0:  # rank 1 skipped this step and went on to a plain forward
        with (
            pytest.raises(hf_rtp.CollectiveMisuseError, match="rank 1: forward"),
            hf_rtp.context_parallel(model, batch),
        ):
            model(**batch).loss.backward()
    else:
        with pytest.raises(hf_rtp.CollectiveMisuseError, match="rank 0: context_parallel"):
            model(**_batch(11))
    batch = _batch(11)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with hf_rtp.context_parallel(model, batch):  # and the ring still trains
        model(**batch).loss.backward()
    hf_rtp.sync_grads(model)  # the replicated norms' mean over ranks, as DDP's
    optimizer.step()
    optimizer.zero_grad()
    # the training state does not depend on context parallelism: resumed, the next step runs without it
    hf_rtp.save_training_state(out + "-state", model, optimizer)
    again = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa").train()
    again_optimizer = torch.optim.AdamW(again.parameters(), lr=1e-2)
    hf_rtp.load_training_state(out + "-state", again, again_optimizer)
    steps = []
    for m, o in ((model, optimizer), (again, again_optimizer)):
        m(**_batch(11, seed=4 + rank)).loss.backward()  # each rank its own data: plain data parallelism
        hf_rtp.sync_grads(m)
        o.step()
        params = m.named_parameters()
        steps.append({n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in params})
    assert all(torch.equal(steps[0][n], steps[1][n]) for n in steps[0])
    model.save_pretrained(out)  # a checkpoint of the ring's rows, whatever the context: vanilla's format
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.state_dict().items()}
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
        assert all(torch.equal(t, full[n]) for n, t in reloaded.state_dict().items())
    return os.path.isdir(out)


def test_a_rank_that_skips_a_step_is_named_at_once_and_the_checkpoint_is_vanillas(tmp_path):
    """A skipped block fails at once, naming each rank's call; after a context-parallel step the training state
    resumes into a step without context parallelism bit for bit, and save_pretrained writes vanilla's files."""
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    assert run_on_ranks(_skip_and_save, 2, ckpt, str(tmp_path / "saved")) == [True, True]


def _trainer_accumulating(ckpt, out):
    """Trainer with gradient_accumulation_steps=2 over two sequences whose label counts differ: one optimizer step
    whose gradient is the mean over both sequences' label tokens (Trainer's num_items_in_batch)."""
    from accelerate import ParallelismConfig
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa")
    args = TrainingArguments(**_ONE_STEP, output_dir=out, gradient_accumulation_steps=2)
    hf_rtp.Accelerator(parallelism_config=ParallelismConfig(cp_size=2))
    data = _Sequences(2, 11)
    for s, item in enumerate(data.items):
        item["labels"] = item["input_ids"].clone()
        item["labels"][: 2 + 3 * s] = -100  # 8 and 5 label tokens after the shift

    class Grads(TrainerCallback):
        seen: ClassVar[dict] = {}
        logged: ClassVar[list] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.seen.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logged.append(logs["loss"])

    Trainer(model=model, args=args, train_dataset=data, callbacks=[Grads()]).train()
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64, attn_implementation="sdpa").train()
    total = sum(int((item["labels"][1:] != -100).sum()) for item in data.items)
    ref_loss = sum(ref(**{k: v[None] for k, v in i.items()}, num_items_in_batch=total).loss for i in data.items)
    ref_loss.backward()
    topology = hf_rtp.state_of(model).topology
    for name, grad in Grads.seen.items():
        want = ref.get_parameter(name).grad
        if hasattr(grad, "to_local"):
            grad, want = grad.to_local(), want[rows(grad, topology.rtp_size, topology.rtp_rank)]
        torch.testing.assert_close(grad, want, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=lambda m, n=name: f"{n}: {m}")
    (logged,) = Grads.logged
    assert abs(logged - ref_loss.item()) < 1e-6, (logged, ref_loss.item())
    return logged


def test_trainer_accumulating_two_sequences_of_different_label_counts_is_vanillas_step(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    logged = run_on_ranks(_trainer_accumulating, 2, ckpt, str(tmp_path / "out"))
    assert logged[0] == logged[1]
