"""Damaged or hostile checkpoints: each is refused with an error that names the file and the fix,
or, where vanilla transformers accepts it, loaded exactly as vanilla loads it (warnings included)."""

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.models import fake_hub_cache, global_batch, make_tiny_llama
from support.spawn import run_on_ranks
from transformers import AutoModelForCausalLM

import hf_rtp


def _sharded(tmp_path):
    return make_tiny_llama(tmp_path / "ckpt", max_shard_size="12KB")


def _edit_index(ckpt, name_of):
    path = os.path.join(ckpt, "model.safetensors.index.json")
    index = json.loads(Path(path).read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = name_of(index["weight_map"][first])
    Path(path).write_text(json.dumps(index))


@pytest.mark.parametrize("trick", ["/dev/stdin", "../outside.safetensors", "/etc/hostname", "sub/../../x.safetensors"])
def test_index_naming_files_outside_the_checkpoint_is_refused_unread(tmp_path, trick):
    ckpt = _sharded(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "outside.safetensors"))
    _edit_index(ckpt, lambda _: trick)
    with pytest.raises(hf_rtp.CheckpointError, match=r"may only name files inside its own folder"):
        hf_rtp.from_pretrained(ckpt)  # /dev/stdin would block here forever if it were opened


def test_index_naming_a_fifo_inside_the_folder_is_refused_unopened(tmp_path):
    ckpt = _sharded(tmp_path)
    os.mkfifo(os.path.join(ckpt, "pipe.safetensors"))  # opening a fifo for reading blocks until a writer comes
    _edit_index(ckpt, lambda _: "pipe.safetensors")
    with pytest.raises(hf_rtp.CheckpointError, match=r"'pipe.safetensors', which is not a regular file"):
        hf_rtp.from_pretrained(ckpt)


def test_a_float_weight_stored_as_int32_names_the_tensor(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].view(torch.int32)  # same bytes, I32 header
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(
        hf_rtp.CheckpointError, match=r"model.norm.weight is stored as torch.int32 .* floating-point weight"
    ):
        hf_rtp.from_pretrained(ckpt)


