"""QLoRA on the ring: `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)` against vanilla
transformers + bitsandbytes + PEFT under DDP in the same processes (CPU bitsandbytes, float32).

Each rank quantizes only its rows; the packed bytes and scales must be vanilla's byte for byte (double
quantization included: its offset is the whole tensor's mean), and the logits, the loss and every LoRA
gradient vanilla's up to summation order, at 2 ranks and at 3 (uneven rows)."""

import os
import time

import pytest
import torch
from support.compare import lora_step_both, trainable_grad_gaps, vanilla_training_path
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytest.importorskip("bitsandbytes")

# widths that are multiples of bitsandbytes' 64-element blocks, as real models' are
WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16)
TARGETS = ["q_proj", "v_proj", "down_proj"]
# GPT-2's Conv1D layers, which vanilla's bitsandbytes quantizes as linears of their transposed weights: c_attn
# (192 rows: 64 per rank at 3), both c_proj and c_fc (256 rows: uneven at 3)
GPT2_WIDE = dict(n_embd=64)
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]


def _bnb(quant_type="nf4", double=False, compute=torch.float32):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=compute,
    )


def _vanilla_rows(vanilla, name, rank, world):
    """Vanilla's packed bytes and the absmax its matmul uses, for this rank's rows of module `name`."""
    import bitsandbytes.functional as F

    from hf_rtp.distributed.tensors.sharding import chunk_rows

    weight = vanilla.get_submodule(name).weight
    state = weight.quant_state
    out, inp = state.shape
    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    start, end = chunk_rows(out, world, rank)
    packed = weight.data.view(out, inp // 2)[start:end]
    return packed, absmax.view(out, -1)[start:end]


def _compare(ckpt, quant_type, double, dtype=torch.float32, saved=False):
    """hf_rtp beside vanilla, both quantizing `ckpt` at load, or (`saved`) both reading a checkpoint vanilla saved
    quantized with that config."""
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = {} if saved else {"quantization_config": _bnb(quant_type, double, dtype)}
    model = hf_rtp.from_pretrained(ckpt, dtype=dtype, **options)
    vanilla = vanilla_training_path(AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, **options))

    stored = {}
    for name, module in vanilla.named_modules():
        if type(module).__name__ == "Linear4bit":
            ours = model.get_submodule(name)
            packed, absmax = ours.unpack(ours.weight.to_local())
            theirs = _vanilla_rows(vanilla, name, rank, world)
            stored[name] = (
                torch.equal(packed.view(theirs[0].shape), theirs[0]),
                torch.equal(absmax.view(theirs[1].shape), theirs[1]),
            )
    model, logits, losses, grads = beside_vanilla(model, vanilla)
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return stored, logits, losses, grads, dtypes


