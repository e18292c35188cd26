"""The recipes, launched for real: accelerate launch and torchrun on 2 and 3 CPU processes, and one process."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FINETUNE = os.path.join(ROOT, "recipes", "finetune.py")
TRAINER = os.path.join(ROOT, "recipes", "trainer_sft.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_RTP_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
ACCELERATE = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--config_file",
    os.path.join(ROOT, "recipes", "configs", "cpu.yaml"),
]


def torchrun(n):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n)]


def run(cmd, ok=True):
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, errors="replace", timeout=300)
    if ok:
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The README's job (shortened): accelerate launch, 2 processes, embedded default, checkpoint every 4 steps."""
    out = str(tmp_path_factory.mktemp("default"))
    run([*ACCELERATE, FINETUNE, "--output_dir", out, "--max_steps", "8", "--save_every", "4", "--eval_every", "4"])
    return out


def _same_data(out):
    default = os.path.join(out, "default")
    return [
        "--model",
        f"{default}/model",
        "--dataset",
        f"{default}/data/train.jsonl",
        "--eval_dataset",
        f"{default}/data/eval.jsonl",
    ]


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
    run(
        [
            *torchrun(2),
            FINETUNE,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "8",
            "--eval_every",
            "0",
            "--resume_from",
            os.path.join(default_run, "checkpoint-4"),
            *_same_data(default_run),
        ]
    )
    resumed = metrics(tmp_path)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    expected = [r["loss"] for r in metrics(default_run)[4:]]
    assert [r["loss"] for r in resumed] == pytest.approx(expected, abs=1e-6)


def test_resume_on_three_processes_from_a_two_process_checkpoint(default_run, tmp_path):
    done = run(
        [
            *torchrun(3),
            FINETUNE,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "8",
            "--eval_every",
            "0",
            "--resume_from",
            os.path.join(default_run, "checkpoint-4"),
            *_same_data(default_run),
        ]
    )
    assert "(2 -> 3 ranks)" in done.stdout
    resumed = metrics(tmp_path)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    # a different global batch, so not the same losses, but the same model state: close to the original
    assert resumed[0]["loss"] == pytest.approx(metrics(default_run)[4]["loss"], abs=0.1)


def test_two_accelerate_launchers_as_two_nodes_train_like_one_launcher(default_run, tmp_path):
    """recipes/configs/multinode.yaml on localhost: 2 "nodes" of 2 processes, a ring of 2 in each, resuming
    a flat 2-rank checkpoint; one launcher of 4 processes in a flat ring takes the same steps."""
    from support.spawn import finish_launchers, free_port

    resume = [
        "--max_steps",
        "6",
        "--eval_every",
        "0",
        "--resume_from",
        os.path.join(default_run, "checkpoint-4"),
        *_same_data(default_run),
    ]
    flat = tmp_path / "flat"
    run([*torchrun(4), FINETUNE, "--output_dir", str(flat), *resume])
    port, nodes = free_port(), tmp_path / "nodes"
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "configs", "multinode.yaml"),
        "--num_processes",
        "4",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "no",
    ]
    procs = [
        subprocess.Popen(
            [*launch, "--machine_rank", str(node), FINETUNE, "--output_dir", str(nodes), "--rtp_size", "2", *resume],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    outputs = finish_launchers(procs, timeout=300)
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-5000:]
    assert "4 rank(s): 2 replica(s) of a 2-rank ring" in outputs[0]
    expected = metrics(flat)
    assert [r["step"] for r in metrics(nodes)] == [5, 6]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in metrics(nodes)] == pytest.approx([r[key] for r in expected], rel=1e-5)
    a = AutoModelForCausalLM.from_pretrained(os.path.join(flat, "final")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(os.path.join(nodes, "final")).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)


