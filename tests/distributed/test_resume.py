"""Training state saved by N ranks loads on M: parameters and AdamW moments land on their new owners."""

import os

import torch
from safetensors.torch import load_file, save_file
from support.models import make_tiny, trained_one_step
from support.spawn import run_on_ranks


def _train_and_save(ckpt, state_dir, reference):
    from torch.distributed.tensor import DTensor

    from hf_rtp.training_state import save_training_state

    rank = int(os.environ["RANK"])
    model, optimizer = trained_one_step(ckpt)
    save_training_state(state_dir, model, optimizer, extra={"step": 1, "samples_seen": 4})
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t.detach()  # noqa: E731
    names = {p: n for n, p in model.named_parameters()}
    tensors = {f"param.{n}": full(p) for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        tensors[f"exp_avg.{names[p]}"] = full(state["exp_avg"])
    if rank == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, reference)


def _load_elsewhere(ckpt, state_dir, reference):
    from torch.distributed.tensor import DTensor

    import hf_rtp
    from hf_rtp.distributed.tensors.sharding import chunk_rows
    from hf_rtp.training_state import load_training_state

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = load_training_state(state_dir, model, optimizer)
    expected = load_file(reference)
    names = {p: n for n, p in model.named_parameters()}
    for p, name in names.items():
        rows = slice(*chunk_rows(p.shape[0], world, rank)) if isinstance(p, DTensor) else slice(None)
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        assert torch.equal(local(p).detach(), expected[f"param.{name}"][rows]), name
        assert torch.equal(local(optimizer.state[p]["exp_avg"]), expected[f"exp_avg.{name}"][rows]), name
        assert int(optimizer.state[p]["step"]) == 1
    return extra["step"], extra["samples_seen"]


def test_state_saved_on_two_ranks_resumes_on_three(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    state_dir, reference = str(tmp_path / "checkpoint-1"), str(tmp_path / "reference.safetensors")
    run_on_ranks(_train_and_save, 2, ckpt, state_dir, reference)
    assert not os.path.exists(state_dir + ".partial")
    assert all(f.endswith((".safetensors", ".json")) for f in os.listdir(state_dir))  # nothing pickled
    assert run_on_ranks(_load_elsewhere, 3, ckpt, state_dir, reference) == [(1, 4)] * 3


def test_interrupted_save_is_refused_with_a_clear_error(tmp_path):
    import pytest

    import hf_rtp
    from hf_rtp.training_state import load_training_state

    partial = tmp_path / "checkpoint-6.partial"
    partial.mkdir()
    model = hf_rtp.from_pretrained(make_tiny("llama", tmp_path / "ckpt"))
    with pytest.raises(hf_rtp.CheckpointError, match=r"not a complete training checkpoint.*resume from an earlier"):
        load_training_state(str(partial), model, torch.optim.AdamW(model.parameters()))
