"""The Trainer recipe (recipes/trainer_sft.py) and the QLoRA flags of recipes/finetune.py, launched for real."""

import json
import os

import pytest
from support.recipes import ACCELERATE, TRAINER, finetune, metrics, run, same_data
from transformers import AutoModelForCausalLM


def test_trainer_recipe(default_run, tmp_path):
    run(
        [
            *ACCELERATE,
            TRAINER,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "8",
            "--model",
            os.path.join(default_run, "default", "model"),
            "--dataset",
            os.path.join(default_run, "default", "data", "train.jsonl"),
            "--save_steps",
            "4",
        ]
    )
    # plain Trainer's checkpoints, made collective: the weights vanilla loads, every rank's optimizer rows
    for step in (4, 8):
        checkpoint = os.path.join(tmp_path, f"checkpoint-{step}")
        assert {"model.safetensors", "hf_rtp_state", "trainer_state.json"} <= set(os.listdir(checkpoint))
        assert not os.path.exists(os.path.join(checkpoint, "optimizer.pt"))
    with open(os.path.join(tmp_path, "summary.json")) as f:
        summary = json.load(f)
    assert summary["replicated_identical"]  # DDP averaged what the ring does not
    losses = [e["loss"] for e in summary["log"]]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5
    assert all(0 < e["grad_norm"] < 100 for e in summary["log"])
    AutoModelForCausalLM.from_pretrained(summary["final"])


@pytest.mark.parametrize("bits", ["--load_in_4bit", "--load_in_8bit"])
def test_qlora_with_gradient_checkpointing(default_run, tmp_path, bits):
    from peft import PeftModel

    qlora = [bits, "--gradient_checkpointing", *same_data(default_run)]  # --lora on a 4-bit (8-bit) base
    run([*ACCELERATE, *finetune(tmp_path, 4, *qlora)])
    assert metrics(tmp_path)[-1]["loss"] < metrics(tmp_path)[0]["loss"]
    final = os.path.join(tmp_path, "final")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(final))
    base = AutoModelForCausalLM.from_pretrained(os.path.join(default_run, "default", "model"))
    PeftModel.from_pretrained(base, final)  # loads onto the vanilla base (outputs: test_qlora, test_lora_...)
