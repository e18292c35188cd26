"""Training checkpoints: a damaged one is refused before anything is loaded, and a save that is
killed or stopped at a named point (HF_RTP_FAULT) leaves a complete checkpoint behind."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from support.folders import unplanted
from support.models import global_batch, make_tiny
from support.spawn import run_on_ranks

TIMEOUT = {"HF_RTP_TIMEOUT": "10"}


def _train(model, optimizer, steps):
    import hf_rtp

    rank = int(os.environ["RANK"])
    for step in range(steps):
        batch = global_batch(2, seed=step)[rank]
        model(input_ids=batch, labels=batch).loss.backward()
        hf_rtp.sync_grads(model)
        optimizer.step()
        optimizer.zero_grad()


def _local_params(model):
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def _save_after(ckpt, state_dir, steps):
    """Train `steps` steps and save; return this rank's parameters (as numpy) and any error."""
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, steps)
    start = time.monotonic()
    try:
        hf_rtp.save_training_state(state_dir, model, optimizer, extra={"step": steps})
    except hf_rtp.CheckpointError as err:
        return time.monotonic() - start, str(err)
    return [p.numpy() for p in _local_params(model)]


def _load(ckpt, state_dir, variant="plain"):
    """Load `state_dir`; return (error or None, parameters untouched by a refused load, step, params)."""
    import hf_rtp

    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32, plan="auto" if variant == "other_plan" else None)
    params = model.parameters()
    optimizer = (
        torch.optim.SGD(params, lr=1, momentum=0.9) if variant == "other_optimizer" else torch.optim.AdamW(params)
    )
    before = _local_params(model)
    try:
        extra = hf_rtp.load_training_state(state_dir, model, optimizer)
    except hf_rtp.CheckpointError as err:
        untouched = all(torch.equal(a, b) for a, b in zip(before, _local_params(model), strict=True))
        return str(err), untouched, None, None
    return None, None, extra["step"], [p.numpy() for p in _local_params(model)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    ckpt = make_tiny("llama", root / "ckpt")
    params = run_on_ranks(_save_after, 2, ckpt, str(root / "state"), 1)
    return ckpt, str(root / "state"), params


def _shards(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def _drop_files_record(folder):
    path = os.path.join(folder, "training_state.json")
    state = json.loads(Path(path).read_text())
    del state["files"]  # as a checkpoint without hf_rtp's file list would be: coverage must still catch it
    Path(path).write_text(json.dumps(state))


DAMAGE = {
    "deleted_shard": (lambda d: os.remove(os.path.join(d, _shards(d)[1])), r"is incomplete: shard-00002-\S+ missing"),
    "truncated_shard": (
        lambda d: os.truncate(os.path.join(d, _shards(d)[0]), 1000),
        r"has 1000 bytes but was saved with",
    ),
    "bad_json": (
        lambda d: Path(os.path.join(d, "training_state.json")).write_text("{"),
        r"training_state.json is damaged",
    ),
    "stray_file": (
        lambda d: shutil.copy(os.path.join(d, _shards(d)[0]), os.path.join(d, "shard-00009.safetensors")),
        r"holds file\(s\) its save did not write \(shard-00009.safetensors\)",
    ),
    "deleted_shard_unrecorded": (
        lambda d: (_drop_files_record(d), os.remove(os.path.join(d, _shards(d)[1]))),
        r"(holds \d+ of the \d+ elements of|it lacks model\.).*A file of the checkpoint is missing",
    ),
    "other_optimizer": (lambda d: None, r"does not match this model and optimizer: it lacks optim\..*momentum_buffer"),
    "other_plan": (
        lambda d: None,
        r"saved from a LlamaForCausalLM with plan 'llama', but this model is a LlamaForCausalLM with plan 'auto'",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_training_checkpoint_is_refused_on_every_rank_before_anything_loads(saved, tmp_path, case):
    ckpt, state, _ = saved
    copy = shutil.copytree(state, tmp_path / "state")
    damage, message = DAMAGE[case]
    damage(str(copy))
    variant = case if case.startswith("other_") else "plain"
    for error, untouched, _, _ in run_on_ranks(_load, 2, ckpt, str(copy), variant):
        assert error is not None and untouched
        assert __import__("re").search(message, error), error


def test_killed_before_the_swap_keeps_the_previous_checkpoint(saved, tmp_path):
    ckpt, state, saved_params = saved
    target = str(shutil.copytree(state, tmp_path / "state"))
    env = {**TIMEOUT, "HF_RTP_FAULT": "kill@state.commit#0"}
    [(seconds, message)] = run_on_ranks(_save_after, 2, ckpt, target, 2, env=env, survivors=(1,))
    assert seconds < 30, seconds
    assert "another rank died, was stopped, or did not reach the same call within HF_RTP_TIMEOUT" in message
    after = run_on_ranks(_load, 2, ckpt, target)
    for (_, _, step, params), params_saved in zip(after, saved_params, strict=True):
        assert step == 1
        assert all((a == b).all() for a, b in zip(params, params_saved, strict=True))


def test_killed_between_the_renames_of_the_fallback_recovers_the_new_checkpoint(saved, tmp_path):
    ckpt, state, _ = saved
    target = str(shutil.copytree(state, tmp_path / "state"))
    env = {**TIMEOUT, "HF_RTP_FAULT": "kill@state.commit.aside#0", "HF_RTP_NO_RENAME_EXCHANGE": "1"}
    run_on_ranks(_save_after, 2, ckpt, target, 2, env=env, survivors=(1,))
    assert not os.path.exists(target) and os.path.isdir(target + ".old") and os.path.isdir(target + ".partial")
    expected = run_on_ranks(_save_after, 2, ckpt, str(tmp_path / "reference"), 2)
    for (error, _, step, params), reference in zip(run_on_ranks(_load, 2, ckpt, target), expected, strict=True):
        assert error is None and step == 2
        assert all((a == b).all() for a, b in zip(params, reference, strict=True))
    assert unplanted(os.listdir(tmp_path)) == ["reference", "state"]  # leftovers cleaned once recovered


def test_a_rank_stopped_mid_save_is_an_error_within_the_timeout_and_the_old_checkpoint_stays(saved, tmp_path):
    ckpt, state, _ = saved
    target = str(shutil.copytree(state, tmp_path / "state"))
    env = {**TIMEOUT, "HF_RTP_FAULT": "stop@state.write#1"}
    [(seconds, message)] = run_on_ranks(_save_after, 2, ckpt, target, 2, env=env, survivors=(0,), timeout=120)
    assert seconds < 40, seconds
    assert "another rank stopped, died or did not call it within HF_RTP_TIMEOUT" in message
    for _, _, step, _ in run_on_ranks(_load, 2, ckpt, target):
        assert step == 1
