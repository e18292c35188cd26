"""push_to_hub: offline, the folder is a complete checkpoint and the refusal a clear error; online (a local
endpoint), the commit holds exactly the files the save wrote and vanilla's model card, whatever else the
folder holds."""

import os

import pytest
import torch
from support.models import make_tiny_llama
from support.spawn import run_on_ranks
from transformers import AutoModelForCausalLM

import hf_rtp


def test_push_saves_then_fails_clearly_offline(tmp_path):
    model = hf_rtp.from_pretrained(make_tiny_llama(tmp_path / "ckpt"), dtype=torch.float32)
    folder = tmp_path / "to-push"
    with pytest.raises(
        hf_rtp.CheckpointError, match=r"could not push .* as someone/tiny.*checkpoint itself is complete"
    ):
        model.save_pretrained(folder, push_to_hub=True, repo_id="someone/tiny")
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors"]
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert all(
        torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values(), strict=True)
    )
    with pytest.raises(hf_rtp.CheckpointError, match="someone/tiny"):
        model.push_to_hub("someone/tiny")
    # vanilla hands what it does not know to create_repo, which refuses it: here, refused before saving
    with pytest.raises(TypeError, match=r"push_to_hub=True\) got keyword arguments .*: revision"):
        model.save_pretrained(tmp_path / "never", push_to_hub=True, revision="v1")
    assert not (tmp_path / "never").exists()


def _save_and_push(ckpt, folder, vanilla_folder):
    kwargs = {"private": True, "token": "hf_test"}
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float32)
    model.save_pretrained(folder, push_to_hub=True, repo_id="me/saved", **kwargs)
    model.push_to_hub("me/pushed", commit_message="second", tags=["mine"], **kwargs)
    model.push_to_hub("me/sharded", max_shard_size="20KB", **kwargs)  # an index and its shards
    if torch.distributed.get_rank() == 0:  # vanilla, beside it: what a DDP script's main process pushes
        vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        vanilla.save_pretrained(vanilla_folder, push_to_hub=True, repo_id="me/vanilla", **kwargs)


def _users_folder(path):
    """What Trainer's output_dir and a user leave beside a model: none of it is the save's to publish."""
    os.makedirs(path / "checkpoint-5")
    (path / "checkpoint-5" / "optimizer.pt").write_bytes(b"private optimizer state")
    (path / "notes.txt").write_text("my own notes")
    (path / "README.md").write_text("the user's own readme")


def test_push_publishes_exactly_the_files_the_save_wrote_as_vanilla_does(tmp_path):
    from support.hub_endpoint import HubEndpoint

    ckpt = make_tiny_llama(tmp_path / "ckpt")
    folder, vanilla_folder = tmp_path / "out", tmp_path / "vanilla"
    _users_folder(folder)
    _users_folder(vanilla_folder)
    with HubEndpoint() as hub:
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf_home")}
        run_on_ranks(_save_and_push, 2, ckpt, str(folder), str(vanilla_folder), env=env, fresh=True)

    commits = {c["repo"]: c for c in hub.commits}
    assert sorted(commits) == ["me/pushed", "me/saved", "me/sharded", "me/vanilla"]  # one per push: the writer's
    sharded = set(commits["me/sharded"]["files"])
    shards = {n for n in sharded if n.startswith("model-") and n.endswith(".safetensors")}
    assert len(shards) > 1 and sharded == shards | {"model.safetensors.index.json", "config.json"} | {
        "generation_config.json",
        "README.md",
    }
    saved, pushed, vanilla = commits["me/saved"], commits["me/pushed"], commits["me/vanilla"]
    checkpoint = {"config.json", "generation_config.json", "model.safetensors"}
    assert set(vanilla["files"]) == checkpoint | {"README.md"}
    assert set(saved["files"]) == set(pushed["files"]) == set(vanilla["files"])
    for name in checkpoint:  # the bytes published are the bytes saved
        assert saved["files"][name] == (folder / name).read_bytes(), name
    assert saved["files"]["README.md"] == vanilla["files"]["README.md"]  # vanilla's card
    assert b"- mine" in pushed["files"]["README.md"] and b"library_name: transformers" in pushed["files"]["README.md"]
    assert saved["message"] == vanilla["message"] == "Upload LlamaForCausalLM" and pushed["message"] == "second"
    created = [body for method, path, body in hub.requests if path == "/api/repos/create"]
    assert [body["visibility"] for body in created] == ["private"] * 4
    # the user's files are where they were, as they were
    assert (folder / "README.md").read_text() == "the user's own readme"
    assert (folder / "checkpoint-5" / "optimizer.pt").read_bytes() == b"private optimizer state"
