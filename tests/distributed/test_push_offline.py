"""push_to_hub offline: the folder it uploads is a complete checkpoint, and the refusal is a clear error."""

import os

import pytest
import torch
from support.models import make_tiny_llama
from transformers import AutoModelForCausalLM

import hf_rtp


def test_push_saves_then_fails_clearly_offline(tmp_path):
    model = hf_rtp.from_pretrained(make_tiny_llama(tmp_path / "ckpt"), dtype=torch.float32)
    folder = tmp_path / "to-push"
    with pytest.raises(
        hf_rtp.CheckpointError, match=r"could not push .* as someone/tiny.*checkpoint itself is complete"
    ):
        model.save_pretrained(folder, push_to_hub=True, repo_id="someone/tiny")
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert all(
        torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values(), strict=True)
    )
    with pytest.raises(hf_rtp.CheckpointError, match="someone/tiny"):
        model.push_to_hub("someone/tiny")
