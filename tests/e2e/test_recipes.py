"""The recipes, launched for real: accelerate launch and torchrun on 2 and 3 CPU processes, and one process.

Every test here builds on the session's default run (support.recipes): the README's job, shortened.
The recipe on two launchers, with Trainer and with QLoRA, and with a rank killed, have files of their own.
"""

import itertools
import os
import sys

import pytest
import torch
from support.recipes import ROOT, finetune, metrics, resuming, run, same_data, torchrun
from transformers import AutoModelForCausalLM


def test_default_run_learns_logs_and_saves_a_vanilla_checkpoint(default_run):
    rows = metrics(default_run)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {"step", "loss", "lr", "tokens_per_s", "peak_mem_gb", "grad_norm"} <= set(rows[0])
    assert "eval_loss" in rows[3] and "eval_loss" in rows[7]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5 and rows[-1]["eval_loss"] < rows[3]["eval_loss"]
    lrs = [r["lr"] for r in rows]
    assert lrs[4] == max(lrs) and all(a > b for a, b in itertools.pairwise(lrs[4:]))  # warmup, then cosine decay
    assert sorted(d for d in os.listdir(default_run) if d.startswith("checkpoint")) == ["checkpoint-4", "checkpoint-8"]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(default_run, "final"))
    assert model.config.vocab_size > 256 and os.path.exists(os.path.join(default_run, "final", "tokenizer.json"))


def test_resume_reproduces_the_uninterrupted_run(default_run, tmp_path):
    run([*torchrun(2), *finetune(tmp_path, 8, *resuming(default_run))])
    resumed = metrics(tmp_path)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    expected = [r["loss"] for r in metrics(default_run)[4:]]
    assert [r["loss"] for r in resumed] == pytest.approx(expected, abs=1e-6)


def test_resume_on_three_processes_from_a_two_process_checkpoint(default_run, tmp_path):
    done = run([*torchrun(3), *finetune(tmp_path, 8, *resuming(default_run))])
    assert "(2 -> 3 ranks)" in done.stdout
    resumed = metrics(tmp_path)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    # a different global batch, so not the same losses, but the same model state: close to the original
    assert resumed[0]["loss"] == pytest.approx(metrics(default_run)[4]["loss"], abs=0.1)


def test_gradient_accumulation_matches_a_larger_batch(default_run, tmp_path):
    # two micro-batches of 4 are the same 16 samples per step as the default batch of 8 on 2 ranks
    accumulating = ["--per_device_batch_size", "4", "--grad_accum", "2", *same_data(default_run)]
    run([*torchrun(2), *finetune(tmp_path, 4, *accumulating)])
    expected = [r["loss"] for r in metrics(default_run)[:4]]
    assert [r["loss"] for r in metrics(tmp_path)] == pytest.approx(expected, abs=1e-4)


def test_single_process_and_offline_push(default_run, tmp_path):
    done = run(
        [sys.executable, *finetune(tmp_path, 3, "--push_to_hub", "someone/tiny", *same_data(default_run))], ok=False
    )
    assert done.returncode != 0 and "could not push" in done.stderr and "checkpoint itself is complete" in done.stderr
    final = os.path.join(tmp_path, "final")
    sent = done.stdout.split("pushing to someone/tiny: ")[1].splitlines()[0].split(", ")
    assert sent == sorted(os.listdir(final))  # exactly the folder's files
    AutoModelForCausalLM.from_pretrained(final)


def test_text_and_parquet_datasets_pack_into_the_same_blocks_as_jsonl(default_run, tmp_path, monkeypatch):
    """What `--dataset train.txt` and `--dataset train.parquet` give the recipe: the same texts, packed
    into the same blocks as the default run's jsonl."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    monkeypatch.syspath_prepend(os.path.join(ROOT, "recipes"))  # where finetune.py imports it from
    from packing import load_texts, pack

    jsonl = os.path.join(default_run, "default", "data", "train.jsonl")
    texts = load_dataset("json", data_files=jsonl, split="train")
    texts.to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "train.txt").write_text("\n".join(texts["text"]) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(default_run, "default", "model"))
    sources = [jsonl, str(tmp_path / "train.txt"), str(tmp_path / "train.parquet")]
    blocks = {source: pack(load_texts(source), tokenizer, 64) for source in sources}
    assert len(blocks) == 3 and len(blocks[jsonl]) > 10
    for source, packed in blocks.items():
        assert torch.equal(packed, blocks[jsonl]), source