def beside_vanilla(model, vanilla):
    """Eval logits of both on this rank's batch, then LoRA on both (vanilla under DDP), one backward each: the
    adapted model, the largest logit gap, both losses and every trainable gradient's gap."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    batch = global_batch(world, seq=12)[rank]
    with torch.no_grad():
        logits = [m(input_ids=batch).logits for m in (model, vanilla)]
    targets = GPT2_TARGETS if model.config.model_type == "gpt2" else TARGETS
    model, losses, gaps = lora_step_both(model, vanilla, batch, targets)
    return model, (logits[0] - logits[1]).abs().max().item(), losses, gaps


def assert_like_vanilla(rank, stored, logits, losses, grads, quantized=14, adapted=6):
    """Every quantized weight's bytes vanilla's (Llama: 7 per layer), logits and loss within float32 rounding,
    every LoRA gradient (Llama: 6 A and 6 B) up to summation order."""
    assert len(stored) == quantized and all(a and b for a, b in stored.values()), (rank, stored)
    assert logits < 1e-5, (rank, logits)
    assert abs(losses[0] - losses[1]) < 1e-5, (rank, losses)
    assert sum("lora_A" in n for n in grads) == adapted and sum("lora_B" in n for n in grads) == adapted
    for name, (difference, scale) in grads.items():
        assert scale > 0 and difference <= 1e-7 + 1e-5 * scale, (rank, name, difference, scale)


@pytest.mark.parametrize(
    ("quant_type", "double", "world"), [("nf4", False, 2), ("nf4", True, 3), ("fp4", True, 2), ("fp4", False, 3)]
)
def test_a_4bit_base_rotates_with_vanillas_bytes_logits_and_lora_gradients(tmp_path, quant_type, double, world):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for rank, (stored, logits, losses, grads, _) in enumerate(run_on_ranks(_compare, world, ckpt, quant_type, double)):
        assert_like_vanilla(rank, stored, logits, losses, grads)


@pytest.mark.parametrize(("world", "saved"), [(3, False), (2, True)])
def test_gpt2_conv1d_layers_rotate_quantized_as_vanilla_quantizes_them(tmp_path, world, saved):
    """Vanilla's bitsandbytes makes each GPT-2 Conv1D a Linear4bit of its transposed weight: each rank reads its
    columns of the stored [in, out] weight as rows, and gets vanilla's packed bytes; or reads a checkpoint vanilla
    saved quantized (stored [out, in] already)."""
    ckpt = make_tiny("gpt2", tmp_path / "ckpt", **GPT2_WIDE)
    if saved:
        ckpt = saved_quantized(ckpt, tmp_path / "saved", _bnb("nf4", True))
    for rank, (stored, logits, losses, grads, _) in enumerate(
        run_on_ranks(_compare, world, ckpt, "nf4", True, torch.float32, saved)
    ):
        assert_like_vanilla(rank, stored, logits, losses, grads, quantized=8, adapted=8)  # 4 Conv1D per block


def saved_quantized(ckpt, out, config):
    """`ckpt` as vanilla transformers saves it after quantizing it at load (a pre-quantized checkpoint)."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, quantization_config=config).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize(("quant_type", "double", "world"), [("nf4", True, 3), ("fp4", False, 2)])
def test_a_checkpoint_vanilla_saved_in_4bit_loads_as_each_ranks_rows(tmp_path, quant_type, double, world):
    # 1024 rows of 64: 1024 absmax values per MLP weight, four of double quantization's 256-blocks, which the
    # ranks' rows cut mid-block at 3 ranks (342 rows each)
    ckpt = make_tiny("llama", tmp_path / "ckpt", **{**WIDE, "intermediate_size": 1024})
    saved = saved_quantized(ckpt, tmp_path / "saved", _bnb(quant_type, double))
    for rank, (stored, logits, losses, grads, _) in enumerate(
        run_on_ranks(_compare, world, saved, quant_type, double, torch.float32, True)
    ):
        assert_like_vanilla(rank, stored, logits, losses, grads)


def test_a_bf16_base_as_qlora_usually_runs_it(tmp_path):
    """bf16 weights quantized from bf16 rows, bf16 compute; prepare_model_for_kbit_training then casts every
    bf16 parameter that is not 4-bit to float32 (the rotated embedding and head included), as in vanilla."""
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for rank, (stored, logits, losses, grads, dtypes) in enumerate(
        run_on_ranks(_compare, 2, ckpt, "nf4", True, torch.bfloat16)
    ):
        assert len(stored) == 14 and all(a and b for a, b in stored.values()), (rank, stored)
        assert logits == 0.0, (rank, logits)  # the same bf16 kernels on the same rows
        assert abs(losses[0] - losses[1]) < 1e-3, (rank, losses)
        assert dtypes == ["torch.float32", "torch.uint8"], dtypes
        # bf16 matmuls (bnb_4bit_compute_dtype): the input gradient is summed over the ring's pieces, each
        # rounded to bf16, where vanilla rounds one matmul once; a ulp here and there, through two layers
        for name, (difference, scale) in grads.items():
            assert scale > 0 and difference <= 3e-2 * scale, (rank, name, difference, scale)


