"""The one object a rotated model carries, the one `bind` that attaches it, and `state_of` to read it.

Everything hf_rtp changes on a loaded model happens in `bind`: the state, the collective
save/push/generate, the guard that makes ranks meet at each forward, and the process-wide
switches a rotated model needs (listed there, with why).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

from torch import nn

from . import faults
from .errors import HfRtpError
from .mesh import Topology
from .plans import Plan, Resolution

_ATTRIBUTE = "_hf_rtp_state"


@dataclass
class RTPState:
    topology: Topology
    plan: Plan
    resolution: Resolution
    sources: dict = field(default_factory=dict)
    """parameter name -> the stored tensors it was read from (checkpoint.conversion.Source), so that
    saving writes those names back"""


def bind(model: nn.Module, state: RTPState) -> nn.Module:
    from .checkpoint.save import push, save_pretrained
    from .generation import generate
    from .integrations.peft import make_peft_use_global_features
    from .integrations.trainer import adopt_caller
    from .parameters import keep_rotated
    from .training import allow_mixed_parameters, ignore_rotated_in_ddp

    object.__setattr__(model, _ATTRIBUTE, state)  # not a submodule, not in state_dict
    model.save_pretrained = types.MethodType(save_pretrained, model)
    model.push_to_hub = types.MethodType(push, model)
    model.generate = types.MethodType(generate, model)
    ignore_rotated_in_ddp(model)

    def _apply(self, fn, recurse=True):  # every Trainer moves its model to a device in __init__
        adopt_caller(self)
        applied = type(self)._apply(self, fn, recurse)
        keep_rotated(self)
        return applied

    model._apply = types.MethodType(_apply, model)
    if state.topology.world_size > 1:
        # The backbone, not the model itself: PEFT and TRL call the model's forward directly, which
        # skips the model's hooks, but every causal LM calls its backbone as a module.
        backbone = getattr(model, "base_model", None) or model
        backbone.register_forward_pre_hook(lambda module, args: _before_forward(state))
        allow_mixed_parameters()  # process-wide: clip_grad_norm_ over rotated and replicated grads
        make_peft_use_global_features()  # process-wide, until PEFT knows the `rtp` mesh
    return model


def _before_forward(state: RTPState) -> None:
    from .integrations.accelerate import check_accelerate_state

    # An Accelerator built after from_pretrained can still have come up undistributed: its prepare
    # never tells us, its first forward does. A dict lookup when accelerate is not in use.
    check_accelerate_state(state.topology.world_size)
    faults.point("forward")
    state.topology.enter("forward")


def rotated_module(model: nn.Module) -> nn.Module | None:
    """The model hf_rtp loaded: `model` itself, or inside DDP, PEFT, accelerate or compile wrappers."""
    seen, visited = model, set()
    while seen is not None and id(seen) not in visited:
        if _ATTRIBUTE in getattr(seen, "__dict__", {}):
            return seen
        visited.add(id(seen))
        children = getattr(seen, "_modules", {})
        seen = next((children[k] for k in ("module", "base_model", "model", "_orig_mod") if children.get(k) is not None), None)
    return None


def state_of(model: nn.Module, required: bool = True) -> RTPState | None:
    """The state of the rotated model inside `model` (see rotated_module)."""
    found = rotated_module(model)
    if found is None:
        if required:
            raise HfRtpError(f"{type(model).__name__} holds no model loaded with hf_rtp.from_pretrained")
        return None
    return found.__dict__[_ATTRIBUTE]


def is_rotated(model: nn.Module) -> bool:
    return state_of(model, required=False) is not None
