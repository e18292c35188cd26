"""QLoRA on the ring: `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)` against vanilla
transformers + bitsandbytes + PEFT under DDP in the same processes (CPU bitsandbytes, float32).

Each rank quantizes only its rows; the packed bytes and scales must be vanilla's byte for byte (double
quantization included: its offset is the whole tensor's mean), and the logits, the loss and every LoRA
gradient vanilla's up to summation order, at 2 ranks and at 3 (uneven rows)."""

import os

import pytest
import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

pytest.importorskip("bitsandbytes")

# widths that are multiples of bitsandbytes' 64-element blocks, as real models' are
WIDE = dict(hidden_size=64, intermediate_size=128, head_dim=16)
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _bnb(quant_type="nf4", double=False, compute=torch.float32):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double,
        bnb_4bit_compute_dtype=compute,
    )


def _adapters(model):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=TARGETS)
    return get_peft_model(model, config)


def _vanilla_rows(vanilla, name, rank, world):
    """Vanilla's packed bytes and the absmax its matmul uses, for this rank's rows of module `name`."""
    import bitsandbytes.functional as F

    from hf_rtp.distributed.sharding import chunk_rows

    weight = vanilla.get_submodule(name).weight
    state = weight.quant_state
    out, inp = state.shape
    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    start, end = chunk_rows(out, world, rank)
    packed = weight.data.view(out, inp // 2)[start:end]
    return packed, absmax.view(out, -1)[start:end]


def _compare(ckpt, quant_type, double):
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = _bnb(quant_type, double)
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, quantization_config=config)
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, quantization_config=config)

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
    batch = global_batch(world, seq=12)[rank]
    with torch.no_grad():
        logits = [m(input_ids=batch).logits for m in (model, vanilla)]
    model, vanilla = _adapters(model).train(), _adapters(vanilla).train()
    ddp = DistributedDataParallel(vanilla)
    losses = []
    for m in (model, ddp):
        loss = m(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.item())
    hf_rtp.sync_grads(model)
    reference = dict(vanilla.named_parameters())
    grads = {
        name: ((p.grad - reference[name].grad).abs().max().item(), reference[name].grad.abs().max().item())
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return stored, (logits[0] - logits[1]).abs().max().item(), losses, grads


@pytest.mark.parametrize(
    ("quant_type", "double", "world"), [("nf4", False, 2), ("nf4", True, 3), ("fp4", True, 2), ("fp4", False, 3)]
)
def test_a_4bit_base_rotates_with_vanillas_bytes_logits_and_lora_gradients(tmp_path, quant_type, double, world):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for rank, (stored, logits, losses, grads) in enumerate(run_on_ranks(_compare, world, ckpt, quant_type, double)):
        assert len(stored) == 14 and all(a and b for a, b in stored.values()), (rank, stored)  # 7 per layer
        assert logits < 1e-5, (rank, logits)
        assert abs(losses[0] - losses[1]) < 1e-5, (rank, losses)
        assert sum("lora_A" in n for n in grads) == 6 and sum("lora_B" in n for n in grads) == 6
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
