"""The one object a rotated model carries, and `state_of` to read it. A leaf: binding.bind attaches it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, overload

from torch import nn

from ..distributed.ranks.topology import Topology
from ..errors import HfRtpError
from ..plans import Plan, Resolution
from ..settings import LoadSpec

ATTRIBUTE = "_hf_rtp_state"


@dataclass
class RTPState:
    topology: Topology
    plan: Plan
    resolution: Resolution
    sources: dict = field(default_factory=dict)
    """parameter name -> the stored tensors it was read from (checkpoint.conversion.Source), so that
    saving writes those names back"""
    spec: LoadSpec | None = None
    """how this model was loaded (settings, grid, plan): what loading another model like it passes to
    from_pretrained (TRL's reference model, integrations/trl.py)"""


def rotated_module(model: nn.Module) -> nn.Module | None:
    """The model hf_rtp loaded: `model` itself, or inside DDP, PEFT, accelerate or compile wrappers."""
    seen: nn.Module | None = model
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:
        if ATTRIBUTE in getattr(seen, "__dict__", {}):
            return seen
        visited.add(id(seen))
        children = getattr(seen, "_modules", {})
        seen = next(
            (children[k] for k in ("module", "base_model", "model", "_orig_mod") if children.get(k) is not None), None
        )
    return None


def find_rotated(module: nn.Module) -> nn.Module | None:
    """The model hf_rtp loaded inside `module`, wherever it sits (a user's wrapper's `backbone`, an nn.Sequential's
    item): rotated_module's wrappers first, else the first module that carries hf_rtp's state."""
    found = rotated_module(module)
    if found is None:
        found = next((m for m in module.modules() if ATTRIBUTE in m.__dict__), None)
    return found


@overload
def state_of(model: nn.Module) -> RTPState: ...
@overload
def state_of(model: nn.Module, required: Literal[True]) -> RTPState: ...
@overload
def state_of(model: nn.Module, required: bool) -> RTPState | None: ...
def state_of(model: nn.Module, required: bool = True) -> RTPState | None:
    """The state of the rotated model inside `model` (see rotated_module)."""
    found = rotated_module(model)
    if found is None:
        if required:
            raise HfRtpError(f"{type(model).__name__} holds no model loaded with hf_rtp.from_pretrained")
        return None
    return found.__dict__[ATTRIBUTE]


def is_rotated(model: nn.Module) -> bool:
    return state_of(model, required=False) is not None
