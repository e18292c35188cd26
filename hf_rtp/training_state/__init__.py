"""Resumable training state: model chunks and optimizer state through torch.distributed.checkpoint,
written as safetensors (one file per rank, no pickle), plus training_state.json for everything else.

Loading reshards: a checkpoint saved by N ranks loads on M, because DCP records each chunk's place
in the global tensor and every rank reads the rows it now owns. A save is atomic (see
save_training_state) and a load verifies before it trusts (see load_training_state).

The modules, each one job: `metadata` (training_state.json, typed and versioned), `tensor_json` (tensors
among its param groups and scheduler state), `dcp_io` (the state dicts and their DCP reads and writes),
`rng`, `verify` (the checks before a loaded state is trusted), `folder` (the target folder, what hf_rtp
wrote there, the atomic swap), `save` and `load`.
"""

from .load import load_training_state
from .save import save_training_state

__all__ = ["load_training_state", "save_training_state"]
