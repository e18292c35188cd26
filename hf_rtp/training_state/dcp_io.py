"""The model's and optimizer's tensors through torch.distributed.checkpoint: one safetensors file per rank, no
pickle. Loading reshards: DCP records each chunk's place in the global tensor and every rank reads the rows it
now owns."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

from ..errors import CheckpointError, HfRtpError
from ..model.state import state_of

SHARD_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")  # the files DCP's writer names


def control_group(model: nn.Module):
    """hf_rtp's gloo group with hf_rtp's timeout, whoever made the world group."""
    state = state_of(model, required=False)
    return None if state is None else state.topology.control


def tensors(model: nn.Module, optimizer: torch.optim.Optimizer):
    """The state dicts DCP fills in place, and their tensors under flat names (the writer wants tensors)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # creates optimizer state with the right layout
    flat = {f"model.{k}": v for k, v in model_sd.items()}
    states: Any = optim_sd["state"]  # {fqn: {key: value}}; DCP's annotation covers every state dict shape
    shared: set[int] = set()
    for fqn, state in sorted(states.items()):
        for key, value in _leaves(state):
            if isinstance(value, torch.Tensor) and id(value) not in shared:
                # one tensor several parameters' state holds (bitsandbytes' 8-bit code maps, `qmap1`) is written
                # once, under its first name, and read back into the one tensor they all share
                shared.add(id(value))
                flat[f"optim.{fqn}.{key}"] = value
    return model_sd, optim_sd, flat


def _leaves(state: dict, prefix: str = ""):
    """(dotted key, value) of a parameter's optimizer state, nested dicts walked: bitsandbytes' optimizers put
    their 8-bit state and its scales under `__bnb_optimizer_quant_state__`, which must be saved like the rest."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def scalars(optim_sd) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state that is not a tensor (bitsandbytes keeps `step` as an int), which DCP does
    not write: kept in training_state.json instead, or a resume would restart the optimizer's step count."""
    kept: dict[str, dict[str, Any]] = {}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) or (
                isinstance(value, dict) and all(isinstance(v, torch.Tensor) for _, v in _leaves(value))
            ):
                continue
            if not isinstance(value, (int, float, bool, str, type(None))):
                raise CheckpointError(
                    f"optimizer state {fqn}.{key} is a {type(value).__name__}, which hf_rtp cannot save: only "
                    "tensors (also in dicts) and numbers"
                )
            kept.setdefault(fqn, {})[key] = value
    return kept


def write_tensors(flat: dict, folder: str, group) -> None:
    """Collective: every rank writes its chunks into `folder`, talking on `group` (hf_rtp's timeout, not the
    world's)."""
    writer = dcp.HuggingFaceStorageWriter(folder, save_distributed=True)
    dcp.save(flat, storage_writer=writer, process_group=group)


def read_tensors(flat: dict, directory: str, group) -> None:
    """Collective: every rank reads the rows of `flat`'s tensors it owns, in place."""
    dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(directory), process_group=group)


def stored_tensors(directory: str) -> dict:
    """What DCP recorded of each tensor in `directory`: its dtype, global shape and chunks."""
    try:
        return dcp.HuggingFaceStorageReader(directory).read_metadata().state_dict_metadata
    except Exception as err:
        raise CheckpointError(f"cannot read the tensors of {directory} ({type(err).__name__}: {err})") from err


def keep_loaded_dtypes(model: nn.Module, optimizer, optim_sd: dict) -> None:
    """torch's Optimizer.load_state_dict casts every state tensor but `step` to its parameter's dtype: right for
    moments, wrong for 8-bit codes and their float32 scales (torchao's on rotated rows, integrations/torchao.py,
    which keeps them as plain tensors). Those are put back as DCP read them, in the dtype this optimizer keeps."""
    params = dict(model.named_parameters())
    for fqn, loaded in optim_sd["state"].items():
        state = optimizer.state.get(params[fqn], {}) if fqn in params else {}
        for key, value in loaded.items():
            kept = state.get(key)
            if isinstance(value, torch.Tensor) and isinstance(kept, torch.Tensor) and kept.dtype != value.dtype:
                state[key] = value


@contextmanager
def named_waits(call: str, directory: str) -> Iterator[None]:
    """A wait that times out inside DCP surfaces as gloo's or DCP's own words; say what it means."""
    try:
        yield
    except HfRtpError:
        raise
    except CheckpointException as err:  # DCP's, a BaseException: each failed rank's error, gathered by DCP
        failures = "; ".join(
            f"rank {r}: {type(e[0]).__name__}: {str(e[0])[:300]}" for r, e in sorted(err.failures.items())
        )
        raise CheckpointError(
            f"{call}({directory}) failed in torch.distributed.checkpoint on {failures}. The previous checkpoint, if "
            "any, is untouched"
        ) from None
    except Exception as err:
        raise CheckpointError(
            f"{call}({directory}) failed on this rank: {type(err).__name__}: {str(err)[:500]}. If a timeout is "
            "named, another rank stopped, died or did not call it within HF_RTP_TIMEOUT: every rank must call "
            f"{call}. The previous checkpoint, if any, is untouched"
        ) from err