def _partly_quantized(ckpt):
    from transformers import AutoModelForCausalLM

    import hf_rtp

    config = _bnb()
    config.llm_int8_skip_modules = ["v_proj", "up_proj", "lm_head"]  # q and k 4-bit, v float; gate 4-bit, up float
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, quantization_config=config)
    vanilla = vanilla_training_path(
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, quantization_config=config)
    )
    attention = model.model.layers[0].self_attn
    kinds = [type(attention.get_submodule(n)).__name__ for n in ("q_proj", "k_proj", "v_proj")]
    # q and k, both 4-bit, walk stacked; v and up, float, have no float sibling left; gate has no 4-bit one
    mlp = model.model.layers[0].mlp
    stacked = lambda module: bool(vars(module).get("siblings") and module.siblings.stacked)  # noqa: E731
    kinds += [n for n in ("q_proj", "k_proj", "v_proj") if stacked(attention.get_submodule(n))]
    kinds += [n for n in ("gate_proj", "up_proj") if stacked(mlp.get_submodule(n))]
    _, logits, losses, grads = beside_vanilla(model, vanilla)
    return kinds, logits, losses, grads


def test_a_linear_the_skip_setting_keeps_in_float_walks_apart_from_its_quantized_siblings(tmp_path):
    # q/k/v and gate/up walk stacked (layers/siblings.py): once q and k are 4-bit, v must not stack with their bytes,
    # and q and k stack as 4-bit
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for rank, (kinds, logits, losses, grads) in enumerate(run_on_ranks(_partly_quantized, 2, ckpt)):
        assert kinds == ["RotatedLinear4bit", "RotatedLinear4bit", "RotatedLinear", "q_proj", "k_proj"], kinds
        assert logits < 1e-5, (rank, logits)
        assert abs(losses[0] - losses[1]) < 1e-5, (rank, losses)
        for name, (difference, scale) in grads.items():
            assert scale > 0 and difference <= 1e-7 + 1e-5 * scale, (rank, name, difference, scale)


def _narrow(ckpt):
    import hf_rtp

    with pytest.raises(TypeError, match=r"model.layers.0.self_attn.q_proj has in_features=32, not a multiple of"):
        hf_rtp.from_pretrained(ckpt, dtype=torch.float32, quantization_config=_bnb())
    skipped = _bnb()
    skipped.llm_int8_skip_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # given, the list replaces transformers' default skips, which keep the LM head unquantized
    with pytest.raises(TypeError, match=r"leaves the LM head \(lm_head\) to be quantized.*add 'lm_head'"):
        hf_rtp.from_pretrained(ckpt, dtype=torch.float32, quantization_config=skipped)
    skipped.llm_int8_skip_modules.append("lm_head")
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, quantization_config=skipped)
    return type(model.model.layers[0].self_attn.q_proj).__name__