def test_qlora_with_gradient_checkpointing(default_run, tmp_path):
    from peft import PeftModel

    run(
        [
            *ACCELERATE,
            FINETUNE,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "4",
            "--eval_every",
            "0",
            "--load_in_4bit",  # QLoRA: --lora on a 4-bit base
            "--gradient_checkpointing",
            *_same_data(default_run),
        ]
    )
    assert metrics(tmp_path)[-1]["loss"] < metrics(tmp_path)[0]["loss"]
    final = os.path.join(tmp_path, "final")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(final))
    base = AutoModelForCausalLM.from_pretrained(os.path.join(default_run, "default", "model"))
    PeftModel.from_pretrained(base, final)  # loads onto the vanilla base (outputs: test_qlora, test_lora_...)


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


def test_single_process_and_offline_push(default_run, tmp_path):
    done = run(
        [
            sys.executable,
            FINETUNE,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "3",
            "--eval_every",
            "0",
            "--push_to_hub",
            "someone/tiny",
            *_same_data(default_run),
        ],
        ok=False,
    )
    assert done.returncode != 0 and "could not push" in done.stderr and "checkpoint itself is complete" in done.stderr
    final = os.path.join(tmp_path, "final")
    sent = done.stdout.split("pushing to someone/tiny: ")[1].splitlines()[0].split(", ")
    assert sent == sorted(os.listdir(final))  # exactly the folder's files
    AutoModelForCausalLM.from_pretrained(final)


def test_killed_rank_stops_the_run_and_it_resumes(default_run, tmp_path):
    out = str(tmp_path / "run")
    cmd = [
        *torchrun(2),
        FINETUNE,
        "--output_dir",
        out,
        "--max_steps",
        "500",
        "--save_every",
        "2",
        "--eval_every",
        "0",
        *_same_data(default_run),
    ]
    job = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace")
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(out, "checkpoint-2", "training_state.json")):
            assert time.monotonic() < deadline and job.poll() is None, "the run never reached checkpoint-2"
            time.sleep(0.2)
        rank1 = [p for p in psutil.Process(job.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        assert rank1, "rank 1 not found"
        rank1[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        job.communicate(timeout=90)  # the survivor must stop, not hang
        assert job.returncode != 0 and time.monotonic() - killed_at < 60
    finally:
        if job.poll() is None:
            job.kill()
    steps_done = metrics(out)[-1]["step"]
    run(
        [
            *torchrun(2),
            FINETUNE,
            "--output_dir",
            out,
            "--max_steps",
            str(steps_done + 2),
            "--eval_every",
            "0",
            "--resume_from",
            os.path.join(out, "checkpoint-2"),
            *_same_data(default_run),
        ]
    )
    steps = [r["step"] for r in metrics(out)]
    assert steps[-steps_done:] == list(range(3, steps_done + 3))  # continued after checkpoint-2


def test_gradient_accumulation_matches_a_larger_batch(default_run, tmp_path):
    # two micro-batches of 4 are the same 16 samples per step as the default batch of 8 on 2 ranks
    run(
        [
            *torchrun(2),
            FINETUNE,
            "--output_dir",
            str(tmp_path),
            "--max_steps",
            "4",
            "--eval_every",
            "0",
            "--per_device_batch_size",
            "4",
            "--grad_accum",
            "2",
            *_same_data(default_run),
        ]
    )
    expected = [r["loss"] for r in metrics(default_run)[:4]]
    assert [r["loss"] for r in metrics(tmp_path)] == pytest.approx(expected, abs=1e-4)


def test_text_and_parquet_datasets(default_run, tmp_path):
    from datasets import load_dataset

    jsonl = os.path.join(default_run, "default", "data", "train.jsonl")
    texts = load_dataset("json", data_files=jsonl, split="train")
    texts.to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "train.txt").write_text("\n".join(texts["text"]) + "\n")
    first_losses = []
    for source in ("train.txt", "train.parquet"):
        out = tmp_path / source.replace(".", "-")
        run(
            [
                sys.executable,
                FINETUNE,
                "--output_dir",
                str(out),
                "--max_steps",
                "1",
                "--eval_every",
                "0",
                "--model",
                os.path.join(default_run, "default", "model"),
                "--dataset",
                str(tmp_path / source),
            ]
        )
        first_losses.append(metrics(out)[0]["loss"])
    assert first_losses[0] == pytest.approx(first_losses[1], abs=1e-6)  # same texts, same blocks
