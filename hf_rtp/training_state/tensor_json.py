"""Tensors among the optimizer's param groups and the scheduler's state, as training_state.json keeps them."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError
from .metadata import STATE_FILE

_TENSOR = "__hf_rtp_tensor__"  # a tensor among the optimizer's groups or the scheduler's state, restored as one


def to_json(value: Any) -> Any:
    """Param groups and scheduler state for training_state.json. torchao keeps `lr` as a 0-dim tensor (and refuses
    to step with a float in its place), and a scheduler then records its learning rates as tensors too: each
    tensor is kept as its values and dtype, which from_json turns back into that tensor."""
    if isinstance(value, torch.Tensor):
        return {_TENSOR: value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if _TENSOR in value:
            dtype = getattr(torch, str(value.get("dtype")), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"{STATE_FILE} records a tensor of dtype {value.get('dtype')!r}: it is damaged")
            return torch.tensor(value[_TENSOR], dtype=dtype)
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value
