"""quantization_config: bitsandbytes 4-bit and 8-bit rotate (tests/distributed/test_qlora.py, test_int8.py); every
other method and every setting hf_rtp does not reproduce is refused by name at from_pretrained, before any read, and
never loaded whole or dequantized."""

import pytest
import torch
from support.models import make_tiny_llama

import hf_rtp

pytest.importorskip("bitsandbytes")


def _others():
    from transformers import AwqConfig, BitsAndBytesConfig, GPTQConfig

    return {
        "GPTQConfig": lambda: GPTQConfig(bits=4),
        "dict gptq": lambda: {"quant_method": "gptq", "bits": 4},
        "dict fp8": lambda: {"quant_method": "fp8", "activation_scheme": "dynamic"},
        "AwqConfig": lambda: AwqConfig(bits=4),
        # their config classes need their libraries installed; a config.json's dict names them all the same
        "dict hqq": lambda: {"quant_method": "hqq", "nbits": 4},
        "dict torchao": lambda: {"quant_method": "torchao", "quant_type": "int8_weight_only"},
        "fp16 8-bit weights": lambda: BitsAndBytesConfig(load_in_8bit=True, llm_int8_has_fp16_weight=True),
        "quant_storage": lambda: BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16),
    }


EXPECTED = {
    "GPTQConfig": r"quantization_config=GPTQConfig \(quant_method='gptq'\)",
    "dict gptq": r"quant_method='gptq'",
    "dict fp8": r"quant_method='fp8'",
    "AwqConfig": r"quantization_config=AwqConfig \(quant_method='awq'\)",
    "dict hqq": r"quant_method='hqq'",
    "dict torchao": r"quant_method='torchao'",
    "fp16 8-bit weights": r"BitsAndBytesConfig with llm_int8_has_fp16_weight=True \(trainable 8-bit weights\)",
    "quant_storage": r"bnb_4bit_quant_storage=torch.bfloat16",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_quantization_hf_rtp_does_not_rotate_is_refused_naming_it_and_whats_supported(tmp_path, name):
    config = _others()[name]()
    with pytest.raises(TypeError, match=EXPECTED[name] + r".*hf_rtp rotates bitsandbytes only.*load_in_8bit=True"):
        hf_rtp.from_pretrained(tmp_path / "never-read", quantization_config=config)


def test_4bit_in_one_process_is_refused_pointing_at_transformers(tmp_path):
    from transformers import BitsAndBytesConfig

    ckpt = make_tiny_llama(tmp_path / "ckpt", hidden_size=64, intermediate_size=128, head_dim=16)
    with pytest.raises(TypeError, match=r"ring of one rank.*transformers' from_pretrained"):
        hf_rtp.from_pretrained(ckpt, quantization_config=BitsAndBytesConfig(load_in_4bit=True))


def test_a_bitsandbytes_config_given_as_its_to_dict_is_taken_as_vanilla_takes_it(tmp_path):
    """BitsAndBytesConfig.to_dict() keeps quant_method as transformers' QuantizationMethod enum; vanilla loads such a
    dict, and so does hf_rtp: it gets as far as the one-rank refusal that the config object itself meets."""
    from transformers import BitsAndBytesConfig

    ckpt = make_tiny_llama(tmp_path / "ckpt", hidden_size=64, intermediate_size=128, head_dim=16)
    as_dict = BitsAndBytesConfig(load_in_4bit=True).to_dict()
    assert str(as_dict["quant_method"]) != "bitsandbytes"  # the enum, which prints as its name
    with pytest.raises(TypeError, match=r"ring of one rank.*transformers' from_pretrained"):
        hf_rtp.from_pretrained(ckpt, quantization_config=as_dict)
