"""training_state.json keeps tensors among the param groups and the scheduler's state (torchao's `lr`) as
tensors, and a damaged record is a CheckpointError, which load_training_state raises on every rank (it decodes
inside the ranks' agreement)."""

import json

import pytest
import torch

from hf_rtp.errors import CheckpointError
from hf_rtp.training_state.tensor_json import from_json as _from_json
from hf_rtp.training_state.tensor_json import to_json as _to_json


def test_tensors_come_back_as_tensors_of_their_dtype_and_value():
    groups = [{"lr": torch.tensor(1e-2 / 3), "betas": (0.9, 0.999), "params": [0, 1]}]
    back = _from_json(json.loads(json.dumps(_to_json(groups))))
    assert isinstance(back[0]["lr"], torch.Tensor) and back[0]["lr"].dtype == torch.float32
    assert torch.equal(back[0]["lr"], groups[0]["lr"])  # bit for bit: the next step's lr is the saved one
    assert back[0]["betas"] == [0.9, 0.999] and back[0]["params"] == [0, 1]
    scheduler = {"_last_lr": [torch.tensor(0.005, dtype=torch.float64)], "last_epoch": 2}
    assert _from_json(json.loads(json.dumps(_to_json(scheduler))))["_last_lr"][0].dtype == torch.float64


def test_a_damaged_tensor_record_is_a_checkpoint_error():
    with pytest.raises(CheckpointError, match="dtype 'flaot32'"):
        _from_json([{"lr": {"__hf_rtp_tensor__": 0.01, "dtype": "flaot32"}}])