def test_rows_that_cannot_quantize_apart_are_refused_naming_the_module_and_the_skip_setting(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")  # hidden 32: half a bitsandbytes block per row
    assert run_on_ranks(_narrow, 2, ckpt) == ["RotatedLinear", "RotatedLinear"]


def _quantized_base_alone(ckpt, out):
    """A quantized base handed to Trainer with no adapters, and dequantize(): vanilla's and hf_rtp's answers."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_rtp

    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[])
    answers = {}
    for name, load in (("vanilla", AutoModelForCausalLM.from_pretrained), ("rotated", hf_rtp.from_pretrained)):
        model = load(ckpt, dtype=torch.float32, quantization_config=_bnb())
        try:
            Trainer(model=model, args=args)
            answers[name] = None
        except ValueError as err:
            answers[name] = str(err)
    try:
        model.dequantize()
    except hf_rtp.RotatedStateError as err:
        answers["dequantize"] = str(err)
    return answers


def test_a_quantized_base_without_adapters_is_refused_by_trainer_as_vanilla_and_dequantize_by_name(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for answers in run_on_ranks(_quantized_base_alone, 2, ckpt, str(tmp_path / "out")):
        assert answers["vanilla"] is not None and "purely quantized models" in answers["vanilla"]
        assert answers["rotated"] == answers["vanilla"]  # at construction, before any step trains the norms
        assert "dequantize() of a rotated 4-bit or 8-bit base is not supported" in answers["dequantize"]


def _qdora(ckpt, bits, dropout):
    """DoRA on a quantized base (QDoRA) beside vanilla PEFT under DDP: the magnitude vectors PEFT initialises from
    the dequantized weight's row norms, then one forward and backward with each rank's dropout masks drawn alike."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, use_dora=True, init_lora_weights=False,
                        target_modules=TARGETS)  # fmt: skip
    models = []
    for load in (hf_rtp.from_pretrained, AutoModelForCausalLM.from_pretrained):
        base = vanilla_training_path(load(ckpt, dtype=torch.float32, quantization_config=_base_config(bits)))
        torch.manual_seed(0)
        models.append(get_peft_model(prepare_model_for_kbit_training(base, False), config).train())
    model, vanilla = models
    theirs = dict(vanilla.named_parameters())
    magnitudes = [(p - theirs[n]).abs().max().item() for n, p in model.named_parameters() if "magnitude" in n]
    batch = global_batch(world, seq=12)[rank]
    losses = []
    for m in (model, DistributedDataParallel(vanilla)):
        torch.manual_seed(10 + rank)  # this rank's dropout masks, the same for both
        loss = m(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.item())
    hf_rtp.sync_grads(model)
    return magnitudes, losses, trainable_grad_gaps(model, vanilla)


@pytest.mark.parametrize(("bits", "dropout", "world"), [(4, 0.1, 3), (8, 0.0, 2)])
def test_qdora_on_a_quantized_base_equals_vanilla_peft(tmp_path, bits, dropout, world):
    """PEFT reads DoRA's weight through dequantize_module_weight, which would read hf_rtp's packed bytes: the
    stand-in gives each rank's rows dequantized as bitsandbytes dequantizes vanilla's (4-bit: NF4 with double
    quantization at 3 ranks, with lora_dropout, where DoRA recomputes the base output on the dropped input)."""
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for rank, (magnitudes, losses, grads) in enumerate(run_on_ranks(_qdora, world, ckpt, bits, dropout)):
        assert len(magnitudes) == 6 and max(magnitudes) < 1e-6, (rank, magnitudes)  # 3 targets, 2 layers
        assert abs(losses[0] - losses[1]) < 1e-5, (rank, losses)
        assert sum("lora_magnitude_vector" in n for n in grads) == 6 and sum("lora_A" in n for n in grads) == 6
        for name, (difference, scale) in grads.items():
            assert scale > 0 and difference <= 1e-7 + 1e-5 * scale, (rank, name, difference, scale)


def _sft(model, out, max_steps=4, resume=None):
    from datasets import Dataset
    from peft import LoraConfig
    from support.models import tiny_tokenizer
    from support.trainer_grads import first_grads_callback
    from trl import SFTConfig, SFTTrainer

    ids = global_batch(8, batch=2, seq=10, seed=5).reshape(16, 10).tolist()
    config = SFTConfig(
        output_dir=out,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        save_strategy="steps",
        save_steps=2,
        max_length=16,
        bf16=False,
        gradient_checkpointing=True,
        optim="paged_adamw_8bit",  # QLoRA's usual optimizer, over the (replicated) adapters
    )
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear", init_lora_weights=False)
    grads = first_grads_callback()
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": ids}),
        processing_class=tiny_tokenizer(),
        callbacks=[grads],
        peft_config=lora,
    )
    # TRL keeps QLoRA adapters in bf16. There the ring's float32 input gradients, summed in pieces where vanilla
    # sums one matmul, flip a bf16 rounding here and there; Adam at lr=1e-2 turns a flip at a near-zero gradient
    # into a whole step, and losses part by ~1e-3 from step 3. Vanilla against itself does the same between
    # torch's AVX512 and AVX2 kernels (1.7e-2 at step 4), so a bf16 comparison would pass by the CPU's luck.
    # In float32 adapters, on both sides, hf_rtp's losses are vanilla's to 5e-7 on either kind of CPU.
    for p in trainer.model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    trainer.train(resume_from_checkpoint=resume)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    trainer.save_model(os.path.join(out, "adapter"))
    return trainer, losses, grads.grads


