"""save_pretrained's keywords with vanilla's meaning, or refused by name, and the save's tensors agreed by every
rank: `is_main_process=False` on every rank writes nothing, as vanilla; `save_original_format=False` writes the
model's own names as vanilla does (it was dropped, so a per-expert Mixtral saved per-expert anyway);
`distributed_checkpoint=True` is refused (vanilla raises for a model neither FSDP nor tensor parallel); ranks
passing different `state_dict=` fail at once on every rank (a rotated tensor's pieces pair by order, so one
tensor's rows were written under another's name, without an error)."""

import os
import time

import pytest
import torch
from support.models import make_tiny
from support.spawn import run_on_ranks

from hf_rtp.errors import CheckpointError, CollectiveMisuseError, KeywordError


def _saves(ckpt, out):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import hf_rtp

    rank = int(os.environ["RANK"])
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    said = {}
    model.save_pretrained(f"{out}/ours", save_original_format=False)
    if rank == 0:
        vanilla.save_pretrained(f"{out}/theirs", save_original_format=False)
        ours, theirs = load_file(f"{out}/ours/model.safetensors"), load_file(f"{out}/theirs/model.safetensors")
        said["names"] = (sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))[:4])
        said["values"] = all(torch.equal(ours[k], theirs[k]) for k in theirs if k in ours)
        said["per expert"] = any(".experts.0." in k for k in ours)
    model.save_pretrained(f"{out}/none", is_main_process=False)  # on every rank: vanilla writes nothing
    said["none"] = os.listdir(f"{out}/none")
    model.save_pretrained(f"{out}/main", is_main_process=rank == 0)  # accelerate's pattern: rank 0 is main
    said["main"] = os.path.exists(f"{out}/main/model.safetensors")
    with pytest.raises(KeywordError) as refused:
        model.save_pretrained(f"{out}/dcp", distributed_checkpoint=True)
    said["dcp"] = str(refused.value)
    whole = model.state_dict()
    mine = {k: v for k, v in whole.items() if f"layers.{1 - rank}." not in k}  # each rank drops another layer
    began = time.monotonic()
    with pytest.raises(CollectiveMisuseError) as refused:
        model.save_pretrained(f"{out}/mixed", state_dict=mine)
    said["mixed"] = (str(refused.value), time.monotonic() - began, os.path.exists(f"{out}/mixed/model.safetensors"))
    unsavable = whole if rank == 0 else {"x": object()}  # a state_dict= only rank 1 cannot save
    with pytest.raises(CheckpointError) as refused:
        model.save_pretrained(f"{out}/unsavable", state_dict=unsavable)
    said["unsavable"] = str(refused.value)
    return said


def test_save_keywords_keep_vanillas_meaning_and_ranks_agree_on_the_tensors(tmp_path):
    ckpt = make_tiny("mixtral", tmp_path / "ckpt")  # stored per expert, as Mixtral's Hub checkpoints are
    for rank, said in enumerate(run_on_ranks(_saves, 2, ckpt, str(tmp_path / "out"))):
        if rank == 0:
            assert said["names"] == (True, []), said["names"]
            assert said["values"] and not said["per expert"], said
        assert said["none"] == [] and said["main"], said
        assert "distributed_checkpoint=True" in said["dcp"]
        message, seconds, written = said["mixed"]
        assert "ranks asked to save different tensors" in message and seconds < 30 and not written, said["mixed"]
        assert "rank 1 failed" in said["unsavable"], said["unsavable"]  # on both ranks, at once
