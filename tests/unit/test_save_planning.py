import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards

from hf_rtp.checkpoint.save import plan_shards
from hf_rtp.settings import parse_size


def test_parse_size_follows_transformers_units():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("5GiB") == 5 * 2**30
    assert parse_size("12KB") == 12_000
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("lots")


def test_shards_match_huggingface_hub_split():
    sizes = [6, 6, 2, 6, 2, 2, 30, 1]
    state = {f"t{i}": torch.zeros(n, dtype=torch.uint8) for i, n in enumerate(sizes)}
    split = split_torch_state_dict_into_shards(state, max_shard_size=10, filename_pattern="m{suffix}.safetensors")
    ours = plan_shards([(k, v.numel()) for k, v in state.items()], 10)
    assert sorted(map(sorted, ours)) == sorted(map(sorted, split.filename_to_tensors.values()))