def _base_config(bits):
    from transformers import BitsAndBytesConfig

    return _bnb("nf4", True) if bits == 4 else BitsAndBytesConfig(load_in_8bit=True)


def _qlora_sft(ckpt, out, bits):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    results = {}
    for name, load in (("vanilla", AutoModelForCausalLM.from_pretrained), ("rotated", hf_rtp.from_pretrained)):
        torch.manual_seed(0)
        model = vanilla_training_path(load(ckpt, dtype=torch.float32, quantization_config=_base_config(bits)))
        trainer, losses, grads = _sft(model, os.path.join(out, name))
        torch.distributed.barrier()  # vanilla's rank 0 writes the adapter
        files = sorted(os.listdir(os.path.join(out, name, "adapter")))
        saved = load_file(os.path.join(out, name, "adapter", "adapter_model.safetensors"))
        adapter = {k: (str(v.dtype), v.numpy()) for k, v in saved.items()}
        results[name] = (trainer, losses, grads, files, adapter)
    trainer = results["rotated"][0]
    refused = []
    try:
        trainer.model.merge_and_unload()
    except hf_rtp.RotatedStateError as err:
        refused.append(str(err))
    try:
        trainer.model.get_base_model().save_pretrained(os.path.join(out, "base"))
    except hf_rtp.CheckpointError as err:
        refused.append(str(err))
    try:
        hf_rtp.whole_model(trainer.model.get_base_model())
    except hf_rtp.RotatedStateError as err:
        refused.append(str(err))
    torch.manual_seed(0)
    again = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, quantization_config=_base_config(bits))
    _, resumed, _ = _sft(again, os.path.join(out, "rotated"), resume=os.path.join(out, "rotated", "checkpoint-2"))
    # the adapter as vanilla PEFT loads it onto vanilla's own quantized base, beside hf_rtp's trained model
    if rank == 0:
        base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, quantization_config=_base_config(bits))
        loaded = PeftModel.from_pretrained(vanilla_training_path(base), os.path.join(out, "rotated", "adapter"))
        batch = global_batch(1, seq=12)[0]
        with torch.no_grad():
            logits = loaded(input_ids=batch).logits
    torch.distributed.barrier()
    with torch.no_grad():
        ours = trainer.model.eval()(input_ids=global_batch(1, seq=12)[0]).logits
    served = (logits - ours).abs().max().item() if rank == 0 else None
    plain = {k: v[1:] for k, v in results.items()}
    return plain, refused, resumed, served


