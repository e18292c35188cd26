"""A save that fails half-way leaves the previous checkpoint whole and every rank with an error."""

import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from support.models import make_tiny_llama
from support.spawn import run_on_ranks


def _fail_second_save(ckpt, out):
    import resource
    import signal

    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    model.save_pretrained(out)
    if rank == 0:  # hf_rtp's name, but no marker of a save of its own: not hf_rtp's to remove
        os.makedirs(os.path.join(out, ".hf_rtp-staging-killed"), exist_ok=True)
        with open(os.path.join(out, ".hf_rtp-staging-killed", "notes.txt"), "w") as f:
            f.write("mine")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if rank == 0:
        # A real write failure: the kernel refuses to grow files past 20 kB (EFBIG), mid-file.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))
    try:
        model.save_pretrained(out)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def test_failed_save_keeps_previous_checkpoint(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    out = str(tmp_path / "out")
    errors = run_on_ranks(_fail_second_save, 2, ckpt, out)
    assert "File too large" in errors[0]
    assert errors[1].startswith("CheckpointError: rank 0 failed: OSError") and "File too large" in errors[1]
    assert sorted(os.listdir(out)) == [
        ".hf_rtp-staging-killed",
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert Path(os.path.join(out, ".hf_rtp-staging-killed", "notes.txt")).read_text() == "mine"
    saved, original = (
        load_file(os.path.join(out, "model.safetensors")),
        load_file(os.path.join(ckpt, "model.safetensors")),
    )
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in saved)  # the first save, untouched


def _save_under_a_file(ckpt, blocker):
    import time

    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    start = time.monotonic()
    try:
        model.save_pretrained(os.path.join(blocker, "sub"))  # rank 0 cannot even create the folder
    except Exception as err:
        return time.monotonic() - start, f"{type(err).__name__}: {err}"
    return None


def test_rank0_failing_before_writing_fails_every_rank_promptly(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    results = run_on_ranks(_save_under_a_file, 2, ckpt, str(blocker))
    # the same hf_rtp class on every rank, naming the rank that failed, so `except` works alike everywhere
    assert results[0][1].startswith("CheckpointError: rank 0 failed: NotADirectoryError")
    assert results[1][1].startswith("CheckpointError: rank 0 failed: NotADirectoryError")
    assert all(seconds < 20 for seconds, _ in results)  # far inside the 60 s collective timeout
