"""A checkpoint saved quantized (a quantization_config in its config.json) by a method hf_rtp does not read is
refused by name at load: its weights mean nothing without the method's scales and kernels. (bitsandbytes 4-bit
and 8-bit checkpoints load as stored: tests/distributed/test_qlora.py, test_int8.py; a bitsandbytes setting
hf_rtp does not reproduce is refused, below.)

The FP8 case is the one that mattered: float8 weights with their `weight_scale_inv` beside them loaded as
a plain model, the scales ignored, with no error."""

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.models import make_tiny_llama

import hf_rtp

METHODS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"},
}
EXPECTED = {
    "fp8": r"this checkpoint is quantized .*quant_method='fp8'",
    "gptq": r"this checkpoint is quantized .*quant_method='gptq'",
    # Answer.AI's FSDP-QLoRA storage: the packed bytes in bf16 words, which hf_rtp does not cut by rows
    "bitsandbytes": r"saved quantized by bitsandbytes with a setting hf_rtp does not read.*bnb_4bit_quant_storage",
}


def _quantized(folder, method):
    """A tiny Llama whose config says `method`; for FP8, with its q_proj stored as float8 and a scale."""
    ckpt = make_tiny_llama(folder)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = METHODS[method]
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config, f)
    if method == "fp8":
        [path] = glob.glob(os.path.join(ckpt, "*.safetensors"))
        tensors = load_file(path)
        name = "model.layers.0.self_attn.q_proj.weight"
        tensors[name] = (tensors[name] * 4).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.tensor([[0.25]])
        save_file(tensors, path, metadata={"format": "pt"})
    return ckpt


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path, method):
    ckpt = _quantized(tmp_path / "ckpt", method)
    with pytest.raises(hf_rtp.CheckpointError, match=EXPECTED[method]):
        hf_rtp.from_pretrained(ckpt)


def test_a_config_passed_with_a_quantization_config_is_refused_too(tmp_path):
    from transformers import AutoConfig

    ckpt = make_tiny_llama(tmp_path / "ckpt")
    config = AutoConfig.from_pretrained(ckpt)
    config.quantization_config = METHODS["gptq"]
    with pytest.raises(hf_rtp.CheckpointError, match="quant_method='gptq'"):
        hf_rtp.from_pretrained(ckpt, config=config)
    assert hf_rtp.from_pretrained(ckpt).config.model_type == "llama"  # the checkpoint itself still loads
