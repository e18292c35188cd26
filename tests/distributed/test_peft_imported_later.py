"""hf_rtp never imports PEFT itself (PEFT imports bitsandbytes when installed: about 2 s and 45 MB per process
that uses neither). Its PEFT stand-ins go in at a rotated load when PEFT is imported already, else when the
script imports PEFT afterwards; either way LoRA on a rotated base is sized by global features and trains as
vanilla PEFT under DDP does. Fresh interpreters: the preloaded fork server has PEFT imported already."""

import os
import sys

import torch
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks


def _import_peft_after_loading(ckpt):
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64)
    imported = sorted(m for m in ("peft", "bitsandbytes") if m in sys.modules)
    from peft import LoraConfig, get_peft_model  # the usual order in a notebook: load, then import PEFT

    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    batch = global_batch(2)[int(os.environ["RANK"])]
    peft_model(input_ids=batch, labels=batch).loss.backward()
    return imported, tuple(layer.lora_B["default"].weight.shape), layer.lora_A["default"].weight.grad is not None


def test_peft_imported_after_a_rotated_load_still_gets_full_size_adapters(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    for imported, lora_b, trained in run_on_ranks(_import_peft_after_loading, 2, ckpt, fresh=True):
        assert imported == []  # from_pretrained imported neither PEFT nor bitsandbytes
        assert lora_b == (32, 4) and trained  # q_proj's global out_features, not this rank's 16 rows
