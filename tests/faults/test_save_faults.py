"""save_pretrained killed or stopped at a named point (HF_RTP_FAULT): the folder holds the complete old
or the complete new checkpoint at every instant; a loader never gets a mix of the two."""

import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file
from support.models import make_tiny_llama
from support.spawn import run_on_ranks
from transformers import AutoModelForCausalLM

SHARDS = "12KB"  # several files, so a commit moves many


def _save(ckpt, out, bump):
    """Load, change every weight by `bump`, save sharded into `out`; report an error with its delay."""
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(bump)
    start = time.monotonic()
    try:
        model.save_pretrained(out, max_shard_size=SHARDS)
    except hf_rtp.HfRtpError as err:
        return time.monotonic() - start, str(err)
    return None


def _load_sum(out):
    import hf_rtp

    model = hf_rtp.from_pretrained(out, dtype=torch.float64)
    return sum(float(p.full_tensor().sum() if hasattr(p, "full_tensor") else p.sum()) for p in model.parameters())


def _vanilla_sum(out):
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    return sum(float(p.detach().sum()) for p in model.parameters())


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """The old checkpoint (the original weights, saved by hf_rtp) and the sum the new one must have:
    two 2-rank saves, made once for the module (tests only read `ckpt`)."""
    root = tmp_path_factory.mktemp("saved")
    ckpt = make_tiny_llama(root / "ckpt")
    pristine = str(root / "old")
    run_on_ranks(_save, 2, ckpt, pristine, 0.0)
    reference = str(root / "reference")
    run_on_ranks(_save, 2, ckpt, reference, 0.5)  # what the new one must be
    return ckpt, pristine, _vanilla_sum(pristine), _vanilla_sum(reference)


@pytest.fixture
def old_and_new(saved_once, tmp_path):
    """A fresh copy of the old checkpoint for each test to save over."""
    ckpt, pristine, old, new = saved_once
    out = str(tmp_path / "out")
    shutil.copytree(pristine, out)
    return ckpt, out, old, new


def test_killed_mid_commit_the_next_load_finishes_it_and_nothing_loads_a_mix(old_and_new):
    ckpt, out, _old, new = old_and_new
    env = {"HF_RTP_TIMEOUT": "10", "HF_RTP_FAULT": "kill@save.commit.mid#0"}
    [(seconds, message)] = run_on_ranks(_save, 2, ckpt, out, 0.5, env=env, survivors=(1,))
    assert seconds < 30 and "another rank died" in message
    assert os.path.exists(os.path.join(out, ".hf_rtp-commit.json"))
    with pytest.raises(
        OSError, match=r"model.safetensors"
    ):  # vanilla finds no entry point in the window: an error, not a mixed model
        _vanilla_sum(out)
    assert run_on_ranks(_load_sum, 2, out) == [pytest.approx(new, rel=1e-12)] * 2  # hf_rtp finishes the commit
    assert _vanilla_sum(out) == pytest.approx(new, rel=1e-12)
    assert not [f for f in os.listdir(out) if f.startswith(".hf_rtp")]


def test_killed_before_the_commit_keeps_the_old_checkpoint_and_the_next_save_cleans_up(old_and_new):
    ckpt, out, old, new = old_and_new
    env = {"HF_RTP_TIMEOUT": "10", "HF_RTP_FAULT": "kill@save.commit#0"}
    run_on_ranks(_save, 2, ckpt, out, 0.5, env=env, survivors=(1,))
    assert [f for f in os.listdir(out) if f.startswith(".hf_rtp-staging-")]  # the killed save's files
    assert _vanilla_sum(out) == pytest.approx(old, rel=1e-12)
    run_on_ranks(_save, 2, ckpt, out, 0.5)
    assert _vanilla_sum(out) == pytest.approx(new, rel=1e-12)
    assert not [f for f in os.listdir(out) if f.startswith(".hf_rtp")]


def test_a_writer_stopped_mid_save_is_an_error_on_the_other_rank_within_the_timeout(old_and_new):
    ckpt, out, old, _ = old_and_new
    env = {"HF_RTP_TIMEOUT": "10", "HF_RTP_FAULT": "stop@save.write#0:3"}
    [(seconds, message)] = run_on_ranks(_save, 2, ckpt, out, 0.5, env=env, survivors=(1,), timeout=120)
    assert seconds < 40, seconds
    assert "HF_RTP_TIMEOUT" in message
    assert _vanilla_sum(out) == pytest.approx(old, rel=1e-12)


def test_a_single_file_resave_with_the_same_config_is_one_rename(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    out = tmp_path / "out"
    model.save_pretrained(out)
    config_inode = os.stat(out / "config.json").st_ino
    model.save_pretrained(out)
    assert os.stat(out / "config.json").st_ino == config_inode  # untouched: only model.safetensors was replaced
    assert load_file(str(out / "model.safetensors")).keys() == load_file(os.path.join(ckpt, "model.safetensors")).keys()


def test_a_commit_that_fails_half_way_keeps_its_staged_files_for_the_next_load(old_and_new):
    ckpt, out, _old, new = old_and_new
    env = {"HF_RTP_FAULT": "raise@save.commit.mid#0"}  # e.g. EIO or ENOSPC between two renames
    for _seconds, message in run_on_ranks(_save, 2, ckpt, out, 0.5, env=env):
        assert "No space left on device" in message
    assert [f for f in os.listdir(out) if f.startswith(".hf_rtp-staging-")]  # what the journal names, kept
    assert run_on_ranks(_load_sum, 2, out) == [pytest.approx(new, rel=1e-12)] * 2
    assert _vanilla_sum(out) == pytest.approx(new, rel=1e-12)


def _load_into_sum(ckpt, out):
    import hf_rtp
    from hf_rtp.checkpoint.load import load_into

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64)
    load_into(model, out)  # what Trainer's load_best_model_at_end calls
    return sum(float(p.full_tensor().sum() if hasattr(p, "full_tensor") else p.sum()) for p in model.parameters())


def test_loading_a_best_model_whose_save_was_killed_mid_commit_finishes_it(old_and_new):
    ckpt, out, _old, new = old_and_new
    env = {"HF_RTP_TIMEOUT": "10", "HF_RTP_FAULT": "kill@save.commit.mid#0"}
    run_on_ranks(_save, 2, ckpt, out, 0.5, env=env, survivors=(1,))
    assert run_on_ranks(_load_into_sum, 2, ckpt, out) == [pytest.approx(new, rel=1e-12)] * 2
