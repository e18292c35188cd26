"""training_state.json as a typed, versioned record (hf_rtp/training_state/metadata.py): what the current format writes
reads back the same, byte for byte; format 1 (extra merged among hf_rtp's keys) is still read; a newer format
and a field of the wrong type are CheckpointErrors that name them."""

import json

import pytest

from hf_rtp.errors import CheckpointError
from hf_rtp.training_state.metadata import FORMAT, FORMATS, Identity, TrainingStateMetadata, read_state, write_state

# training_state.json as hf_rtp wrote it before the record was typed (one rank, AdamW, a StepLR; rng shortened)
WRITTEN = (
    '{"format": 2, "identity": {"class": "LlamaForCausalLM", "plan": "llama"}, "files": {".hf_rtp-state.json": 22, '
    '"shard-00001-model-00001-of-00001.safetensors": 2404}, "param_groups": [{"lr": {"__hf_rtp_tensor__": '
    '0.0010000000474974513, "dtype": "float32"}, "betas": [0.9, 0.999], "eps": 1e-08, "weight_decay": 0.01, '
    '"amsgrad": false, "params": ["0.weight", "0.bias"]}], "scalars": {}, "scheduler": {"step_size": 1, '
    '"_last_lr": [{"__hf_rtp_tensor__": 0.0010000000474974513, "dtype": "float32"}]}, "rng": [{"cpu": [1, 2, 3]}], '
    '"world_size": 1, "extra": {"step": 3, "nested": {"a": [1, 2]}}}'
)


def test_the_written_record_reads_back_and_writes_the_same_bytes(tmp_path):
    state = TrainingStateMetadata.from_json(json.loads(WRITTEN))
    assert state.identity == Identity("LlamaForCausalLM", "llama")
    assert state.files == {".hf_rtp-state.json": 22, "shard-00001-model-00001-of-00001.safetensors": 2404}
    assert state.world_size == 1 and state.extra == {"step": 3, "nested": {"a": [1, 2]}}
    assert json.dumps(state.to_json()) == WRITTEN
    write_state(str(tmp_path), state)
    assert (tmp_path / "training_state.json").read_text() == WRITTEN
    assert read_state(str(tmp_path)) == state
    assert FORMAT == max(FORMATS) == state.to_json()["format"]


def test_a_record_without_the_optional_fields_round_trips():
    state = TrainingStateMetadata(param_groups=[{"params": []}], rng=[{"cpu": [0]}], world_size=2)
    data = json.loads(json.dumps(state.to_json()))
    assert "files" not in data and data["identity"] is None and data["scheduler"] is None
    assert TrainingStateMetadata.from_json(data) == state


def test_format_1_is_still_read_with_extra_merged_among_the_records():
    record = json.loads(WRITTEN)
    del record["extra"]
    record.update(format=1, step=4, data_position=[7, 8])
    assert TrainingStateMetadata.from_json(record).extra == {"step": 4, "data_position": [7, 8]}
    for late in ("format", "identity", "files", "scalars", "scheduler"):  # each came after the first saves
        del record[late]
    state = TrainingStateMetadata.from_json(record)
    assert state.identity is None and state.files is None and state.scalars == {} and state.scheduler is None
    assert state.extra == {"step": 4, "data_position": [7, 8]}


@pytest.mark.parametrize("version", [3, 99, 0])
def test_a_format_this_hf_rtp_does_not_read_is_refused_by_its_number(version):
    record = {**json.loads(WRITTEN), "format": version}
    with pytest.raises(CheckpointError, match=rf"ckpt/training_state.json is in format {version}, which hf_rtp "):
        TrainingStateMetadata.from_json(record, "ckpt/training_state.json")


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("world_size", "4", "world_size is '4', not a whole number"),
        ("world_size", True, "world_size is True, not a whole number"),
        ("format", "2", "format is '2', not a number"),
        ("identity", ["LlamaForCausalLM"], "identity is not an object with a class name"),
        ("identity", {"class": "LlamaForCausalLM", "plan": 3}, "identity's plan is not a name"),
        ("files", {"shard.safetensors": "2404"}, "a file's size in files is not a whole number"),
        ("files", None, "extra or files is not an object"),
        ("scalars", {"0.weight": 1}, "scalars is not an object of objects"),
        ("scheduler", [1], "scheduler is not an object"),
        ("param_groups", {"lr": 1}, "param_groups or rng is not a list"),
        ("param_groups", [1], "a param group is not an object"),
        ("rng", [{"cuda": [1]}], "an RNG state is malformed"),
        ("extra", [1], "extra or files is not an object"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_naming_it(field, value, named):
    record = {**json.loads(WRITTEN), field: value}
    with pytest.raises(CheckpointError) as err:
        TrainingStateMetadata.from_json(record, "ckpt/training_state.json")
    assert str(err.value) == (
        f"ckpt/training_state.json is damaged ({named}); this checkpoint cannot be trusted: resume from an earlier "
        "checkpoint-* folder"
    )


def test_missing_records_and_a_file_that_is_not_a_record_are_named(tmp_path):
    record = json.loads(WRITTEN)
    del record["rng"], record["world_size"]
    with pytest.raises(CheckpointError, match=r"is damaged \(it lacks rng, world_size\)"):
        TrainingStateMetadata.from_json(record)
    with pytest.raises(CheckpointError, match=r"is damaged \(it lacks all\)"):
        TrainingStateMetadata.from_json([1, 2])
    with pytest.raises(CheckpointError, match=r"is not a complete training checkpoint \(no training_state.json\)"):
        read_state(str(tmp_path))
    (tmp_path / "training_state.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"training_state.json is damaged \(.*\); this checkpoint cannot"):
        read_state(str(tmp_path))
