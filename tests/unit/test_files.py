"""hf_rtp/checkpoint/files.py: which files a checkpoint's weights are in, and which folders and index entries
are refused, called directly on folders vanilla transformers saved here. (from_pretrained's own answers to a
truncated file, a missing shard, pickle-only weights and a path that is neither folder nor Hub id are in
tests/distributed/test_bad_input.py; hostile headers in tests/faults/test_hostile_inputs.py.)"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.folders import snapshot
from support.models import fake_hub_cache, make_tiny_llama, stored_names, tiny_config
from transformers import AutoModelForCausalLM

import hf_rtp
from hf_rtp.checkpoint.files import CheckpointFiles, find_weights, resolve_directory
from hf_rtp.errors import CheckpointError

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("single") / "ckpt")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("sharded") / "ckpt", max_shard_size="12KB")


@pytest.fixture
def copy_of(tmp_path):
    """A copy of a checkpoint folder to damage (files copied, not linked)."""

    def copy(folder):
        return shutil.copytree(folder, tmp_path / "copy")

    return copy


def _index(folder) -> dict:
    with open(os.path.join(folder, INDEX)) as f:
        return json.load(f)


def _write_index(folder, index) -> None:
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f)


def test_a_single_file_checkpoint_is_that_file_and_its_tensors(single):
    found = find_weights(single)
    assert found == CheckpointFiles(single, (os.path.join(single, "model.safetensors"),))
    entries = found.tensors()
    assert set(entries) == stored_names(single)
    stored = load_file(os.path.join(single, "model.safetensors"))
    entry = entries["model.layers.1.mlp.down_proj.weight"]
    assert (entry.name, entry.dtype, entry.shape) == (
        "model.layers.1.mlp.down_proj.weight",
        torch.float32,
        stored["model.layers.1.mlp.down_proj.weight"].shape,
    )


def test_a_sharded_checkpoint_is_the_files_its_index_names_each_tensor_where_the_index_says(sharded):
    weight_map = _index(sharded)["weight_map"]
    found = find_weights(sharded)
    assert found.weight_files == tuple(sorted(os.path.join(sharded, f) for f in set(weight_map.values())))
    assert len(found.weight_files) > 2
    entries = found.tensors()
    assert set(entries) == set(weight_map)
    assert all(entries[name].path == os.path.join(sharded, file) for name, file in weight_map.items())


def test_a_variant_is_found_by_vanillas_names_and_only_when_asked_for(tmp_path):
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model.save_pretrained(tmp_path / "one", variant="fp16")
    model.save_pretrained(tmp_path / "many", variant="fp16", max_shard_size="12KB")
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    assert find_weights(one, "fp16").weight_files == (os.path.join(one, "model.fp16.safetensors"),)
    shards = find_weights(many, "fp16").weight_files
    assert len(shards) > 2 and all(os.path.basename(p).startswith("model.fp16-") for p in shards)
    assert set(find_weights(many, "fp16").tensors()) == set(find_weights(one, "fp16").tensors())
    with pytest.raises(CheckpointError, match=rf"no model.safetensors or {INDEX} in {one}$"):
        find_weights(one)  # the variant's file is not the plain checkpoint
    with pytest.raises(CheckpointError, match=r"no model.bf16.safetensors or model.safetensors.index.bf16.json in"):
        find_weights(one, "bf16")


@pytest.mark.parametrize("variant", ["", "a/b", "../fp16", os.sep + "fp16"])
def test_a_variant_that_is_not_a_plain_name_is_refused(single, variant):
    with pytest.raises(ValueError, match="variant must be a plain name"):
        find_weights(single, variant)


@pytest.mark.parametrize(
    "name",
    [
        "../model.safetensors",
        "/etc/passwd",
        "/dev/stdin",
        "a/../../x",
        "./x",
        "a//x",
        "..\\x",
        "sub/x.safetensors",
        "sub\\x.safetensors",
        "x\0.safetensors",
        ".",
        "..",
        "",
        3,
        None,
    ],
)
def test_an_index_entry_that_is_not_a_file_inside_the_folder_is_refused(sharded, copy_of, name):
    folder = copy_of(sharded)
    index = _index(folder)
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = name
    _write_index(folder, index)
    with pytest.raises(CheckpointError, match=r"an index may only name files inside its own folder") as refused:
        find_weights(str(folder))
    assert repr(name) in str(refused.value) and os.path.join(str(folder), INDEX) in str(refused.value)


def test_an_index_entry_naming_a_file_in_a_subfolder_is_refused_though_the_file_is_there(sharded, copy_of):
    """An index names plain file names only: a shard moved into a subfolder of the checkpoint, whole and holding
    what the index says, is not read through a path (vanilla writes plain names; docs/reliability.md says so)."""
    folder = copy_of(sharded)
    index = _index(folder)
    shard = sorted(set(index["weight_map"].values()))[0]
    (folder / "sub").mkdir()
    os.rename(folder / shard, folder / "sub" / shard)
    index["weight_map"] = {k: f"sub/{v}" if v == shard else v for k, v in index["weight_map"].items()}
    _write_index(folder, index)
    with pytest.raises(CheckpointError, match=rf"names 'sub/{shard}' as a weight file; an index may only name files"):
        find_weights(str(folder))


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_an_index_entry_that_is_not_a_regular_file_is_refused_unread(sharded, copy_of, kind):
    folder = copy_of(sharded)
    index = _index(folder)
    index["weight_map"][sorted(index["weight_map"])[0]] = "odd.safetensors"
    _write_index(folder, index)
    (folder / "odd.safetensors").mkdir() if kind == "folder" else os.mkfifo(folder / "odd.safetensors")
    with pytest.raises(CheckpointError, match=r"names 'odd.safetensors', which is not a regular file; refusing"):
        find_weights(str(folder))  # a FIFO would block a read forever


def test_index_entries_that_link_to_files_elsewhere_are_read_as_hub_caches_link_blobs(sharded, tmp_path):
    folder, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    shutil.copytree(sharded, blobs)
    folder.mkdir()
    for name in os.listdir(blobs):
        os.symlink(blobs / name, folder / name)
    assert set(find_weights(str(folder)).tensors()) == stored_names(sharded)


def test_every_missing_shard_is_named(sharded, copy_of):
    folder = copy_of(sharded)
    shards = sorted(f for f in os.listdir(folder) if f.startswith("model-"))
    os.remove(folder / shards[0])
    os.remove(folder / shards[2])
    with pytest.raises(
        CheckpointError, match=rf"refers to missing file\(s\) {shards[0]}, {shards[2]}: the download is incomplete"
    ):
        find_weights(str(folder))


def test_an_index_that_puts_a_tensor_in_a_file_that_lacks_it_is_refused_when_the_tensors_are_read(sharded, copy_of):
    folder = copy_of(sharded)
    index = _index(folder)
    name = "model.norm.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    _write_index(folder, index)
    found = find_weights(str(folder))  # every file it names is there
    with pytest.raises(CheckpointError, match=rf"lists {name} in {other}, but that file does not hold it"):
        found.tensors()
    index["weight_map"]["model.not_stored.weight"] = other
    index["weight_map"][name] = _index(sharded)["weight_map"][name]
    _write_index(folder, index)
    with pytest.raises(CheckpointError, match=rf"lists model.not_stored.weight in {other}, but that file does not"):
        find_weights(str(folder)).tensors()


@pytest.mark.parametrize(
    "text", ["not json", "[]", '{"metadata": {}}', '{"weight_map": ["model-00001-of-00002.safetensors"]}']
)
def test_an_index_that_is_not_one_is_refused_naming_it(sharded, copy_of, text):
    folder = copy_of(sharded)
    (folder / INDEX).write_text(text)
    with pytest.raises(CheckpointError, match=rf"{folder / INDEX} is not a valid safetensors index .*save it again"):
        find_weights(str(folder))


def test_the_index_wins_over_a_single_file_beside_it(sharded, copy_of):
    folder = copy_of(sharded)
    save_file({"stale": torch.zeros(1)}, str(folder / "model.safetensors"))
    assert os.path.join(str(folder), "model.safetensors") not in find_weights(str(folder)).weight_files


def test_pickle_weights_alone_are_refused_unopened_naming_each(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for name in ("pytorch_model.bin", "model.pt", "notes.txt"):
        (tmp_path / name).write_bytes(b"\x80 not a pickle either")  # opened, it would fail otherwise
    with pytest.raises(CheckpointError, match=r"holds only pickle weights \(model.pt, pytorch_model.bin\)\. hf_rtp"):
        find_weights(str(tmp_path))


def test_a_folder_without_weights_names_what_it_looked_for(tmp_path):
    with pytest.raises(CheckpointError, match=rf"no model.safetensors or {INDEX} in {tmp_path}$"):
        find_weights(str(tmp_path))


def test_a_local_folder_is_itself_with_no_commit(single):
    assert resolve_directory(single) == (single, None)


def test_a_local_folder_without_config_is_refused_and_an_adapter_alone_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"{tmp_path} has no config.json; is it a transformers checkpoint"):
        resolve_directory(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds a PEFT adapter only \(adapter_config.json, no config.json\)"):
        resolve_directory(str(tmp_path))


def test_a_local_folder_without_config_but_with_a_journal_is_left_to_the_loads_recovery_step(tmp_path):
    """A first save a crash interrupted right after its journal was written has no config.json yet: resolving the
    folder neither refuses nor recovers it; the load's recovery step does, and the config check follows it."""
    (tmp_path / ".hf_rtp-commit.json").write_text('{"staging": ".", "files": []}')  # not one hf_rtp can prove
    assert resolve_directory(str(tmp_path)) == (str(tmp_path), None)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError, match=rf"{tmp_path} has no config.json; is it a transformers checkpoint"):
        hf_rtp.from_pretrained(str(tmp_path))  # the journal left alone (a warning says why), then the refusal
    assert snapshot(tmp_path) == before


def test_a_hub_id_is_the_cached_snapshot_of_main_and_its_commit(single, tmp_path):
    old, new = "a" * 40, "b" * 40
    cache = fake_hub_cache(str(tmp_path / "cache"), "org/tiny", {old: single, new: single})
    path, commit = resolve_directory("org/tiny", cache_dir=cache, local_files_only=True)
    assert commit == new and path == os.path.join(cache, "models--org--tiny", "snapshots", new)
    assert resolve_directory("org/tiny", revision=old, cache_dir=cache, local_files_only=True)[1] == old
    with pytest.raises(CheckpointError, match=r"'org/other' is not a local directory and could not be fetched"):
        resolve_directory("org/other", cache_dir=cache, local_files_only=True)
