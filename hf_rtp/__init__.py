"""hf_rtp: Rotated Tensor Parallelism for Hugging Face Transformers."""

from .api import from_pretrained
from .checkpoint.resume import load_training_state, save_training_state
from .errors import (
    CheckpointError,
    CollectiveMisuseError,
    HfRtpError,
    IntegrationError,
    PlanError,
    RotatedStateError,
    TopologyError,
    UnsupportedModelError,
)
from .integrations.accelerate import Accelerator
from .state import is_rotated, state_of
from .training import ignore_rotated_in_ddp, sync_grads

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "CheckpointError",
    "CollectiveMisuseError",
    "HfRtpError",
    "IntegrationError",
    "PlanError",
    "RotatedStateError",
    "TopologyError",
    "UnsupportedModelError",
    "from_pretrained",
    "ignore_rotated_in_ddp",
    "is_rotated",
    "load_training_state",
    "save_training_state",
    "state_of",
    "sync_grads",
]
