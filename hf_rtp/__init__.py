"""hf_rtp: Rotated Tensor Parallelism for Hugging Face Transformers."""

from .api import from_pretrained
from .checkpoint import CheckpointError
from .mesh import TopologyError
from .plans import PlanError, UnsupportedModelError
from .training import ignore_rotated_in_ddp, sync_grads

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "PlanError",
    "TopologyError",
    "UnsupportedModelError",
    "from_pretrained",
    "ignore_rotated_in_ddp",
    "sync_grads",
]
