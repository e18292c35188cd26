"""hf_rtp: Rotated Tensor Parallelism for Hugging Face Transformers."""

from .api import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    attach_trainer,
    from_pretrained,
)
from .distributed.tensors.rotated import local_rows
from .errors import (
    CheckpointError,
    CollectiveMisuseError,
    HfRtpError,
    IntegrationError,
    KeywordError,
    PlanError,
    RotatedStateError,
    SettingError,
    TopologyError,
    UnsupportedModelError,
    UnsyncedGradientsError,
)
from .integrations.accelerate import Accelerator
from .integrations.peft import adapter_state_dict
from .model.context import context_parallel, context_parallel_unshard
from .model.data_parallel import ignore_rotated_in_ddp, sync_grads
from .model.host_optimizer import CPUOffloadOptimizer
from .model.state import is_rotated, state_of
from .model.whole import whole_model
from .plans import Plan, register
from .settings import collective_timeout
from .training_state import load_training_state, save_training_state
from .version import __version__  # noqa: F401  (hf_rtp.__version__)

__all__ = [
    "Accelerator",
    "AutoModelForCausalLM",
    "AutoModelForImageTextToText",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "CPUOffloadOptimizer",
    "CheckpointError",
    "CollectiveMisuseError",
    "HfRtpError",
    "IntegrationError",
    "KeywordError",
    "Plan",
    "PlanError",
    "RotatedStateError",
    "SettingError",
    "TopologyError",
    "UnsupportedModelError",
    "UnsyncedGradientsError",
    "adapter_state_dict",
    "attach_trainer",
    "collective_timeout",
    "context_parallel",
    "context_parallel_unshard",
    "from_pretrained",
    "ignore_rotated_in_ddp",
    "is_rotated",
    "load_training_state",
    "local_rows",
    "register",
    "save_training_state",
    "state_of",
    "sync_grads",
    "whole_model",
]