@pytest.mark.parametrize("bits", [4, 8])  # QLoRA's 4-bit NF4 with double quantization; LLM.int8()
def test_qlora_with_sfttrainer_trains_saves_resumes_like_vanilla_and_refuses_merging(tmp_path, bits):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    results, refused, resumed, served = run_on_ranks(_qlora_sft, 2, ckpt, str(tmp_path), bits)[0]
    (v_losses, v_grads, v_files, v_adapter), (losses, grads, files, adapter) = results["vanilla"], results["rotated"]
    assert len(losses) == 4 and losses == pytest.approx(v_losses, abs=1e-5)  # float32 adapters (see _sft)
    assert grads.keys() == v_grads.keys() and len(grads) == 28  # A and B of 7 linears in 2 layers
    for name, grad in v_grads.items():  # the ring sums the input gradient in pieces: float32 summation order
        assert abs(grads[name] - grad).max() <= 1e-7 + 1e-5 * abs(grad).max(), name
    assert files == v_files and "adapter_model.safetensors" in files
    assert adapter.keys() == v_adapter.keys()
    for name, (dtype, tensor) in v_adapter.items():
        assert adapter[name][0] == dtype == "torch.float32", (name, adapter[name][0], dtype)
        assert abs(adapter[name][1] - tensor).max() <= 1e-4 * abs(tensor).max(), name  # 4 Adam steps of lr 1e-2
    assert "merging adapters on a 4-bit or 8-bit base" in refused[0] and "does not save a quantized base" in refused[1]
    assert "whole_model: this model's base is 4-bit or 8-bit" in refused[2]
    assert resumed[-2:] == pytest.approx(losses[-2:], abs=1e-6)  # steps 3 and 4 again, from checkpoint-2
    assert served < 1e-5


def _ring_bytes(ckpt):
    import hf_rtp

    sent = {}
    quantized = _bnb("nf4", True, torch.bfloat16)
    for name, options in (("bf16", {}), ("nf4", {"quantization_config": quantized})):
        model = hf_rtp.from_pretrained(ckpt, dtype=torch.bfloat16, **options)
        layer = model.model.layers[0].mlp.down_proj
        layer.requires_grad_(False)  # a frozen base, as under LoRA: only the input gradient walks back
        ring = hf_rtp.state_of(model).topology.ring
        x = torch.randn(2, 5, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
        before = ring.sent_bytes
        layer(x).float().sum().backward()
        sent[name] = ring.sent_bytes - before
    return sent


def test_the_ring_carries_packed_rows_and_scales_not_weights(tmp_path):
    sent = run_on_ranks(_ring_bytes, 2, make_tiny("llama", tmp_path / "ckpt", **WIDE))[0]
    # per row of 128 inputs: 64 packed bytes and 2 float32 scales against 256 bf16 bytes, forward and backward
    assert sent["bf16"] > 0 and sent["nf4"] / sent["bf16"] == (64 + 8) / 256


def _claims_4bit(ckpt):
    import hf_rtp

    with pytest.raises(hf_rtp.CheckpointError) as refused:
        hf_rtp.from_pretrained(ckpt)
    return str(refused.value)


def test_a_config_that_claims_4bit_over_plain_weights_is_refused_not_read_as_floats(tmp_path):
    import json

    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = _bnb("nf4").to_dict()
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config, f)
    for message in run_on_ranks(_claims_4bit, 2, ckpt):
        assert "quantized modules are not the ones" in message and "chosen but stored unquantized" in message


def _one_rank_damaged(good, damaged):
    return _claims_4bit(damaged if os.environ["RANK"] == "0" else good)


def test_a_damaged_quant_state_in_a_saved_4bit_checkpoint_fails_on_every_rank_by_name(tmp_path):
    """Rank 0 reads a copy whose quant_state is damaged (same length), rank 1 an intact one, as on two nodes:
    rank 0 names the damage and rank 1 fails with it at once, instead of waiting in the read's collectives."""
    import shutil

    from safetensors.torch import load_file, save_file

    good = saved_quantized(make_tiny("llama", tmp_path / "ckpt", **WIDE), tmp_path / "saved", _bnb("nf4"))
    saved = shutil.copytree(good, tmp_path / "damaged")
    path = os.path.join(saved, "model.safetensors")
    tensors = load_file(path)
    key = "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"
    tensors[key] = torch.full_like(tensors[key], ord("x"))  # same bytes long, not JSON
    save_file(tensors, path, metadata={"format": "pt"})
    started = time.monotonic()
    for message in run_on_ranks(_one_rank_damaged, 2, good, str(saved)):
        assert f"{key} in {path} is not bitsandbytes' quant state JSON" in message, message
    assert time.monotonic() - started < 50  # not the ranks' 60 s timeout
