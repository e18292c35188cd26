"""The recipes launched as a user launches them, and the one default run that several test files resume.

The default run (accelerate launch, 2 processes, 8 steps, a checkpoint every 4) is built once per pytest
session: under pytest-xdist the first worker that needs it builds it while the others wait on a file lock
(pytest-xdist's documented pattern for a session fixture), so the files that use it can run on any worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from support.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FINETUNE = os.path.join(ROOT, "recipes", "finetune.py")
TRAINER = os.path.join(ROOT, "recipes", "trainer_sft.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_RTP_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}


def accelerate_launch(config: str) -> list[str]:
    """`accelerate launch --config_file recipes/configs/<config>`."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "configs", config),
    ]


ACCELERATE = accelerate_launch("cpu.yaml")


def torchrun(n: int) -> list[str]:
    """torchrun on `n` ranks, on a free port: its default (29500) is any other job's too, and two tests' jobs
    at once (xdist's workers) would fail one with EADDRINUSE (seen under torch 2.11)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(n),
        "--master_port",
        str(free_port()),
    ]


def finetune(out, max_steps: int, *extra: str) -> list[str]:
    """recipes/finetune.py's command line after the launcher: into `out`, `max_steps` steps, no evaluation."""
    return [FINETUNE, "--output_dir", str(out), "--max_steps", str(max_steps), "--eval_every", "0", *extra]


def run(cmd: list[str], ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, errors="replace", timeout=300)
    if ok:
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def resuming(out: str, checkpoint: str = "checkpoint-4") -> list[str]:
    """Arguments that resume the default run in `out` from `checkpoint`, on its model and data."""
    return ["--resume_from", os.path.join(out, checkpoint), *same_data(out)]


def same_data(out: str) -> list[str]:
    """The default run's model and data, for a run that resumes it or compares with it."""
    default = os.path.join(out, "default")
    return [
        "--model",
        f"{default}/model",
        "--dataset",
        f"{default}/data/train.jsonl",
        "--eval_dataset",
        f"{default}/data/eval.jsonl",
    ]


def _launch_default(out: str) -> None:
    run([*ACCELERATE, FINETUNE, "--output_dir", out, "--max_steps", "8", "--save_every", "4", "--eval_every", "4"])


class DefaultRun(str):
    """The default run's folder, with how long its launch took (a baseline for time bounds)."""

    seconds: float


def default_run_once(tmp_path_factory, worker_id: str) -> DefaultRun:
    from filelock import FileLock

    # without xdist this process is the session; with it, each worker's basetemp is a folder of the session's
    root = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    out, record = root / "default-run", root / "default-run.json"
    with FileLock(str(root / "default-run.lock")):
        if not record.exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker's attempt that failed: build it afresh
            start = time.monotonic()
            _launch_default(str(out))
            record.write_text(json.dumps({"seconds": time.monotonic() - start}))
    found = DefaultRun(str(out))
    found.seconds = json.loads(record.read_text())["seconds"]
    return found