def test_bf16_checkpoint_without_config_dtype_loads_as_bf16_like_vanilla(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt")
    path = os.path.join(ckpt, "model.safetensors")
    save_file({k: v.bfloat16() for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    config = json.loads(Path(os.path.join(ckpt, "config.json")).read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    Path(os.path.join(ckpt, "config.json")).write_text(json.dumps(config))
    vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto")
    ours = hf_rtp.from_pretrained(ckpt, dtype="auto")
    assert vanilla.dtype == torch.bfloat16
    assert ours.dtype == vanilla.dtype and ours.config.dtype == vanilla.config.dtype


def _losses_and_head(ckpt):
    batch = global_batch(2)[int(os.environ["RANK"])]
    model = hf_rtp.from_pretrained(ckpt, dtype=torch.float64)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return model(input_ids=batch, labels=batch).loss.item(), tied


def test_tied_config_whose_file_stores_another_head_unties_and_warns_like_vanilla(tmp_path, caplog):
    ckpt = make_tiny_llama(tmp_path / "ckpt", tied=True)
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])  # stored, and different
    save_file(tensors, path, metadata={"format": "pt"})

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    hf_logging.enable_propagation()  # transformers' logger does not reach caplog otherwise
    try:
        with caplog.at_level(logging.WARNING):
            vanilla = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    finally:
        hf_logging.disable_propagation()
        hf_logging.set_verbosity(verbosity)
    assert vanilla.lm_head.weight is not vanilla.model.embed_tokens.weight
    assert "both are present in the checkpoints with different values, so we will NOT tie them" in caplog.text
    expected = [vanilla(input_ids=b, labels=b).loss.item() for b in global_batch(2)]
    results = run_on_ranks(_losses_and_head, 2, ckpt)
    for rank, (loss, tied) in enumerate(results):
        assert not tied
        assert loss == pytest.approx(expected[rank], rel=1e-9)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_rtp"):
        single = hf_rtp.from_pretrained(ckpt, dtype=torch.float64)
    assert "so we will NOT tie them" in caplog.text
    out = tmp_path / "saved"
    single.save_pretrained(out)
    assert set(load_file(str(out / "model.safetensors"))) == set(tensors)  # both written back, as vanilla does


def test_tied_config_whose_file_stores_an_equal_head_stays_tied(tmp_path):
    ckpt = make_tiny_llama(tmp_path / "ckpt", tied=True)
    path = os.path.join(ckpt, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    for _, tied in run_on_ranks(_losses_and_head, 2, ckpt):
        assert tied


def _load_expecting_error(paths, kwargs_per_rank):
    rank = int(os.environ["RANK"])
    try:
        hf_rtp.from_pretrained(paths[rank], dtype=torch.float32, **kwargs_per_rank[rank])
    except hf_rtp.CheckpointError as err:
        return str(err)
    return None


def test_ranks_loading_different_checkpoints_of_one_shape_fail_on_every_rank(tmp_path):
    a = make_tiny_llama(tmp_path / "a", seed=0)
    b = make_tiny_llama(tmp_path / "b", seed=1)  # same config and shapes, other weights
    for message in run_on_ranks(_load_expecting_error, 2, [a, b], [{}, {}]):
        assert message and "the weight bytes differ in model.safetensors (rank 0: #" in message


def test_a_byte_identical_copy_in_another_folder_is_the_same_checkpoint(tmp_path):
    import shutil

    a = make_tiny_llama(tmp_path / "a")
    b = shutil.copytree(a, tmp_path / "b")
    assert run_on_ranks(_load_expecting_error, 2, [a, str(b)], [{}, {}]) == [None, None]


def test_one_rank_with_another_piece_size_or_plan_fails_before_the_first_forward(tmp_path):
    a = make_tiny_llama(tmp_path / "a")
    for message in run_on_ranks(_load_expecting_error, 2, [a, a], [{}, {"rotation_piece_size": "1KB"}]):
        assert "rank 1 differs from rank 0 in rotation_piece_size (1000 bytes vs 16000000 bytes)" in message
    for message in run_on_ranks(_load_expecting_error, 2, [a, a], [{}, {"plan": "auto"}]):
        assert "rank 1 differs from rank 0 in plan (auto" in message
    # gradient accumulators of another size on the wire would be read as garbage
    for message in run_on_ranks(_load_expecting_error, 2, [a, a], [{}, {"reduce_dtype": "bfloat16"}]):
        assert "rank 1 differs from rank 0 in reduce_dtype (torch.bfloat16 vs torch.float32)" in message


def test_config_differing_on_one_rank_is_named(tmp_path):
    a = make_tiny_llama(tmp_path / "a")
    b = make_tiny_llama(tmp_path / "b", rms_norm_eps=1e-3)
    for message in run_on_ranks(_load_expecting_error, 2, [a, b], [{}, {}]):
        assert "rank 1 differs from rank 0 in config" in message


def _load_from_cache(caches):
    rank = int(os.environ["RANK"])
    os.environ["LOCAL_RANK"] = "0"  # each rank is the first of its own node, with its own cache
    try:
        model = hf_rtp.from_pretrained("org/tiny", cache_dir=caches[rank], dtype=torch.float32)
    except hf_rtp.CheckpointError as err:
        return str(err)
    return model.model.norm.weight.detach().sum().item()


def test_hub_revision_is_chosen_once_by_rank_0_for_nodes_with_their_own_caches(tmp_path):
    old, new = make_tiny_llama(tmp_path / "old", seed=0), make_tiny_llama(tmp_path / "new", seed=1)
    commit_old, commit_new = "a" * 40, "b" * 40
    cache0 = fake_hub_cache(str(tmp_path / "c0"), "org/tiny", {commit_old: old})
    cache1 = fake_hub_cache(str(tmp_path / "c1"), "org/tiny", {commit_old: old, commit_new: new})  # main moved on
    loaded = run_on_ranks(_load_from_cache, 2, [cache0, cache1])
    expected = load_file(os.path.join(old, "model.safetensors"))["model.norm.weight"].sum().item()
    assert loaded == [pytest.approx(expected)] * 2  # rank 1 read rank 0's commit, not its own main

    cache2 = fake_hub_cache(str(tmp_path / "c2"), "org/tiny", {commit_new: new})  # lacks rank 0's commit
    for message in run_on_ranks(_load_from_cache, 2, [cache0, cache2]):
        assert f"at revision {commit_old} (the commit rank 0 resolved) is not in this rank's cache" in message
        assert "rank 1 failed" in message or message.startswith("'org/tiny'")


def test_a_path_that_is_a_folder_on_one_rank_only_is_named(tmp_path):
    a = make_tiny_llama(tmp_path / "a")
    for message in run_on_ranks(_load_expecting_error, 2, [a, str(tmp_path / "missing")], [{}, {}]):
        assert "is a local folder on rank(s) [0] but not on rank(s) [1]" in message
