"""Two saves into one folder at once, and a disk that fills up under torch.distributed.checkpoint: a
clear error, the same class on every rank, and neither save destroys the other's files or the old
checkpoint."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from support.folders import snapshot
from support.models import make_tiny_llama, trained_one_step
from support.spawn import run_on_ranks

import hf_rtp

SAVE_SCRIPT = """
import sys, torch, hf_rtp
model = hf_rtp.from_pretrained(sys.argv[1])
with torch.no_grad():
    for p in model.parameters():
        p.add_(float(sys.argv[3]))
model.save_pretrained(sys.argv[2], max_shard_size="12KB")
"""


@pytest.fixture
def processes():
    """Processes a test starts; each is killed and reaped at teardown, whatever the test's outcome."""
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def _wait_until_stopped(proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the first save exited ({proc.returncode}) instead of stopping: {proc.stdout.read()}")
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.1)
    raise AssertionError("the first save never reached its fault point")


def _sum(folder):
    model = hf_rtp.from_pretrained(folder, dtype=torch.float64)
    return sum(float(p.detach().sum()) for p in model.parameters())


def test_a_second_save_into_a_folder_being_saved_fails_and_destroys_nothing(tmp_path, processes):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    out = str(tmp_path / "out")
    hf_rtp.from_pretrained(ckpt).save_pretrained(out, max_shard_size="12KB")
    old = _sum(out)
    env = {**os.environ, "HF_RTP_FAULT": "stop@save.commit", "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen(
        [sys.executable, "-c", SAVE_SCRIPT, ckpt, out, "0.5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    processes.append(first)
    _wait_until_stopped(first)  # it holds the folder's lock, its files staged
    during = snapshot(out)
    second = hf_rtp.from_pretrained(ckpt)
    with pytest.raises(
        hf_rtp.CheckpointError, match=rf"another process \(pid {first.pid} on .*\) is saving into .*out"
    ):
        second.save_pretrained(out, max_shard_size="12KB")
    assert snapshot(out) == during  # the first save's staged files and the old checkpoint, untouched
    assert _sum(out) == pytest.approx(old, rel=1e-12)  # a load meanwhile sees the old checkpoint

    os.kill(first.pid, signal.SIGCONT)  # the first save goes on and commits
    assert first.wait(timeout=120) == 0, first.stdout.read()
    assert _sum(out) != pytest.approx(old, rel=1e-6)
    second.save_pretrained(out, max_shard_size="12KB")  # and now the second one may
    assert _sum(out) == pytest.approx(old, rel=1e-12)
    assert not [f for f in os.listdir(out) if f.startswith(".hf_rtp")]


def test_a_killed_save_leaves_no_lock_behind(tmp_path, processes):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    out = str(tmp_path / "out")
    env = {**os.environ, "HF_RTP_FAULT": "kill@save.commit", "HF_HUB_OFFLINE": "1"}
    first = subprocess.run(
        [sys.executable, "-c", SAVE_SCRIPT, ckpt, out, "0.5"], env=env, capture_output=True, timeout=300
    )
    assert first.returncode == -signal.SIGKILL
    hf_rtp.from_pretrained(ckpt).save_pretrained(out, max_shard_size="12KB")  # the kernel released its lock
    assert not [f for f in os.listdir(out) if f.startswith(".hf_rtp")]  # its staging folder was provably its own


def _save_state_with_a_full_disk(ckpt, target):
    import resource

    rank = int(os.environ["RANK"])
    model, optimizer = trained_one_step(ckpt)
    hf_rtp.save_training_state(target, model, optimizer, extra={"step": 1})
    if rank == 1:  # a real write failure inside DCP's writer: the kernel refuses files past 20 kB (EFBIG)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
    try:
        hf_rtp.save_training_state(target, model, optimizer, extra={"step": 2})
    except hf_rtp.CheckpointError as err:  # DCP raises CheckpointException, a BaseException
        return type(err).__name__, str(err)
    except BaseException as err:
        return "escaped: " + type(err).__name__, str(err)
    return None


def _load_step(ckpt, target):
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    return hf_rtp.load_training_state(target, model, torch.optim.AdamW(model.parameters(), lr=1e-2))["step"]


def test_a_full_disk_during_a_training_state_save_is_a_checkpoint_error_on_every_rank(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    target = str(tmp_path / "state")
    results = run_on_ranks(_save_state_with_a_full_disk, 2, ckpt, target)
    for name, message in results:
        assert name == "CheckpointError", message
        assert "File too large" in message and "The previous checkpoint, if any, is untouched" in message
    assert run_on_ranks(_load_step, 2, ckpt, target) == [1, 1]


STATE_SCRIPT = """
import sys, torch, hf_rtp
model = hf_rtp.from_pretrained(sys.argv[1]).train()
optimizer = torch.optim.AdamW(model.parameters())
hf_rtp.save_training_state(sys.argv[2], model, optimizer, extra={"step": int(sys.argv[3])})
"""


def test_a_second_training_state_save_into_one_folder_fails_and_destroys_nothing(tmp_path, processes):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    target = str(tmp_path / "state")
    model = hf_rtp.from_pretrained(ckpt).train()
    optimizer = torch.optim.AdamW(model.parameters())
    hf_rtp.save_training_state(target, model, optimizer, extra={"step": 1})  # the old state, saved here
    env = {**os.environ, "HF_RTP_FAULT": "stop@state.write", "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen(
        [sys.executable, "-c", STATE_SCRIPT, ckpt, target, "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    processes.append(first)
    _wait_until_stopped(first)  # its files written into state.partial, the lock held
    during = snapshot(tmp_path)
    with pytest.raises(
        hf_rtp.CheckpointError, match=rf"another process \(pid {first.pid} on .*\) is saving into .*state"
    ):
        hf_rtp.save_training_state(target, model, optimizer, extra={"step": 3})
    assert snapshot(tmp_path) == during
    assert hf_rtp.load_training_state(target, model, optimizer) == {"step": 1}  # a load meanwhile: the old one
    os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=120) == 0, first.stdout.read()
    fresh = hf_rtp.from_pretrained(ckpt).train()
    assert hf_rtp.load_training_state(target, fresh, torch.optim.AdamW(fresh.parameters())) == {"step": 2}
