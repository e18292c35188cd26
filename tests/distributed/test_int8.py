"""An 8-bit base on the ring: `quantization_config=BitsAndBytesConfig(load_in_8bit=True, ...)` (LLM.int8()) against
vanilla transformers + bitsandbytes + PEFT under DDP in the same processes (CPU bitsandbytes, float32).

Each rank quantizes only its rows: the int8 codes and row scales must be vanilla's byte for byte. Vanilla's
Linear8bitLt computes in two regimes (bitsandbytes.matmul): in eval, the int8 kernel with llm_int8_threshold's
outlier columns in 16 bits; in training on CPU, the dequantized weight. The logits of the first, and the loss and
every LoRA gradient of the second, must be vanilla's up to summation order, at 2 ranks and at 3 (uneven rows)."""

import os

import pytest
import torch
from support.models import make_tiny
from support.spawn import run_on_ranks
from test_qlora import GPT2_WIDE, WIDE, assert_like_vanilla, beside_vanilla, saved_quantized

pytest.importorskip("bitsandbytes")


def _config(threshold):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=threshold)


def _compare(ckpt, threshold, saved=False):
    """hf_rtp beside vanilla, both quantizing `ckpt` at load, or (`saved`) both reading the checkpoint vanilla
    saved in 8 bits."""
    from transformers import AutoModelForCausalLM

    import hf_rtp
    from hf_rtp.layers.linear8bit import unpack8

    rank = int(os.environ["RANK"])
    options = {} if saved else {"quantization_config": _config(threshold)}
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, **options)
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, **options)
    assert model.is_loaded_in_8bit and not getattr(model, "is_loaded_in_4bit", False)

    stored = {}
    for name, module in vanilla.named_modules():
        if type(module).__name__ == "Linear8bitLt":
            ours = model.get_submodule(name)
            codes, scales = unpack8(ours.weight.to_local(), ours.in_features)
            here = slice(*ours.layout.bounds(rank))
            stored[name] = (torch.equal(codes, module.weight.data[here]), torch.equal(scales, module.weight.SCB[here]))
    model, logits, losses, grads = beside_vanilla(model, vanilla)
    refused = []
    for call in (
        model.merge_and_unload,
        lambda: model.get_base_model().save_pretrained(os.path.join(os.path.dirname(ckpt), "base")),
        lambda: hf_rtp.whole_model(model.get_base_model()),
    ):
        with pytest.raises(hf_rtp.HfRtpError) as raised:
            call()
        refused.append(str(raised.value))
    assert "merging adapters on a 4-bit or 8-bit base" in refused[0], refused[0]
    assert "does not save a quantized base" in refused[1] and "base is 4-bit or 8-bit" in refused[2], refused
    return stored, logits, losses, grads


# 1.0: many outlier columns (normed hidden states exceed it; transformers' default 6.0 finds none in this model and
# runs the same kernel); 0.0: the plain int8 kernel without decomposition
@pytest.mark.parametrize(("threshold", "world"), [(1.0, 3), (0.0, 2)])
def test_an_8bit_base_rotates_with_vanillas_bytes_logits_and_lora_gradients(tmp_path, threshold, world):
    ckpt = make_tiny("llama", tmp_path / "ckpt", **WIDE)
    for rank, (stored, logits, losses, grads) in enumerate(run_on_ranks(_compare, world, ckpt, threshold)):
        assert_like_vanilla(rank, stored, logits, losses, grads)


def test_a_checkpoint_vanilla_saved_in_8bit_loads_as_each_ranks_rows(tmp_path):
    saved = saved_quantized(make_tiny("llama", tmp_path / "ckpt", **WIDE), tmp_path / "saved", _config(1.0))
    for rank, (stored, logits, losses, grads) in enumerate(run_on_ranks(_compare, 3, saved, 1.0, True)):
        assert_like_vanilla(rank, stored, logits, losses, grads)


def test_gpt2_conv1d_layers_rotate_in_8_bits_as_vanilla_quantizes_them(tmp_path):
    """LLM.int8() of GPT-2: vanilla's Linear8bitLt of each Conv1D's transposed weight, each rank's rows from its
    columns of the stored weight."""
    ckpt = make_tiny("gpt2", tmp_path / "ckpt", **GPT2_WIDE)
    for rank, (stored, logits, losses, grads) in enumerate(run_on_ranks(_compare, 3, ckpt, 1.0)):
        assert_like_vanilla(rank, stored, logits, losses, grads, quantized=8, adapted=8)
