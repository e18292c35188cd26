"""The recipe under torchrun with one rank killed or stopped, at a named point (HF_RTP_FAULT) or from
outside: the live rank fails within its timeout with a message naming the likely cause, and the last
checkpoint loads and resumes. Every run resumes the session's default run (support.recipes)."""

import os
import re
import signal
import subprocess
import tempfile
import time

import psutil
import pytest
from support import recipes
from support.spawn import kill_launcher, kill_matching

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
        *recipes.torchrun(2),
        *monitor,
        recipes.FINETUNE,
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


@pytest.mark.parametrize(
    "fault, cause",
    [
        ("stop@state.write#1", "another rank stopped, died or did not call it within HF_RTP_TIMEOUT"),
        ("kill@state.write#1", "another rank stopped, died or did not call it within HF_RTP_TIMEOUT"),
        ("kill@load.read#1", "another rank died, was stopped"),
    ],
)
def test_a_rank_killed_or_stopped_ends_the_job_in_time_with_the_cause_and_the_last_checkpoint_resumes(
    default_run, tmp_path, fault, cause
):
    run = str(tmp_path / "run")
    os.makedirs(run)
    default = os.path.join(default_run, "default")
    data = ["--model", f"{default}/model", "--dataset", f"{default}/data/train.jsonl"]
    resume = ["--resume_from", os.path.join(default_run, "checkpoint-4")]
    returncode, stderr, seconds = _torchrun(run, "--max_steps", "6", *resume, *data, fault=fault, cause=cause)
    assert cause in stderr, stderr[-4000:]
    # bounded by the timeout, not by hope: the clean default run (8 steps) is the time a launch takes here
    assert seconds < default_run.seconds + 3 * TIMEOUT_S, seconds
    assert returncode != 0
    left = [os.path.join(run, f) for f in os.listdir(run) if re.fullmatch(r"checkpoint-\d+", f)]  # saves that finished
    for checkpoint in [os.path.join(default_run, "checkpoint-4"), *left]:
        assert _loads(checkpoint, f"{default}/model") in (4, 6)


def test_killed_rank_stops_the_run_and_it_resumes(default_run, tmp_path):
    out = str(tmp_path / "run")
    cmd = [*recipes.torchrun(2), *recipes.finetune(out, 500, "--save_every", "2", *recipes.same_data(default_run))]
    job = subprocess.Popen(
        cmd,
        env=recipes.ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
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
    finally:  # torchrun and every rank of this run, also when an assertion above failed
        kill_launcher(job)
        kill_matching(out)
    steps_done = recipes.metrics(out)[-1]["step"]
    resume = ["--resume_from", os.path.join(out, "checkpoint-2"), *recipes.same_data(default_run)]
    recipes.run([*recipes.torchrun(2), *recipes.finetune(out, steps_done + 2, *resume)])
    steps = [r["step"] for r in recipes.metrics(out)]
    assert steps[-steps_done:] == list(range(3, steps_done + 3))  # continued after checkpoint-2


def _loads(checkpoint, model_path):
    """The checkpoint verifies and loads (here in one process: a 2-rank state reshards to 1)."""
    import torch

    import hf_rtp

    model = hf_rtp.from_pretrained(model_path)
    return hf_rtp.load_training_state(checkpoint, model, torch.optim.AdamW(model.parameters()))["step"]
