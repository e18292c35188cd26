"""The recipe under torchrun with one rank killed or stopped at a named point (HF_RTP_FAULT): the live
rank fails within its timeout with a message naming the likely cause, and the last checkpoint loads."""

import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
from support.spawn import kill_launcher, kill_matching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FINETUNE = os.path.join(ROOT, "recipes", "finetune.py")
TIMEOUT_S = 10
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_RTP_TIMEOUT": str(TIMEOUT_S),
    "HF_RTP_ENTRY_TIMEOUT": "5",
    "OMP_NUM_THREADS": "1",
}


def _torchrun(out, *extra, fault=None, cause=None):
    """Run the recipe on 2 ranks; with `cause`, until that text is on stderr (a live rank's error),
    then stop the job: torchrun itself would wait 30 s more for a SIGSTOPped rank to die."""
    env = dict(ENV, **({"HF_RTP_FAULT": fault} if fault else {}))
    # With a fault, torchrun looks at its ranks only every 60 s: it would otherwise SIGTERM the live rank
    # as soon as it sees the killed one die, before that rank can report the cause (on a busy machine)
    monitor = ["--monitor-interval", "60"] if fault else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        *monitor,
        FINETUNE,
        "--output_dir",
        out,
        "--eval_every",
        "0",
        "--save_every",
        "2",
        *extra,
    ]
    start = time.monotonic()
    with tempfile.TemporaryFile("w+", errors="replace") as err:  # two ranks interleave bytes on stderr
        job = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True, errors="replace", start_new_session=True
        )
        try:
            while job.poll() is None and time.monotonic() - start < 240:
                err.seek(0)
                if cause is not None and cause in err.read():
                    break
                time.sleep(0.2)
            seconds = time.monotonic() - start
        finally:
            # torchrun, and every rank it started in a session of its own: a SIGSTOPped one would stay
            # behind; and any rank of this run (its --output_dir is unique) that torchrun already left
            kill_launcher(job)
            kill_matching(out)
        err.seek(0)
        return job.returncode, err.read(), seconds


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A clean run to step 2, with its checkpoint: what every faulty run resumes from."""
    out = str(tmp_path_factory.mktemp("run"))
    returncode, stderr, seconds = _torchrun(out, "--max_steps", "2")
    assert returncode == 0, stderr[-3000:]
    return out, seconds


@pytest.mark.parametrize(
    "fault, cause",
    [
        ("stop@state.write#1", "another rank stopped, died or did not call it within HF_RTP_TIMEOUT"),
        ("kill@state.write#1", "another rank stopped, died or did not call it within HF_RTP_TIMEOUT"),
        ("kill@load.read#1", "another rank died, was stopped"),
    ],
)
def test_a_rank_killed_or_stopped_ends_the_job_in_time_with_the_cause_and_the_last_checkpoint_resumes(
    trained, tmp_path, fault, cause
):
    out, clean_seconds = trained
    run = str(tmp_path / "run")
    os.makedirs(run)
    default = os.path.join(out, "default")
    data = ["--model", f"{default}/model", "--dataset", f"{default}/data/train.jsonl"]
    returncode, stderr, seconds = _torchrun(
        run, "--max_steps", "4", "--resume_from", os.path.join(out, "checkpoint-2"), *data, fault=fault, cause=cause
    )
    assert cause in stderr, stderr[-4000:]
    assert seconds < clean_seconds + 3 * TIMEOUT_S, seconds  # bounded by the timeout, not by hope
    assert returncode != 0
    left = [os.path.join(run, f) for f in os.listdir(run) if re.fullmatch(r"checkpoint-\d+", f)]  # saves that finished
    for checkpoint in [os.path.join(out, "checkpoint-2"), *left]:
        assert _loads(checkpoint, f"{default}/model") in (2, 4)


def _loads(checkpoint, model_path):
    """The checkpoint verifies and loads (here in one process: a 2-rank state reshards to 1)."""
    import torch

    import hf_rtp

    model = hf_rtp.from_pretrained(model_path)
    return hf_rtp.load_training_state(checkpoint, model, torch.optim.AdamW(model.parameters()))["step"]
